# BEFORE: a worktree at def3c5e (the split before: 1 + 1 threads); AFTER: this commit's tree, with its .venv; OUT: where the JSON goes
set -u
for round in 1 2 3; do
  for cfg in before-session after before-shared; do
    case $cfg in
      before-session) dir=$BEFORE; pool=session;;
      before-shared) dir=$BEFORE; pool=shared;;
      after) dir=$AFTER; pool=session;;
    esac
    (cd $dir && $AFTER/.venv/bin/python -m benchmarks.bench_cpu --model synthetic:0.6b --threads 2 --backends int8 --runs 3 --concurrent 0 --frame-reps 3 --pool $pool --out $OUT/$cfg-$round.json 2>&1 | grep "single stream" | sed "s/^/$cfg $round /")
  done
done
echo done
