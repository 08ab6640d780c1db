"""Tools end to end in PD mode: the shared default PD launch (``pd_server``), the real model, the
official ``openai`` client. The cases (tests/tools_cases.py) also run against a colocated server in
tests/clients/test_openai_table.py. In PD the prefill worker masks the first token of the call and
the decode worker continues the grammar."""
from __future__ import annotations

import openai
import pytest

from tools_cases import check_forced_tool_calls

pytestmark = pytest.mark.process


def test_forced_tool_calls_in_pd(pd_server):
    client = openai.OpenAI(base_url=f"{pd_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    check_forced_tool_calls(client)
