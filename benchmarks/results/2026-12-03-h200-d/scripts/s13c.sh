#!/usr/bin/env bash
# call C (thirteenth session): where a batched 1.7B frame's time goes at 64, 128 and 256 rows
out=$1; source .carry/s13common.sh
mkdir -p "$out/timeline"
for b in 64 128 256; do
  official timeout 150 python3 -m benchmarks.frame_timeline --model synthetic:1.7b-customvoice --batch $b --kv-len 256 \
    --out "$out/timeline/frame-1.7b-b$b.json" > "$out/timeline/frame-1.7b-b$b.log" 2>&1
  echo "b=$b rc=$?"; grep -v DEBUG "$out/timeline/frame-1.7b-b$b.log" | tail -13 | cut -c1-200
done
tar czf "$out/timeline.tgz" -C "$out" timeline && rm -rf "$out/timeline"
