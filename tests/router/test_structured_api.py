"""The router's side of structured output, against scripted fake workers: every field that names a
constraint reaches the worker as one ``StructuredOutput``; two constraints, wrong shapes and
constraints the grammar engine refuses are 400s naming the field, and nothing is sent.
(Outputs under the constraint: tests/engine/test_structured_output.py, and through HTTP:
tests/clients/test_openai_table.py, tests/e2e/test_pd_http.py.)"""

from __future__ import annotations

import json

import pytest

from tests.support.fake_worker import completion
from transfer.wire.sampling_params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body,want",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput(kind="json", spec='{"type": "object"}')),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            StructuredOutput(kind="json", spec=json.dumps(SCHEMA)),
        ),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(kind="json", spec=json.dumps(SCHEMA))),
        ({"guided_regex": "[a-z]+"}, StructuredOutput(kind="regex", spec="[a-z]+")),
        ({"guided_choice": ["x", "y"]}, StructuredOutput(kind="choice", spec='["x", "y"]')),
        ({"guided_grammar": 'start: "a"+'}, StructuredOutput(kind="grammar", spec='start: "a"+')),
        ({"structured_outputs": {"regex": "[0-9]"}}, StructuredOutput(kind="regex", spec="[0-9]")),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(kind="json", spec='{"type": "object"}')),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_each_field_reaches_the_worker(make_client, body, want):
    client, worker, _ = make_client()
    r = completion(client, max_tokens=2, **body)
    assert r.status_code == 200, r.text
    assert worker.requests[0][2].structured == want
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    )
    assert chat.status_code == 200 and worker.requests[1][2].structured == want, chat.text


@pytest.mark.parametrize(
    "body,param,needle",
    [
        ({"guided_regex": "(", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
        ({"guided_regex": "("}, "guided_regex", "regex"),
        ({"guided_json": "{not json"}, "guided_json", "JSON schema"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "start: @@"}, "guided_grammar", "grammar"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ],
)
def test_bad_constraints_are_400(make_client, body, param, needle):
    client, worker, _ = make_client()
    r = completion(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert worker.requests == []
