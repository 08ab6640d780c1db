"""Peak memory and wall time of loading a model into the CPU engine, one load per process.

``python -m benchmarks.load_memory load MODEL [--dtype float32|bfloat16|int8] [--emulate-int8]`` loads
MODEL (a pdserve model spec: a HF folder or a GGUF file) through ``engine.loader.load_for_engine`` and
builds the model from it (``LlamaModel.load_weights``, what ``ModelRunner`` runs before it sizes the
KV pool) in that dtype, then prints one line: the process's resident set before the load (imports
done), after it (the checkpoint's tensors released), its peak over the whole process (``VmHWM`` of
``/proc/self/status``) and the load's wall time. The model is built directly rather than through
``ModelRunner`` so that the dtype asked for is the one built (the runner runs ``--dtype bfloat16`` in
float32 on a CPU without AVX512-BF16) and no KV pool is counted.

``int8`` is bfloat16 with weight-only int8 matmul weights (``--weight-dtype int8``), which needs
AVX512-BF16; ``--emulate-int8`` runs its quantization on any CPU with oneDNN's reorder of the
dequantized copy replaced by a plain copy of the same bytes and no kernel warm-up: the load's memory
and time, not a model to serve.

``python -m benchmarks.load_memory bf16-copy SRC OUT``: a copy of HF folder SRC with every floating
safetensors tensor stored as bfloat16 (config and tokenizer files copied as they are).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch


def status_kb(field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/self/status``, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def emulate_int8() -> None:
    """Let ``pack(w, int8=True)`` run on a CPU without AVX512-BF16: every weight is accepted, oneDNN's
    reorder (which needs bfloat16 instructions) becomes a contiguous copy, and the kernels' warm-up
    (oneDNN bfloat16 primitives) is skipped."""
    from engine import cpu_linear, model

    cpu_linear.int8_supported = model.int8_supported = lambda w: None
    cpu_linear.onednn_layout = lambda w: w.contiguous().clone()
    model.LlamaModel.warm_up = lambda self: None


def load(model: str, dtype: str) -> tuple[float, object]:
    """``(seconds, model)``: ``model`` loaded and built in ``dtype`` on CPU, the checkpoint released."""
    from configs.engine import EngineConfig
    from engine.loader import load_for_engine
    from engine.model import LlamaModel
    from engine.model_paths import resolve_model_path

    path = resolve_model_path(model)
    int8 = dtype == "int8"
    serving = torch.bfloat16 if int8 else getattr(torch, dtype)
    start = time.perf_counter()
    cfg, weights = load_for_engine(path, EngineConfig(model=str(path)))
    built = LlamaModel(cfg, torch.device("cpu"), serving, int8=int8)
    built.load_weights(weights)
    del weights
    return time.perf_counter() - start, built


def bf16_copy(src: Path, out: Path) -> None:
    """``out``: HF folder ``src`` with its floating tensors stored as bfloat16."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
            save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, out / f.name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_memory", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("load", help="load MODEL and print its memory and time")
    lp.add_argument("model")
    lp.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "int8"))
    lp.add_argument("--emulate-int8", action="store_true", help="int8 on a CPU without AVX512-BF16 (see above)")
    cp = sub.add_parser("bf16-copy", help="copy HF folder SRC to OUT with bfloat16 tensors")
    cp.add_argument("src", type=Path)
    cp.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "bf16-copy":
        bf16_copy(a.src, a.out)
        return
    if a.emulate_int8:
        emulate_int8()
    before = status_kb("VmRSS")
    seconds, _model = load(a.model, a.dtype)
    print(
        f"{a.model} {a.dtype}: RSS before {before / 2**20:.2f} GiB, after {status_kb('VmRSS') / 2**20:.2f} GiB, "
        f"peak {status_kb('VmHWM') / 2**20:.2f} GiB; load {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
