#!/usr/bin/env bash
# call A (thirteenth session): 0.6B (cloned voice) through serve, 256 streams held: as calls (the next request once
# the last has played) and back to back (the next once received, the figures of earlier sessions)
out=$1; source .carry/s13common.sh
official python3 -c "from qwen3tts_agent.models import ensure_synthetic_checkpoint as e; print(e('synthetic:0.6b'))" | tail -1
mkdir -p "$out/load"
t0=$(date +%s); start_serve synthetic:0.6b 8123 "$out/load/serve.log" || exit 1; echo "serve ready in $(( $(date +%s) - t0 )) s"
url=ws://127.0.0.1:8123
load held256-played --url $url --rates --held 256 --warmup 10 --duration 30
load held256-back-to-back --url $url --rates --held 256 --back-to-back --warmup 5 --duration 30
kill -TERM $serve_pid; wait $serve_pid
grep -v DEBUG "$out/load/serve.log" | grep "Traceback\|Error" | head -5 | cut -c1-300
grep -v DEBUG "$out/load/serve.log" | gzip > "$out/load/serve.log.gz"; rm -f "$out/load/serve.log"
tar czf "$out/load06.tgz" -C "$out" load && rm -rf "$out/load"
ls -la "$out"
