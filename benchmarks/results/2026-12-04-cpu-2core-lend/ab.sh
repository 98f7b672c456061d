# BEFORE: a worktree at f36d51c (the graphs on their one thread whatever the codec does); AFTER: this commit's
# tree, with its .venv; OUT: where the JSON goes. Rounds of before, after; then one with 4 streams at once.
set -u
for round in 1 2 3; do  # round 3 ran after the concurrent round
  for cfg in before after; do
    dir=$AFTER; [ $cfg = before ] && dir=$BEFORE
    (cd $dir && $AFTER/.venv/bin/python -m benchmarks.bench_cpu --model synthetic:0.6b --threads 2 --backends int8 --runs 3 --concurrent 0 --frame-reps 3 --out $OUT/$cfg-$round.json 2>&1 | grep "single stream\|frame step" | sed "s/^/$cfg $round /")
  done
done
for cfg in before after; do
  dir=$AFTER; [ $cfg = before ] && dir=$BEFORE
  (cd $dir && $AFTER/.venv/bin/python -m benchmarks.bench_cpu --model synthetic:0.6b --threads 2 --backends int8 --runs 1 --concurrent 4 --frame-reps 3 --out $OUT/$cfg-concurrent.json 2>&1 | grep "concurrent\|single stream" | sed "s/^/$cfg concurrent /")
done
echo done
# the opt-in int4 backend, after only (run afterwards, by hand):
#   .venv/bin/python -m benchmarks.bench_cpu --model synthetic:0.6b --threads 2 --backends int4 --runs 3 --concurrent 0 --frame-reps 3 --out $OUT/after-int4.json
