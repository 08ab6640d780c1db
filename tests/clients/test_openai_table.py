"""The official ``openai`` client through every row of the request-field table (docs/usage/request-fields.md), against a
real launched colocated server: each supported or ignored field is sent (with what it needs beside
it) and answered 200; each refused one, sent with a non-default value, gets a 400 whose message
and ``param`` name it. A row added to the table without a value here fails the test."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.process

FIELD_TABLE = Path(__file__).resolve().parents[2] / "docs" / "usage" / "request-fields.md"  # generated
ASSISTANT_LAST = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]

# field -> the request fields to send for it (the field itself and what it needs beside it)
ACCEPTED = {
    "model": {},
    "prompt": {},
    "messages": {},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "stream_options.include_usage": {"stream": True, "stream_options": {"include_usage": True}},
    "stream_options.continuous_usage_stats": {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "seed": {"seed": 3, "temperature": 1.0},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "logit_bias": {"logit_bias": {"1234": 1.0}},
    "stop": {"stop": ["\n"]},
    "stop_token_ids": {"stop_token_ids": [13]},
    "include_stop_str_in_output": {"stop": [" "], "include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "skip_special_tokens": {"skip_special_tokens": False},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "echo": {"echo": True},
    "return_token_ids": {"return_token_ids": True},
    "return_tokens_as_token_ids": {"logprobs": True, "return_tokens_as_token_ids": True},
    "request_id": {"request_id": "table-1"},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 4},
    "truncation_side": {"truncate_prompt_tokens": 4, "truncation_side": "right"},
    "add_special_tokens": {"add_special_tokens": True},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {
        "messages": ASSISTANT_LAST,
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "documents": {"documents": [{"title": "t", "text": "x"}]},
    "chat_template_kwargs": {"chat_template_kwargs": {"a": 1}},
    "priority": {"priority": 1},
    "timeout": {"timeout": 60},
    "n": {"n": 2},
    "best_of": {"best_of": 2, "n": 1},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "response_format": {"response_format": {"type": "json_object"}},
    "structured_outputs": {"structured_outputs": {"regex": "a+"}},
    "guided_json": {"guided_json": {"type": "object"}},
    "guided_regex": {"guided_regex": "a+"},
    "guided_choice": {"guided_choice": ["a", "b"]},
    "guided_grammar": {"guided_grammar": 'start: "a"+'},
    # ignored
    "user": {"user": "u-1"},
    "metadata": {"metadata": {"k": "v"}},
    "store": {"store": True},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "length_penalty": {"length_penalty": 2.0},
    "session_id": {"session_id": "s"},
    "stream_interval": {"stream_interval": 2},
    "vllm_xargs": {"vllm_xargs": {"a": 1}},
    "thinking_token_budget": {"thinking_token_budget": 8},
    "include_reasoning": {"include_reasoning": False},
    "reasoning_effort": {"reasoning_effort": "low"},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "media_io_kwargs": {"media_io_kwargs": {}},
    "mm_processor_kwargs": {"mm_processor_kwargs": {}},
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
}
REFUSED = {
    "min_tokens": 2,
    "use_beam_search": True,
    "watermarking": True,
    "allowed_token_ids": [1],
    "bad_words": ["x"],
    "logprob_token_ids": [1],
    "cache_salt": "s",
    "kv_transfer_params": {"x": 1},
    "ec_transfer_params": {"x": 1},
    "repetition_detection": {"x": 1},
    "logits_processors": ["x"],
    "prompt_embeds": "AAAA",
    "suffix": "end",
    "chat_template": "{{ messages }}",
}


def table_rows() -> list[tuple[str, str, str]]:
    """(field, kind, where) of every row of the request-field table."""
    text = FIELD_TABLE.read_text()
    table = text[text.index("<!-- field-table -->") : text.index("<!-- /field-table -->")]
    return re.findall(r"^\| `([a-z_.]+)` \| ([a-z ()]+) \| ([CH ]+) \|", table, re.M)


ROWS = table_rows()


@pytest.fixture(scope="module")
def client(launched_server):
    srv = launched_server("colocated", "--kv-pool-tokens", "2048", "--max-model-len", "1024", "--log-level", "WARNING")
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _call(client, endpoint: str, fields: dict):
    """One request through the client; a stream is read to its end. Returns the last object."""
    model = client.models.list().data[0].id
    fields = dict(fields)
    stream, options = fields.pop("stream", False), fields.pop("stream_options", None)
    kwargs = {"model": model, "stream": stream, "stream_options": options} if stream else {"model": model}
    if endpoint == "C":
        fields.pop("messages", None)
        if isinstance(fields.get("logprobs"), bool):
            fields["logprobs"] = 1
        out = client.completions.create(
            prompt="The capital of France is", max_tokens=fields.pop("max_tokens", 3), extra_body=fields, **kwargs
        )
    else:
        messages = fields.pop("messages", [{"role": "user", "content": "Hi"}])
        out = client.chat.completions.create(
            messages=messages, max_tokens=fields.pop("max_tokens", 3), extra_body=fields, **kwargs
        )
    return list(out)[-1] if stream else out


def test_table_and_values_agree():
    fields = {f for f, _, _ in ROWS}
    assert fields == set(ACCEPTED) | set(REFUSED), fields ^ (set(ACCEPTED) | set(REFUSED))
    for field, kind, _ in ROWS:
        assert (field in REFUSED) == kind.startswith("refused"), (field, kind)


@pytest.mark.parametrize("field,kind,where", ROWS, ids=[r[0] for r in ROWS])
def test_every_row(client, field, kind, where):
    for endpoint in where.split():
        if kind.startswith("refused"):
            with pytest.raises(openai.BadRequestError) as err:
                _call(client, endpoint, {field: REFUSED[field]})
            assert field in str(err.value.message) and err.value.param == field, err.value.body
        else:
            out = _call(client, endpoint, ACCEPTED[field])
            assert out.id and (out.usage is not None or out.choices), out


def test_n_choices_against_the_model(client):
    """Greedy choices are equal; seeded choice i is the n=1 stream of seed + i (vLLM's rule), and
    streamed choices carry their index; usage sums the choices."""
    model = client.models.list().data[0].id
    ask = dict(model=model, prompt="Once upon a time", max_tokens=8)
    greedy = client.completions.create(n=3, temperature=0, **ask)
    assert len({c.text for c in greedy.choices}) == 1 and [c.index for c in greedy.choices] == [0, 1, 2]
    one = client.completions.create(n=1, temperature=0, **ask)
    assert greedy.choices[0].text == one.choices[0].text
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once (vLLM, OpenAI)
    seeded = client.completions.create(n=2, temperature=1.0, seed=11, **ask)
    alone = [client.completions.create(n=1, temperature=1.0, seed=s, **ask).choices[0].text for s in (11, 12)]
    assert [c.text for c in seeded.choices] == alone and alone[0] != alone[1]
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts.values()), texts


def _worker_counter(base: str, name: str) -> float:
    """Sum over workers of the counter ``name`` on the router's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def _settled_counters(base: str, names: tuple[str, ...]) -> list[float]:
    """The counters once they stop moving across two worker heartbeats (1 s apart): an earlier
    test's requests reach the router's /metrics up to a heartbeat late and must not count here."""
    last = [_worker_counter(base, n) for n in names]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(2.5)
        now = [_worker_counter(base, n) for n in names]
        if now == last:
            return now
        last = now
    raise AssertionError(f"worker counters {names} kept moving for 30 s: {last}")


def test_n_choices_prefill_the_prompt_once(client):
    """n=4 on a fresh 256-token prompt: the three later choices match the first one's full prompt
    pages (inserted into the radix cache at its prefill) and compute only the last page: the
    worker's cached prompt tokens grow by 3 x 240 (page size 16) of the 4 x 256 accepted."""
    model = client.models.list().data[0].id
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    prompt = [random.Random(26).randrange(1000, 20000) for _ in range(256)]
    names = ("pdserve_prompt_tokens_total", "pdserve_cached_prompt_tokens_total")
    before = _settled_counters(base, names)
    r = client.completions.create(model=model, prompt=prompt, n=4, max_tokens=4, temperature=1.0, seed=5)
    assert len(r.choices) == 4 and r.usage.prompt_tokens == 256
    deadline = time.monotonic() + 30
    while True:  # worker counters reach the router with the worker's next heartbeat
        delta = [_worker_counter(base, n) - b for n, b in zip(names, before)]
        if delta[0] >= 4 * 256 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta == [4 * 256, 3 * 240], delta


def test_prompt_logprobs_agree_with_the_sampler(client):
    """The greedy token's logprob from the sampler equals its prompt logprob once it is part of the
    prompt (echo + logprobs + max_tokens=0, lm-eval's loglikelihood call), and the echoed logprobs
    cover every prompt token."""
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    gen = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    text, lp = gen.choices[0].text, gen.choices[0].logprobs.token_logprobs[0]
    echo = client.completions.create(model=model, prompt=prompt + text, max_tokens=0, echo=True, logprobs=2)
    (c,) = echo.choices
    assert c.text == prompt + text and echo.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == echo.usage.prompt_tokens
    assert c.logprobs.token_logprobs[-1] == pytest.approx(lp, abs=1e-3)
    assert all(len(t) >= 2 for t in c.logprobs.top_logprobs[1:])


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**9},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


