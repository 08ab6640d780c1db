"""Tools end to end in PD mode: the shared default PD launch (``pd_server``), the real model, the
official ``openai`` client. The cases (tests/support/tools_cases.py) also run against a colocated server in
tests/clients/test_openai_table.py. In PD the prefill worker masks the first token of the call and
the decode worker continues the grammar. Both workers built the grammar engine's tokenizer in their
background thread at start (logged by engine.grammar) and joined it before serving, not inside the
loop at the first request."""

from __future__ import annotations

import re

import openai
import pytest

from tests.support.tools_cases import check_forced_tool_calls

pytestmark = pytest.mark.process


def test_forced_tool_calls_in_pd(pd_server):
    client = openai.OpenAI(base_url=f"{pd_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    check_forced_tool_calls(client)
    built = re.findall(
        r"\[(\S+)\] engine\.grammar: grammar engine tokenizer built in [0-9.]+ s \(background, at start\)",
        pd_server.log(),
    )
    assert sorted(built) == ["decode-0", "prefill-0"], pd_server.log()[-3000:]
    log = pd_server.log()
    for worker in built:  # joined before the worker serves: no build beside its loop's first requests
        built_at = log.index(f"[{worker}] engine.grammar: grammar engine tokenizer built")
        assert built_at < log.index(f"[{worker}] server.worker.loop: {worker.split('-')[0]} worker {worker} serving")
