# sourced: installs the official stack, records the environment, and helpers to run serve once for several loads
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
install="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
[ -d /tmp/official/transformers ] || $install --target /tmp/official .whl/official/*.whl .whl/common/*.whl .whl/server/*.whl || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  PYTHONPATH=/tmp/official python3 -c "import transformers; print('transformers (engine, official)', transformers.__version__)"
  nproc; date -u; git log -1 --format='tree %h %s' 2>/dev/null; } > "$out/environment.txt" 2>&1
cat "$out/environment.txt"
official() { PYTHONPATH=/tmp/official:. "$@"; }
start_serve() {  # model port log: serve as benchmarks/load.py starts it
  official python3 -m qwen3tts_agent.cli serve --model "$1" --port "$2" --max-queued 100000 --queue-timeout 60 \
    --max-sessions 100000 > "$3" 2>&1 &
  serve_pid=$!
  for _ in $(seq 1 400); do python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$2/ready" 2>/dev/null && return 0; sleep 0.5; done
  echo "serve not ready"; return 1
}
load() {  # name args...: one load run against the server started
  local name=$1; shift
  official timeout 200 python3 -m benchmarks.load "$@" --out "$out/load/$name.json" > "$out/load/$name.log" 2>&1
  echo "$name rc=$?"; grep -v DEBUG "$out/load/$name.log" | grep -v "^\[" | tail -6 | cut -c1-700
}
