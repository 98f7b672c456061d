#!/usr/bin/env bash
# calls 4 and 5 (thirteenth session): the int8 CPU backend on the host's 16 cores (no GPU), one run of
# bench_cpu per pool in the order given: `cpu16.sh OUT RUNS POOL...`
#   call 4: cpu16.sh OUT 2 session shared        call 5: cpu16.sh OUT 3 shared session
out=$1; runs=$2; shift 2; source .carry/s13common.sh
lscpu | grep -i "model name\|^CPU(s)\|L3" > "$out/lscpu.txt"; cat "$out/lscpu.txt"
official python3 -c "from qwen3tts_agent.models import ensure_synthetic_checkpoint as e; print(e('synthetic:0.6b'))" | tail -1
mkdir -p "$out/cpu"
for pool in "$@"; do
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES= official timeout 250 python3 -m benchmarks.bench_cpu --model synthetic:0.6b --threads 16 \
    --backends int8 --runs "$runs" --pool "$pool" --out "$out/cpu/cpu-0.6b-$pool.json" > "$out/cpu/cpu-0.6b-$pool.log" 2>&1
  echo "$pool rc=$? in $(( $(date +%s) - t0 )) s"; grep -v "Warning\|warn" "$out/cpu/cpu-0.6b-$pool.log" | grep "frame\|stream\|concurrent\|bandwidth" | cut -c1-250
done
tar czf "$out/cpu.tgz" -C "$out" cpu && rm -rf "$out/cpu"
