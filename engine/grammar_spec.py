"""``StructuredOutput`` -> an llguidance grammar, and its validation (no torch: the router uses it).

``grammar_of(so)`` builds the grammar text llguidance's matcher takes; ``check(so)`` returns the
error message of an invalid constraint (bad regex, schema, or grammar), or None. Raises
``ModuleNotFoundError`` with the install hint when llguidance is missing.
"""

from __future__ import annotations

import json

from transfer.wire.sampling_params import StructuredOutput

INSTALL_HINT = "structured output needs llguidance: pip install 'pdserve[structured]' (make install does)"


def _llguidance():
    try:
        import llguidance
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(INSTALL_HINT) from e
    return llguidance


def grammar_of(so: StructuredOutput) -> str:
    """The llguidance grammar (JSON text) enforcing ``so``."""
    m = _llguidance().LLMatcher
    if so.kind == "json":
        return m.grammar_from_json_schema(so.spec)
    if so.kind == "regex":
        return m.grammar_from_regex(so.spec)
    if so.kind == "choice":
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(so.spec)))
    return m.grammar_from_lark(so.spec)


def check(so: StructuredOutput) -> str | None:
    """The reason ``so`` cannot be enforced, or None when it can."""
    try:
        grammar = grammar_of(so)
    except ValueError as e:
        return str(e)
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) if is_error else None