def test_structured_output_through_the_client(client):
    """json_schema (greedy and sampled, chat and completions, streamed), a choice and a regex: every
    output is valid (the schema checked with jsonschema)."""
    import json

    import jsonschema

    client = client.with_options(timeout=600)  # a loaded CI machine: 60 constrained tokens, three times
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    msgs = [{"role": "user", "content": "Give a city and its population as JSON."}]
    outs = [
        client.chat.completions.create(
            model=model, messages=msgs, max_tokens=60, temperature=t, seed=s, response_format=fmt
        ).choices[0]
        for t, s in ((0, None), (1.0, 1), (1.0, 2))
    ]
    for c in outs:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(
            model=model, messages=msgs, max_tokens=60, temperature=0, response_format=fmt, stream=True
        )
        if ch.choices
    )
    assert streamed == outs[0].message.content
    pick = client.completions.create(
        model=model,
        prompt="My favourite colour is",
        max_tokens=5,
        temperature=1.0,
        seed=3,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert pick.choices[0].text in ("red", "green", "blue")
    code = client.completions.create(
        model=model,
        prompt="A code:",
        max_tokens=8,
        temperature=1.0,
        seed=4,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code.choices[0].text), code.choices[0].text


def test_forced_tool_calls_through_the_client(client):
    """tool_choice required and a named tool, greedy and sampled, whole and streamed (tests/support/tools_cases.py)."""
    from tests.support.tools_cases import check_forced_tool_calls

    check_forced_tool_calls(client.with_options(timeout=600))
