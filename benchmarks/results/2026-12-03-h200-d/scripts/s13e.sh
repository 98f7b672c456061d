#!/usr/bin/env bash
# call E (thirteenth session): the int8 CPU backend on the host's 16 cores (no GPU), final tree: the shared pool
# (now the default) against a pool per graph, three streams per mode each
out=$1; source .carry/s13common.sh
lscpu | grep -i "model name\|^CPU(s)\|L3" > "$out/lscpu.txt"; cat "$out/lscpu.txt"
official python3 -c "from qwen3tts_agent.models import ensure_synthetic_checkpoint as e; print(e('synthetic:0.6b'))" | tail -1
mkdir -p "$out/cpu"
for pool in shared session; do
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES= official timeout 250 python3 -m benchmarks.bench_cpu --model synthetic:0.6b --threads 16 \
    --backends int8 --runs 3 --pool $pool --out "$out/cpu/cpu-0.6b-$pool.json" > "$out/cpu/cpu-0.6b-$pool.log" 2>&1
  echo "$pool rc=$? in $(( $(date +%s) - t0 )) s"; grep -v "Warning\|warn" "$out/cpu/cpu-0.6b-$pool.log" | grep "frame\|stream\|concurrent\|bandwidth" | cut -c1-250
done
tar czf "$out/cpu.tgz" -C "$out" cpu && rm -rf "$out/cpu"
