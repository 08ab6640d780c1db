"""vLLM's request extensions and utility routes at the router, against the scripted fake worker of
tests/support/fake_worker.py (no model): every field of the request-field table is accepted, ignored or
refused as the table says; usage counts the stop token as vLLM does; ``/tokenize``,
``/detokenize`` and ``/version`` answer vLLM's shapes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from server.router.extensions import IGNORED, REFUSED, documented_fields
from tests.support.fake_worker import PIECES, completion, sse_events

FIELD_TABLE = Path(__file__).resolve().parents[2] / "docs" / "usage" / "request-fields.md"  # generated
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
# a non-default value for each refused field (the message must name the field)
REFUSED_VALUES = {
    "min_tokens": 2,
    "use_beam_search": True,
    "watermarking": True,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "logprob_token_ids": [3],
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "logits_processors": ["x"],
    "prompt_embeds": "AAAA",
    "suffix": "end",
    "chat_template": "{{ messages }}",
}
IGNORED_VALUES = {
    "user": "u1",
    "metadata": {"k": "v"},
    "store": True,
    "spaces_between_special_tokens": False,
    "length_penalty": 0.5,
    "session_id": "s",
    "stream_interval": 4,
    "vllm_xargs": {"a": 1},
    "thinking_token_budget": 10,
    "include_reasoning": False,
    "reasoning_effort": "low",
    "parallel_tool_calls": False,
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1},
}


def _route(field: str) -> tuple[str, dict]:
    chat_only = field in {
        "tools",
        "tool_choice",
        "chat_template",
        "include_reasoning",
        "reasoning_effort",
        "parallel_tool_calls",
        "media_io_kwargs",
        "mm_processor_kwargs",
    }
    completion_only = field in {"best_of", "suffix", "prompt_embeds"}
    assert not (chat_only and completion_only)
    if chat_only:
        return "/v1/chat/completions", CHAT
    if completion_only:
        return "/v1/completions", {"prompt": "The capital of France", "max_tokens": 16}
    return "/v1/chat/completions", CHAT


def test_value_tables_cover_the_rules():
    assert set(REFUSED_VALUES) == {r.field for r in REFUSED}
    assert set(IGNORED_VALUES) == set(IGNORED)


@pytest.mark.parametrize("field", sorted(IGNORED_VALUES))
def test_ignored_fields_are_accepted_and_change_nothing(make_client, field):
    client, worker, _ = make_client()
    path, body = _route(field)
    plain = client.post(path, json=body)
    r = client.post(path, json={**body, field: IGNORED_VALUES[field]})
    assert r.status_code == 200, r.text
    key = "message" if "chat" in path else "text"
    assert r.json()["choices"][0][key] == plain.json()["choices"][0][key]
    assert worker.requests[0][1:] == worker.requests[1][1:]  # same prompt ids and sampling params


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_fields_name_themselves(make_client, field):
    client, worker, _ = make_client()
    path, body = _route(field)
    r = client.post(path, json={**body, field: REFUSED_VALUES[field]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}=") and "not supported" in err["message"]
    assert worker.requests == []


def test_refused_fields_at_their_defaults_are_accepted(make_client):
    client, _, _ = make_client()
    r = client.post(
        "/v1/chat/completions",
        json={
            **CHAT,
            "min_tokens": 0,
            "use_beam_search": False,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "tools": [],
            "bad_words": [],
        },
    )
    assert r.status_code == 200, r.text
    r = completion(client, best_of=1, suffix="")
    assert r.status_code == 200, r.text


def test_unknown_fields_are_refused_by_name(make_client):
    client, _, _ = make_client()
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)):
        r = client.post(path, json={**body, "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        assert "unknown field" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"foo": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.foo"


def test_malformed_tool_history_is_refused_by_name(make_client):
    client, _, _ = make_client()
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
    ]
    r = client.post("/v1/chat/completions", json={"messages": msgs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls.0.function"


def test_field_table_lists_every_field():
    text = FIELD_TABLE.read_text()
    table = text[text.index("<!-- field-table -->") : text.index("<!-- /field-table -->")]
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| ([a-z ()]+) \|", table, re.M))
    expected = documented_fields() | {
        "stream_options.include_usage",
        "stream_options.continuous_usage_stats",
        "priority",
        "timeout",
    }
    assert set(rows) == expected, set(rows) ^ expected
    assert {f for f, kind in rows.items() if kind.startswith("ignored")} == set(IGNORED)
    refused = {f for f, kind in rows.items() if kind.startswith("refused")}
    assert {r.field for r in REFUSED} <= refused
    assert {r.field for r in REFUSED if r.planned} <= {f for f in refused if "planned" in rows[f]}


# ---- supported extensions -----------------------------------------------------------------------
def _chunks(r) -> list[dict]:
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", {"prompt": "The capital of France", "max_tokens": 16}), ("/v1/chat/completions", CHAT)],
)
def test_continuous_usage_stats(make_client, path, body):
    client, worker, _ = make_client()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(client.post(path, json={**body, "stream": True, "stream_options": opts}))
    n_prompt = len(worker.requests[0][1])
    with_choices = [c for c in chunks if c["choices"]]
    assert all(c["usage"]["prompt_tokens"] == n_prompt for c in with_choices)
    done = [c["usage"]["completion_tokens"] for c in with_choices]
    n = len([t for p in PIECES for t in client.app.state.ctx.tokenizer.encode(p)])
    assert done == sorted(done) and done[0] == (0 if "chat" in path else 1) and done[-1] == n  # chat: role chunk
    assert all(c["usage"]["total_tokens"] == n_prompt + c["usage"]["completion_tokens"] for c in with_choices)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == done[-1]
    # continuous_usage_stats alone (include_usage false, vLLM's rule) and null: no usage anywhere
    for opts in ({"continuous_usage_stats": True}, {"include_usage": None, "continuous_usage_stats": None}):
        chunks = _chunks(client.post(path, json={**body, "stream": True, "stream_options": opts}))
        assert chunks[-1]["choices"] and all("usage" not in c for c in chunks)


def test_include_stop_str_in_output(make_client):
    client, _, _ = make_client()
    assert completion(client, stop=["capital"]).json()["choices"][0]["text"] == " Paris is the "
    r = completion(client, stop=["capital"], include_stop_str_in_output=True)
    assert r.json()["choices"][0]["text"] == " Paris is the capital"
    r = completion(client, stop=["capital"], include_stop_str_in_output=True, stream=True)
    assert "".join(c["choices"][0]["text"] for c in _chunks(r)) == " Paris is the capital"


def test_truncate_prompt_tokens(make_client):
    client, worker, ctx = make_client()
    ids = ctx.tokenizer.encode("one two three four five six seven")
    completion(client, prompt=ids, truncate_prompt_tokens=3)
    completion(client, prompt=ids, truncate_prompt_tokens=3, truncation_side="right")
    completion(client, prompt=ids, truncate_prompt_tokens=-1)  # the context length (512 here): nothing cut
    assert [w[1] for w in worker.requests] == [ids[-3:], ids[:3], ids]
    r = completion(client, prompt=ids, truncate_prompt_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_request_id_and_token_id_labels(make_client):
    client, _, ctx = make_client()
    r = completion(client, request_id="abc-1", logprobs=1, return_tokens_as_token_ids=True, max_tokens=2).json()
    ids = [t for p in PIECES for t in ctx.tokenizer.encode(p)][:2]
    assert r["id"] == "cmpl-abc-1"
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert list(lp["top_logprobs"][0]) == [f"token_id:{ids[0]}"]
    r = client.post(
        "/v1/chat/completions",
        json={**CHAT, "request_id": "q", "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True},
    ).json()
    assert r["id"] == "chatcmpl-q" and r["choices"][0]["logprobs"]["content"][0]["token"] == f"token_id:{ids[0]}"


def test_chat_template_options(make_client):
    client, worker, ctx = make_client()
    tok = ctx.tokenizer
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": msgs, "add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )
    assert r.status_code == 200, r.text
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=False)
    cut = rendered[: rendered.rfind("The colour is") + len("The colour is")]
    assert worker.requests[-1][1] == tok.encode(cut) and not cut.endswith(rendered)
    assert r.json()["choices"][0]["message"]["content"] == "The colour is" + "".join(PIECES)
    r = client.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    client.post("/v1/chat/completions", json={"messages": msgs[:1], "add_generation_prompt": False})
    assert worker.requests[-1][1] == tok.encode(tok.apply_chat_template(msgs[:1], add_generation_prompt=False))
    chunks = _chunks(
        client.post(
            "/v1/chat/completions",
            json={
                "messages": msgs,
                "echo": True,
                "stream": True,
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        )
    )
    assert chunks[1]["choices"][0]["delta"] == {"content": "The colour is"}


# ---- usage and logprobs as vLLM counts them ------------------------------------------------------
def test_stop_token_is_counted_not_shown(make_client, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    client, _, _ = make_client({"eos": eos})
    n = len([t for p in PIECES for t in tokenizer.encode(p)])
    for skip in (True, False):
        r = completion(client, return_token_ids=True, logprobs=0, skip_special_tokens=skip).json()
        c = r["choices"][0]
        assert c["text"] == "".join(PIECES) and c["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == n + 1 and c["token_ids"][-1] == eos
        assert c["logprobs"]["token_logprobs"][-1] == -0.25 and len(c["logprobs"]["tokens"]) == n + 1
    chunks = _chunks(
        client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    )
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "".join(PIECES)
    assert chunks[-1]["usage"]["completion_tokens"] == n + 1


def test_logprobs_zero_has_the_sampled_token(make_client, tokenizer):
    client, _, _ = make_client()
    lp = completion(client, logprobs=0, max_tokens=3).json()["choices"][0]["logprobs"]
    assert [list(e) for e in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    assert [list(e.values()) for e in lp["top_logprobs"]] == [[v] for v in lp["token_logprobs"]]
    lp = completion(client, logprobs=2, max_tokens=1).json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"][0]) == 2  # the sampled token is also the top one: no duplicate


# ---- /tokenize, /detokenize, /version -----------------------------------------------------------
def test_tokenize_detokenize_version(make_client, tokenizer):
    client, _, _ = make_client()
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert r == {
        "count": len(ids),
        "max_model_len": 512,
        "tokens": ids,
        "token_strs": [tokenizer.id_to_token(i) for i in ids],
    }
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/tokenize", json={"model": "fake-model", "messages": msgs}).json()
    assert r["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(msgs)) and r["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    assert client.get("/version").json()["version"]
    bad = client.post("/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={"prompt": "x", "model": "m"}).status_code == 404
    r = client.post("/tokenize", json={"prompt": "x", "nope": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "nope"


def test_tokenize_needs_the_api_key(make_client):
    client, _, _ = make_client(api_key="k")
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
    ok = client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200 and client.get("/version").status_code == 200


def test_tokenizer_exports_a_folder_transformers_loads(tokenizer, tmp_path):
    """guidellm and aiperf count tokens with transformers' AutoTokenizer; the exported folder gives
    them the served model's exact tokenizer and chat template, offline."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer.save_hf_folder(tmp_path / "tok"))
    text = "Hello world, the capital of France is Paris. Ünïcödé ✓"
    assert hf(text)["input_ids"] == tokenizer.encode(text, add_special_tokens=True)
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == tokenizer.apply_chat_template(
        msgs
    )
    assert hf.eos_token_id in tokenizer.eos_token_ids


def test_n_null_means_one(make_client):
    client, _, _ = make_client()
    assert completion(client, n=None).status_code == 200
    r = completion(client, n=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "n must be in" in r.json()["error"]["message"]
