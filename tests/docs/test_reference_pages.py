"""The generated reference pages (``tools/gen_reference.py``) are current, and every flag, metric and
request field they list has a description; ``pdserve`` help reads as a product's.

Each page is compared with what the generator builds from the code now, so a flag, series or field
added, renamed or described differently fails here until ``python tools/gen_reference.py`` is run.
The generator's own checks are tried against a planted fault, so they cannot pass vacuously.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIX = "run `python tools/gen_reference.py` and commit the pages"
HISTORY = re.compile(r"\b(session|issue)s? [0-9]|\bissue-[0-9]|\bseed 0{2}|DESIGN\.md|README", re.I)


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _load_generator()


@pytest.mark.parametrize("page", sorted(GEN.PAGES))
def test_generated_page_is_current(page):
    text, _ = GEN.PAGES[page]()
    path = ROOT / page
    assert path.is_file(), f"{page} is missing: {FIX}"
    assert path.read_text() == text, f"{page} is stale: {FIX}"


def test_every_flag_metric_and_field_has_a_description():
    _, missing = GEN.generate()
    assert not missing, "no description (add one in the code, then regenerate): " + "; ".join(missing)


def test_a_changed_page_is_reported_stale(tmp_path):
    pages, _ = GEN.generate()
    for path, text in pages.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert GEN.stale(pages, tmp_path) == []
    page = "docs/operate/metrics.md"
    (tmp_path / page).write_text(pages[page].replace("pdserve_ttft_seconds", "pdserve_ttft"))
    (tmp_path / "docs/usage/cli-flags.md").unlink()
    assert GEN.stale(pages, tmp_path) == ["docs/usage/cli-flags.md", page]
    assert GEN.main(["--check"]) == 0  # the repository's own pages are current


def test_a_missing_description_is_named(monkeypatch):
    from configs.engine import EngineConfig
    from server.router import extensions, metrics
    from server.router.openai_schemas import ChatCompletionRequest, CompletionRequest

    monkeypatch.setattr(EngineConfig.model_fields["page_size"], "description", "")
    monkeypatch.setitem(metrics.WORKER_COUNTERS, "prompt_tokens", ("pdserve_prompt_tokens", ""))
    monkeypatch.setattr(CompletionRequest.model_fields["top_k"], "description", None)
    monkeypatch.setattr(ChatCompletionRequest.model_fields["top_k"], "description", "")
    monkeypatch.setitem(extensions.IGNORED, "user", " ")
    _, missing = GEN.generate()
    assert "flag --page-size" in missing
    assert "metric pdserve_prompt_tokens_total" in missing
    assert "field top_k (C)" in missing and "field top_k (H)" in missing
    assert "ignored field user has no reason" in missing


def test_request_field_table_lists_every_field_of_both_models():
    from server.router.openai_schemas import ChatCompletionRequest, CompletionRequest

    rows, _ = GEN.request_rows()
    where = {r[0].strip("`"): r[2] for r in rows}
    for model, letter in ((CompletionRequest, "C"), (ChatCompletionRequest, "H")):
        for name in model.model_fields:
            assert letter in where[name].split(), (name, letter)
    assert where["stream_options.include_usage"] == "C H"


def test_metrics_page_lists_every_series_a_scrape_shows():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(GEN.router_registry()).decode()
    exposed = {f.name for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
    listed = {name.removesuffix("_total") for _, name, *_ in GEN.metric_families(GEN.router_registry())}
    assert exposed == listed, exposed ^ listed


def test_help_reads_as_a_product():
    from server.launch.args import build_parser

    parser = build_parser()
    texts = {"pdserve": parser.format_help()}
    for action in parser._subparsers._group_actions:
        texts |= {f"pdserve {name}": sub.format_help() for name, sub in action.choices.items()}
    assert {"pdserve launch", "pdserve worker", "pdserve probe"} <= set(texts)
    found = {cmd: [m.group(0) for m in HISTORY.finditer(text)] for cmd, text in texts.items() if HISTORY.search(text)}
    assert not found, f"development history in --help: {found}"


def test_supported_models_page_lists_every_architecture_the_loader_accepts(monkeypatch):
    from engine import hf_fields, supported_models
    from engine.config import MODEL_ARCHS

    text, missing = GEN.supported_models_page()
    rows = [line for line in text.split("## Refused at load")[0].splitlines() if line.startswith("| `")]
    assert sorted(r.split("`")[1] for r in rows) == sorted(MODEL_ARCHS) and not missing
    monkeypatch.setitem(hf_fields.IMPLEMENTED, "newarch", hf_fields.IMPLEMENTED["llama"])
    monkeypatch.delitem(supported_models.CHECKED_BY, "qwen2")
    text, missing = GEN.supported_models_page()
    assert "| `newarch` | HF folder, GGUF |" in text
    assert missing == [
        "architecture newarch has no test against transformers",
        "architecture qwen2 has no test against transformers",
    ]
