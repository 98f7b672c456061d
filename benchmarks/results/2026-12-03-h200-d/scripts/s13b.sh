#!/usr/bin/env bash
# call B (thirteenth session): 1.7B-CustomVoice through serve at 20/s over the WebSocket and over HTTP, and 80/s
out=$1; source .carry/s13common.sh
official python3 -c "from qwen3tts_agent.models import ensure_synthetic_checkpoint as e; print(e('synthetic:1.7b-customvoice'))" | tail -1
mkdir -p "$out/load"
t0=$(date +%s); start_serve synthetic:1.7b-customvoice 8124 "$out/load/serve.log" || exit 1; echo "serve ready in $(( $(date +%s) - t0 )) s"
url=ws://127.0.0.1:8124
load ws-http-20 --url $url --rates 20 --transports ws http --warmup 5 --duration 30
load ws-80 --url $url --rates 80 --warmup 5 --duration 30
kill -TERM $serve_pid; wait $serve_pid
grep -v DEBUG "$out/load/serve.log" | grep "Traceback\|Error" | head -5 | cut -c1-300
grep -v DEBUG "$out/load/serve.log" | gzip > "$out/load/serve.log.gz"; rm -f "$out/load/serve.log"
tar czf "$out/load17.tgz" -C "$out" load && rm -rf "$out/load"
ls -la "$out"
