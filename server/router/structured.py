"""A request's output constraint, from whichever field names it (OpenAI's ``response_format``,
vLLM's ``structured_outputs``, or vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``), checked by the grammar engine before anything is sent.

``structured_output(req)`` returns the ``StructuredOutput`` for the worker, or None; a 400
``APIError`` names the field when two fields constrain at once, a shape is wrong, or the grammar
engine refuses the constraint (bad schema, regex or grammar).
"""

from __future__ import annotations

import json
from typing import Any

from engine.grammar_spec import check
from server.router.errors import APIError
from server.router.openai_schemas import SamplingFields
from transfer.wire.sampling_params import StructuredOutput

_JSON_OBJECT = json.dumps({"type": "object"})
_OUTPUTS_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _json_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise APIError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    return json.dumps(value)


def _from_response_format(rf: dict) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json", spec=_JSON_OBJECT)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(
                400,
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        return StructuredOutput(kind="json", spec=_json_text(spec["schema"], "response_format"))
    raise APIError(
        400, f"response_format type must be text, json_object or json_schema, got {kind!r}", param="response_format"
    )


def _from_structured_outputs(so: dict) -> StructuredOutput:
    given = {k: v for k, v in so.items() if v not in (None, False)}
    if given.get("json_object"):
        given.pop("json_object")
        given.setdefault("json", {"type": "object"})
    unknown = set(given) - set(_OUTPUTS_KINDS)
    if unknown or len(given) != 1:
        raise APIError(
            400,
            f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got {sorted(so)}",
            param="structured_outputs",
        )
    ((key, value),) = given.items()
    return _spec(key, value, "structured_outputs")


def _spec(key: str, value: Any, param: str) -> StructuredOutput:
    if key == "json":
        return StructuredOutput(kind="json", spec=_json_text(value, param))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param}: choice must be a non-empty list of non-empty strings", param=param)
        return StructuredOutput(kind="choice", spec=json.dumps(value))
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: {key} must be a non-empty string", param=param)
    return StructuredOutput(kind=_OUTPUTS_KINDS[key], spec=value)


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    """The constraint ``req`` asks for (see the module docstring), checked."""
    found: list[tuple[str, StructuredOutput | None]] = []
    if req.response_format is not None:
        found.append(("response_format", _from_response_format(req.response_format)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _spec(key, value, name)))
    found = [(n, so) for n, so in found if so is not None]
    if not found:
        return None
    if len(found) > 1:
        raise APIError(
            400, f"only one output constraint per request; got {', '.join(n for n, _ in found)}", param=found[1][0]
        )
    name, so = found[0]
    try:
        error = check(so)
    except ModuleNotFoundError as e:
        raise APIError(400, f"{name} cannot be served here: {e}", param=name) from None
    if error:
        raise APIError(400, f"{name}: the grammar engine refuses this {so.kind} constraint: {error}", param=name)
    return so
