# call A (fourteenth session): the attention kernel's tilings at the batched frame's shapes
out=$OUT; mkdir -p "$out"
source .carry/s13common.sh
official timeout 420 python3 -m benchmarks.bench_attention --out "$out/attention.json" 2>&1 | tee "$out/attention.log" | grep -v DEBUG | cut -c1-260
