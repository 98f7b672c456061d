#!/usr/bin/env bash
# The diagnosis of 2026-12-05 (twentieth session), on this repo's CPU machine (2 cores): ioapp.py (a WebSocket app with
# the TTS session's message pattern and no model) as a Serve replica with direct ingress, permessage-deflate as Serve
# leaves it (FIX=0) and declined as the replicas do since (FIX=1), twice each, open-loop load from ioload.py.
# Usage, from the repo root with the test environment (.venv, Ray 2.60): bash benchmarks/results/2026-12-05-cpu-ray-ws-deflate/run.sh
set -u
here=benchmarks/results/2026-12-05-cpu-ray-ws-deflate
PY=${PY:-.venv/bin/python}
log=$(mktemp)
for fix in 0 1 0 1; do
  (env RAY_SERVE_ENABLE_DIRECT_INGRESS=1 BURN_US=150 FIX=$fix PYTHONPATH=$PWD setsid $PY $here/ioapp.py serve 8400 > "$log" 2>&1 & echo $! > "$log.pid")
  for _ in $(seq 90); do grep -aq READY "$log" && break; sleep 1; done
  port=$(grep -a -o "Started HTTP server on port [0-9]*" "$log" | awk '{print $NF}')
  $PY $here/ioload.py ws://127.0.0.1:$port --rate 20 --label "Serve direct ingress, app on its own thread, 150 us per chunk, FIX=$fix (client offers deflate)"
  sid=$(cat "$log.pid"); for p in $(ps -eo pid,sid | awk -v s=$sid '$2==s{print $1}'); do kill -9 $p 2>/dev/null; done; sleep 3
done
rm -f "$log" "$log.pid"
