"""The module boundaries the design relies on, checked over the whole import graph (lazy imports
inside functions included): every import goes down the declared layer order, no two modules import
each other through any path, the router and the wire protocol never load torch, files and classes
stay small, and token deltas survive the wire unchanged."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from transfer.wire.protocol import ProtocolError, TokenBatch, TokenDelta, decode, encode

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "transfer",
    "cache",
    "configs",
    "engine",
    "prefill_worker",
    "decode_worker",
    "server",
    "bench",
    "benchmarks",
)

# Lowest first. A module may import its own layer or any layer below it, never one above. A module
# belongs to the longest prefix listed. Nothing outside tests/ imports ``bench``.
LAYERS: list[tuple[str, ...]] = [
    ("transfer.wire",),  # control messages, sampling params, Outbox: plain data
    ("cache",),  # pages, pools, radix trees, KV budget
    ("configs",),  # pydantic settings
    ("engine",),  # model, kernels, sampler, schedulers' shared parts
    ("transfer",),  # KV data plane (NIXL, ucxx, loopback)
    ("server.discovery",),  # discovery targets, the etcd gateway client
    ("prefill_worker", "decode_worker"),  # the PD schedulers
    ("server.router", "server.worker"),  # HTTP router; worker process and loop
    ("server.launch",),  # CLI, launcher, supervisor, ports, roles, probe
    ("bench.harness",),  # launched-server and in-process PD harnesses
    ("bench",),  # benchmarks, on top of everything
    ("benchmarks",),  # one-off studies, outside the wheel
]
MAX_FILE_LINES = 450
MAX_CLASS_METHODS = 20


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` imports, at any depth of the file (``from a import b`` counts
    ``a.b`` when that is a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n in MODULES}


GRAPH = {m: _imports(p) - {m} for m, p in MODULES.items()}


def layer_of(module: str) -> int:
    best, layer = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), i
    assert layer >= 0, f"{module} is in no declared layer"
    return layer


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_import_goes_down_the_declared_order():
    upward = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if layer_of(d) > layer_of(m))
    assert upward == []


def test_no_module_cycles():
    assert _cycles(GRAPH) == []


def test_no_cycle_between_folders():
    folders: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        folders.setdefault(m.split(".")[0], set()).update(d.split(".")[0] for d in deps)
    assert _cycles({f: deps - {f} for f, deps in folders.items()}) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("server.router.app") < layer_of("server.launch.cli") < layer_of("bench.cli")


def test_files_and_classes_stay_small():
    too_long, too_wide = [], []
    for p in [*MODULES.values(), *(ROOT / "tests").rglob("*.py")]:
        text = p.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{p.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_CLASS_METHODS:
                    too_wide.append(f"{p.relative_to(ROOT)}:{node.name}: {len(methods)} methods")
    assert (too_long, too_wide) == ([], [])


def test_no_dataclass_writes_its_own_init():
    """A ``@dataclass`` with a hand-written ``__init__`` compares and hashes by fields it never set."""
    offenders = []
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and any(_names_dataclass(d) for d in node.decorator_list):
                if any(isinstance(b, ast.FunctionDef) and b.name == "__init__" for b in node.body):
                    offenders.append(f"{p.relative_to(ROOT)}:{node.name}")
    assert offenders == []


def _names_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return getattr(target, "id", getattr(target, "attr", None)) == "dataclass"


@pytest.mark.process  # a fresh interpreter
def test_router_and_protocol_do_not_import_torch():
    code = (
        "import sys, transfer.wire.protocol, transfer.wire.outbox, server.router.app; "
        "print(sorted(m for m in ('torch', 'engine.sampling', 'engine.model') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_token_batch_round_trip():
    deltas = [
        TokenDelta(rid="a", token_ids=[5, 6], logprobs=[-0.1, -0.2], top_logprobs=[None, [(6, -0.2)]]),
        TokenDelta.failed("b", "KV pool too small", 500),
        TokenDelta(rid="c", token_ids=[7], finish_reason="length", prompt_tokens=3, cached_tokens=2),
    ]
    msg, frames = decode(encode(*TokenBatch.pack(deltas)))
    assert msg.unpack(frames[0]) == deltas
    assert b"token_ids" not in encode(*TokenBatch.pack(deltas))[1]  # ids travel in the int32 frame


def test_token_batch_counts_must_match_the_frame():
    msg, frame = TokenBatch.pack([TokenDelta(rid="a", token_ids=[1, 2, 3])])
    with pytest.raises(ProtocolError, match="do not match"):
        msg.unpack(frame[:8])
