# call B2 (fourteenth session): 1.7B-CustomVoice through serve: 20 / s, then 50-80 / s over the WebSocket
out=$OUT; mkdir -p "$out"
source .carry/s13common.sh
official python3 -c "from qwen3tts_agent.models import ensure_synthetic_checkpoint as e; print(e('synthetic:1.7b-customvoice'))" | tail -1
mkdir -p "$out/load"
t0=$(date +%s); start_serve synthetic:1.7b-customvoice 8124 "$out/load/serve.log" || exit 1; echo "serve ready in $(( $(date +%s) - t0 )) s"
url=ws://127.0.0.1:8124
for rate in ${RATES:-20 80 60}; do load ws-$rate --url $url --rates $rate --warmup 5 --duration 30; done
kill -TERM $serve_pid; wait $serve_pid
grep -v DEBUG "$out/load/serve.log" | grep "Traceback\|Error" | head -5 | cut -c1-300
grep -v DEBUG "$out/load/serve.log" | gzip > "$out/load/serve.log.gz"; rm -f "$out/load/serve.log"
ls -la "$out" "$out/load"
