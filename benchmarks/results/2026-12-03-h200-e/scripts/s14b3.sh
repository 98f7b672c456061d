# call B3 (fourteenth session): 1.7B-CustomVoice through serve with first-frame steps off (--first-frame-step-load 0)
out=$OUT; mkdir -p "$out"
source .carry/s13common.sh
mkdir -p "$out/load"
t0=$(date +%s)
official python3 -m qwen3tts_agent.cli serve --model synthetic:1.7b-customvoice --port 8125 --max-queued 100000 --queue-timeout 60 \
  --max-sessions 100000 ${SERVE_ARGS:-} > "$out/load/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 1 400); do python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:8125/ready" 2>/dev/null && break; sleep 0.5; done
echo "serve ready in $(( $(date +%s) - t0 )) s"
url=ws://127.0.0.1:8125
for rate in ${RATES:-80 60 20}; do load ws-$rate --url $url --rates $rate --warmup 5 --duration 30; done
kill -TERM $serve_pid; wait $serve_pid
grep -v DEBUG "$out/load/serve.log" | grep "Traceback\|Error" | head -5 | cut -c1-300
grep -v DEBUG "$out/load/serve.log" | gzip > "$out/load/serve.log.gz"; rm -f "$out/load/serve.log"
