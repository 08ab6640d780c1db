"""``--worker-kv-pool-tokens``: a launch's workers with KV pools of their own size."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from configs.schema import PdserveConfig, worker_pool_tokens
from server.launch.launcher import worker_argv
from server.launch.roles import worker_config, worker_specs

pytestmark = pytest.mark.unit


def cfg(**cluster) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": 1024},
            "server": {"api_key": "s3cret"},
            "cluster": {"mode": "pd", "decode": 2, **cluster},
        }
    )


def test_the_form_is_id_equals_tokens():
    assert worker_pool_tokens("") == {}
    assert worker_pool_tokens(" decode-1=4096, prefill-0=512 ") == {"decode-1": 4096, "prefill-0": 512}
    for bad in ("decode-1", "decode-1=", "=4096", "decode-1=0", "decode-1=4k", "decode-1=-5"):
        with pytest.raises(ValueError, match=r"should be ID=TOKENS \(e.g. decode-1=4096\)"):
            worker_pool_tokens(bad)


def test_a_worker_the_deployment_does_not_run_is_refused_by_name():
    with pytest.raises(
        ValidationError,
        match=r"names decode-2, not a worker of this pd deployment "
        r"\(prefill-0, decode-0, decode-1\)",
    ):
        cfg(worker_kv_pool_tokens="decode-2=4096")
    with pytest.raises(ValidationError, match="not a worker of this colocated deployment"):
        cfg(mode="colocated", worker_kv_pool_tokens="decode-0=4096")
    with pytest.raises(ValidationError, match="should be ID=TOKENS"):
        cfg(worker_kv_pool_tokens="decode-1:4096")


def test_only_the_named_worker_gets_its_size_and_no_worker_gets_the_api_key():
    c = cfg(worker_kv_pool_tokens="decode-1=4096")
    sizes = {s.worker_id: worker_config(c, s.worker_id).engine.kv_pool_tokens for s in worker_specs(c)}
    assert sizes == {"prefill-0": 1024, "decode-0": 1024, "decode-1": 4096}
    spec = worker_specs(c)[2]
    sent = json.loads(worker_argv(spec, c)[worker_argv(spec, c).index("--config-json") + 1])
    assert sent["engine"]["kv_pool_tokens"] == 4096 and sent["server"]["api_key"] is None
    assert c.engine.kv_pool_tokens == 1024  # the launch's own config is unchanged
