# call B1 (fourteenth session): one 0.6B stream (no regression) and a batched 1.7B frame's kernels at 128, 192 and 256 rows
out=$OUT; mkdir -p "$out"
source .carry/s13common.sh
official timeout 200 python3 -m benchmarks.bench_engine --model synthetic:0.6b --single-only --out "$out/single-0.6b.json" > "$out/single-0.6b.log" 2>&1
echo "single rc=$?"; grep -v DEBUG "$out/single-0.6b.log" | tail -8 | cut -c1-240
mkdir -p "$out/timeline"
for b in 128 192 256; do
  official timeout 150 python3 -m benchmarks.frame_timeline --model synthetic:1.7b-customvoice --batch $b --kv-len 256 \
    --out "$out/timeline/frame-1.7b-b$b.json" > "$out/timeline/frame-1.7b-b$b.log" 2>&1
  echo "b=$b rc=$?"; grep -v DEBUG "$out/timeline/frame-1.7b-b$b.log" | tail -6 | cut -c1-200
done
tar czf "$out/timeline.tgz" -C "$out" timeline && rm -rf "$out/timeline"
