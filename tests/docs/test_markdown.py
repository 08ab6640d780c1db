"""Every tracked Markdown file renders as written: parsed by markdown-it-py (CommonMark plus GitHub's
tables), its code fences pair, its relative links and images point at files that exist, and each
``#anchor`` names a heading of the target file by GitHub's slug rules.

An unpaired fence is the fault that turns the rest of a file inside out (code shown as prose and
prose as code), so it is checked on the source lines, not only through the parser, which accepts it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")
HTML_REF = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""")
HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""")


def tracked_markdown() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return sorted(p for p in out.stdout.split("\0") if p)


def parser() -> MarkdownIt:
    return MarkdownIt("commonmark").enable(["table", "strikethrough"])


def tokens(text: str) -> list:
    return parser().parse(text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading text: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _inline_text(inline) -> str:
    parts = []
    for child in inline.children or []:
        if child.type in ("text", "code_inline"):
            parts.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append(" ")
    return "".join(parts)


def anchors(text: str) -> set[str]:
    """Every ``#anchor`` of a document: its headings' slugs (repeats numbered -1, -2, ...) and HTML
    ``<a name|id>`` anchors."""
    toks, seen, out = tokens(text), {}, set()
    for i, tok in enumerate(toks):
        if tok.type == "heading_open":
            base = slug(_inline_text(toks[i + 1]))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out | set(HTML_ANCHOR.findall(text))


def fence_problems(text: str) -> list[str]:
    """Fences that do not pair: one never closed, or an opening line (with an info string) inside a
    block, where its author meant a new block and the previous one lacked its closing line."""
    lines, problems = text.splitlines(), []
    for tok in tokens(text):
        if tok.type != "fence":
            continue
        start, end = tok.map
        char, size = tok.markup[0], len(tok.markup)
        last = FENCE.match(lines[end - 1]) if end - 1 > start else None
        if not (last and last.group(1)[0] == char and len(last.group(1)) >= size and not last.group(2).strip()):
            problems.append(f"line {start + 1}: code fence {tok.markup} is never closed")
            continue
        for n in range(start + 1, end - 1):
            inner = FENCE.match(lines[n])
            if inner and inner.group(1)[0] == char and len(inner.group(1)) >= size and inner.group(2).strip():
                problems.append(
                    f"line {n + 1}: an opening fence inside the code block of line {start + 1} "
                    f"(that block closes at line {end}; is a closing fence missing before line {n + 1}?)"
                )
    return problems


def references(text: str) -> list[tuple[str, str]]:
    """(kind, target) of every link and image of a document, HTML ``src``/``href`` included."""
    out = []
    for tok in tokens(text):
        if tok.type in ("html_block",):
            out += [("html", ref) for ref in HTML_REF.findall(tok.content)]
        for child in tok.children or []:
            if child.type == "link_open":
                out.append(("link", child.attrGet("href")))
            elif child.type == "image":
                out.append(("image", child.attrGet("src")))
            elif child.type == "html_inline":
                out += [("html", ref) for ref in HTML_REF.findall(child.content)]
    return out


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for kind, ref in references(text):
        if not ref or SCHEME.match(ref):
            continue
        target, _, anchor = ref.partition("#")
        target = unquote(target.split("?")[0])
        dest = path if not target else (ROOT / target.lstrip("/") if target.startswith("/") else path.parent / target)
        if not dest.exists():
            problems.append(f"{kind} {ref}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} missing")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest.read_text()):
            problems.append(f"{kind} {ref}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


FILES = tracked_markdown()


def test_markdown_files_are_found():
    assert "README.md" in FILES


@pytest.mark.parametrize("name", FILES)
def test_renders_and_fences_pair(name):
    text = (ROOT / name).read_text()
    assert parser().render(text)
    problems = fence_problems(text)
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.parametrize("name", FILES)
def test_links_anchors_and_images_resolve(name):
    problems = link_problems(ROOT / name, (ROOT / name).read_text())
    assert not problems, f"{name}: " + "; ".join(problems)


# ---- the checks themselves, on planted faults ------------------------------------------------------
def test_an_unclosed_or_early_closed_fence_is_caught():
    assert fence_problems("# t\n\n```\ncode\n```\n\ntext\n") == []
    assert fence_problems("````\n```bash\nx\n```\n````\n") == []  # a fence shown inside a longer one
    assert fence_problems("```\ncode\n\ntext\n") == ["line 1: code fence ``` is never closed"]
    early = "```\na\n```bash\nb\n```\nprose\n"  # the first block lost its closing line
    assert [p.split(":")[0] for p in fence_problems(early)] == ["line 3"]
    shifted = "```\na\n```\nb\n```\n# prose\n```\nc\n```\n"  # one closing line too many: odd count
    assert [p.split(":")[0] for p in fence_problems(shifted)] == ["line 9"]


def test_broken_links_anchors_and_images_are_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Run it: `make serve`!\n\n## Run it: `make serve`!\n")
    (tmp_path / "docs" / "p.png").write_bytes(b"")
    page = tmp_path / "README.md"
    good = "[a](docs/a.md#run-it-make-serve-1) [t](#top) ![p](docs/p.png) [w](https://x.org/y#z)\n\n# Top\n"
    page.write_text(good)
    assert link_problems(page, good) == []
    bad = '[a](docs/b.md) [h](docs/a.md#nothing) ![p](docs/q.png) <img src="docs/r.png">\n'
    found = link_problems(page, bad)
    assert [p.split(":")[0] for p in found] == [
        "link docs/b.md",
        "link docs/a.md#nothing",
        "image docs/q.png",
        "html docs/r.png",
    ], found
