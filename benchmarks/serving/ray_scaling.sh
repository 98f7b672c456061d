#!/usr/bin/env bash
# Scale-out through `serve-ray`: the same load against 1 and then 2 engine replicas, measured through the
# Serve endpoint with benchmarks/serving/load.py (client processes, first audio timed at the client). Writes
# OUT/replicas-N.json (load.py's report), OUT/serve-ray-N.log and OUT/conditions.txt (versions, command,
# `uptime` before and after each run, and the CPU seconds each kind of process used during the load: the
# replicas, Serve's proxy and controller, Ray's own daemons and the load's clients; on a machine of few
# cores they compete, and other work on a shared machine moves CPU timings).
#
# With `serve` in REPLICA_COUNTS, the same load also runs against plain `qwen3tts-agent serve` (its engine core in a
# process, API workers by default), the baseline a deployment on one GPU is compared with (OUT/serve.json).
# After each Serve run, OUT/replicas-N-spread.json gives each replica's share of the utterances and sessions
# (from /metrics/replicas, before and after the load).
#
# With DIRECT=1, `serve-ray --direct-ingress`: each replica also serves a port of its own (Serve's direct ingress,
# docs/ray.md), and the load's client processes go to those ports, spread evenly (load.py --client-urls, the list
# from GET /v1/replicas; --clients must be a multiple of the replicas), with the metrics still read through the proxy.
#
# Usage: bash benchmarks/serving/ray_scaling.sh OUT "LOAD ARGS FOR 1 REPLICA (and serve)" "LOAD ARGS FOR 2 REPLICAS"
#   CPU: bash benchmarks/serving/ray_scaling.sh OUT "--rates 0.6 0.9" "--rates 1.2 1.8"
#   GPU: NUM_GPUS=1 NUM_CPUS=4 ENGINE_CORE=process MODEL=synthetic:0.6b TORCH_THREADS= \
#        bash benchmarks/serving/ray_scaling.sh OUT "--held 128 --rates 24" "--held 256 --rates 48"
#   one GPU, two replicas on it beside `serve` (run_h200.sh's ray-1gpu stage):
#        REPLICA_COUNTS="serve 2" NUM_GPUS=0.5 SERVE_ARGS="--max-streams 128" ... \
#        bash benchmarks/serving/ray_scaling.sh OUT "--rates 1 20 40" "--rates 1 20 40"
#   one GPU, direct ingress, two replicas of half of it then one of all of it (run_h200.sh's ray-1gpu-direct stage):
#        DIRECT=1 REPLICA_COUNTS="2 1" GPUS_PER_DEPLOYMENT=1 ... bash benchmarks/serving/ray_scaling.sh OUT "..." "..."
# Env: PYTHON (python3), PORT (18200), MODEL (synthetic:tiny), ENGINE_CORE (thread), NUM_GPUS (0), NUM_CPUS (1),
#      TORCH_THREADS (1; empty: torch's default), LOAD_COMMON (--clients 2 --warmup 5 --duration 30 --frames 100),
#      SERVE_ARGS (more serve-ray options), BASELINE_ARGS (more `serve` options), REPLICA_COUNTS (default "1 2"),
#      DIRECT (0; 1: direct ingress, above), GPUS_PER_DEPLOYMENT (empty; a number: N replicas get it / N GPUs each,
#      in place of NUM_GPUS)
set -euo pipefail
OUT="$1"; LOAD1="$2"; LOAD2="$3"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
PORT="${PORT:-18200}"
MODEL="${MODEL:-synthetic:tiny}"
ENGINE_CORE="${ENGINE_CORE:-thread}"
NUM_GPUS="${NUM_GPUS:-0}"
NUM_CPUS="${NUM_CPUS:-1}"
TORCH_THREADS="${TORCH_THREADS-1}"
LOAD_COMMON="${LOAD_COMMON:---clients 2 --warmup 5 --duration 30 --frames 100}"
SERVE_ARGS="${SERVE_ARGS:-}"
BASELINE_ARGS="${BASELINE_ARGS:-}"
REPLICA_COUNTS="${REPLICA_COUNTS:-1 2}"
DIRECT="${DIRECT:-0}"
GPUS_PER_DEPLOYMENT="${GPUS_PER_DEPLOYMENT:-}"
mkdir -p "$OUT"
cd "$ROOT"
threads=()
[ -n "$TORCH_THREADS" ] && threads=(--torch-threads "$TORCH_THREADS")
gpu_note="$NUM_GPUS GPU each"
if [ -n "$GPUS_PER_DEPLOYMENT" ]; then gpu_note="$GPUS_PER_DEPLOYMENT GPU(s) shared by each deployment's replicas"; fi
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "host: $(uname -srm), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB"
    echo "python: $("$PYTHON" -V 2>&1); ray $("$PYTHON" -c 'import ray; print(ray.__version__)' 2>/dev/null | tail -1); torch $("$PYTHON" -c 'import torch; print(torch.__version__)' | tail -1)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "replicas: model $MODEL, engine core $ENGINE_CORE, $gpu_note, $NUM_CPUS Ray CPU each, torch threads ${TORCH_THREADS:-default}"
    if [ "$DIRECT" = 1 ]; then
        echo "direct ingress: the load's clients on the replicas' own ports (GET /v1/replicas), metrics through the proxy"
    fi
    echo "load: $LOAD_COMMON | 1 replica: $LOAD1 | 2 replicas: $LOAD2"
} > "$OUT/conditions.txt"

cpu_by_process() {  # CPU seconds so far of the running processes, summed per kind: "kind seconds" lines
    ps -eo pid=,ppid=,times=,args= | awk '{
        parent[$1] = $2; cpu[$1] = $3; name[$1] = $4; line[$1] = $0
    } END {
        for (pid in cpu) {
            kind = name[pid]
            if (kind == "awk") continue  # this very program, whose text names them all
            if (kind ~ /^ray::/) sub(/\..*/, "", kind)  # ray::ServeReplica:APP:EngineReplica, ray::ProxyActor, ...
            else if (line[pid] ~ /spawn_main/ && name[parent[pid]] ~ /^ray::ServeReplica/) kind = "engine-cores"
            else if (line[pid] ~ /raylet|gcs_server|dashboard|log_monitor|ray\/_private|ray\/autoscaler/) kind = "ray-daemons"
            else if (line[pid] ~ /qwen3tts_agent.cli serve-ray/) kind = "serve-ray-driver"
            else if (line[pid] ~ /qwen3tts_agent.cli serve / || (line[pid] ~ /spawn_main/ && line[parent[pid]] ~ /qwen3tts_agent.cli serve /)) kind = "serve-supervisor-core-workers"
            else continue
            total[kind] += cpu[pid]
        }
        for (k in total) print k, total[k]
    }'
}

machine_busy() {  # CPU seconds the whole machine has been busy (all cores; /proc/stat: not idle, not iowait)
    awk -v hz="$(getconf CLK_TCK)" '/^cpu / { print ($2 + $3 + $4 + $7 + $8 + $9) / hz; exit }' /proc/stat
}

children_cpu() {  # user + system seconds of the waited-for children in the output of bash's `times`
    awk 'NR == 2 { split($1, u, /[ms]/); split($2, s, /[ms]/); print u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$1"
}

cpu_during() {  # cpu_during BEFORE AFTER WALL: per kind, CPU seconds used between the two snapshots
    awk -v wall="$3" 'NR == FNR { before[$1] = $2; next } {
        used = $2 - before[$1]; total += used
        printf "    %-40s %7.1f s CPU (%.2f cores)\n", $1, used, used / wall
    } END { printf "    %-40s %7.1f s CPU (%.2f cores) over %d s\n", "all server processes", total, total / wall, wall }' "$1" "$2"
}

direct_urls() {  # direct_urls COUNT: the replicas' own ws:// URLs once GET /v1/replicas lists COUNT of them
    local urls=""
    for _ in $(seq 300); do
        urls=$("$PYTHON" -c 'import json, sys, urllib.request
replicas = json.load(urllib.request.urlopen(sys.argv[1], timeout=10))["replicas"]
print(" ".join(r["ws"] for r in replicas) if len(replicas) == int(sys.argv[2]) else "")' \
            "http://127.0.0.1:$PORT/v1/replicas" "$1" 2>/dev/null || true)
        [ -n "$urls" ] && { echo "$urls"; return 0; }
        sleep 1
    done
    echo "GET /v1/replicas did not list $1 direct endpoints" >&2
    return 1
}

replica_counts() {  # replica_counts FILE: per replica, its utterances, sessions and health so far (JSON)
    "$PYTHON" -c 'import json, sys; from benchmarks.serving.ray_faults import poll_replicas
json.dump(poll_replicas(sys.argv[1]).replicas, sys.stdout)' "ws://127.0.0.1:$PORT" > "$1"
}

spread() {  # spread BEFORE AFTER: each replica's share of the utterances finished between the two snapshots
    "$PYTHON" - "$1" "$2" <<'PY'
import json, sys
before, after = (json.load(open(p)) for p in sys.argv[1:3])
done = {r: v.get("qwen3tts_utterances_total", 0) - before.get(r, {}).get("qwen3tts_utterances_total", 0) for r, v in after.items()}
total = sum(done.values()) or 1
print(json.dumps({"utterances": done, "share": {r: round(n / total, 3) for r, n in done.items()}}))
PY
}

run() {  # run REPLICAS LOAD_ARGS  (REPLICAS "serve": the plain server, the baseline)
    local replicas="$1" load="$2" server gpus="$NUM_GPUS" direct=() client_urls=()
    if [ -n "$GPUS_PER_DEPLOYMENT" ] && [ "$replicas" != serve ]; then
        gpus=$(awk "BEGIN { print $GPUS_PER_DEPLOYMENT / $replicas }")
    fi
    if [ "$DIRECT" = 1 ]; then direct=(--direct-ingress); fi
    if [ "$replicas" = serve ]; then
        # shellcheck disable=SC2086
        env ${TORCH_THREADS:+OMP_NUM_THREADS=$TORCH_THREADS} "$PYTHON" -m qwen3tts_agent.cli serve --model "$MODEL" \
            --port "$PORT" --max-queued 100000 --queue-timeout 60 --max-sessions 100000 \
            --log-level warning $BASELINE_ARGS > "$OUT/serve.log" 2>&1 &
    else
        # shellcheck disable=SC2086
        env ${TORCH_THREADS:+OMP_NUM_THREADS=$TORCH_THREADS} "$PYTHON" -m qwen3tts_agent.cli serve-ray --model "$MODEL" --replicas "$replicas" \
            --num-gpus "$gpus" --num-cpus "$NUM_CPUS" "${threads[@]}" --engine-core "$ENGINE_CORE" --port "$PORT" \
            --max-queued 100000 --queue-timeout 60 --max-sessions 100000 --log-level warning "${direct[@]}" $SERVE_ARGS \
            > "$OUT/serve-ray-$replicas.log" 2>&1 &
    fi
    server=$!
    trap "kill -INT $server 2>/dev/null || true" EXIT
    for _ in $(seq 900); do
        curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
        kill -0 $server 2>/dev/null || { echo "the server exited (see its log in $OUT)"; exit 1; }
        sleep 1
    done
    if [ "$DIRECT" = 1 ] && [ "$replicas" != serve ]; then
        local urls; urls=$(direct_urls "$replicas") || exit 1
        read -r -a client_urls <<< "$urls"
        client_urls=(--client-urls "${client_urls[@]}")
        echo "$replicas replica(s) of $gpus GPU each, direct endpoints: $urls" >> "$OUT/conditions.txt"
    fi
    echo "$replicas replica(s), before: $(uptime)" >> "$OUT/conditions.txt"
    cpu_by_process > "$OUT/.cpu-before"
    local busy_before; busy_before=$(machine_busy)
    local started=$SECONDS
    times > "$OUT/.times-before"  # this shell's waited-for children so far (the load's clients come next)
    local name="replicas-$replicas"
    [ "$replicas" = serve ] && name=serve
    [ "$replicas" = serve ] || replica_counts "$OUT/.replicas-before"
    # shellcheck disable=SC2086
    "$PYTHON" -m benchmarks.serving.load --url "ws://127.0.0.1:$PORT" "${client_urls[@]}" --model "$MODEL" $LOAD_COMMON $load \
        --out "$OUT/$name.json"
    times > "$OUT/.times-after"
    if [ "$replicas" != serve ]; then
        replica_counts "$OUT/.replicas-after"
        spread "$OUT/.replicas-before" "$OUT/.replicas-after" | tee "$OUT/$name-spread.json"
    fi
    local wall=$((SECONDS - started))
    cpu_by_process > "$OUT/.cpu-after"
    local busy_after; busy_after=$(machine_busy)
    {
        echo "$replicas replica(s), after:  $(uptime)"
        echo "  CPU used during the load ($wall s wall, $(nproc) cores):"
        cpu_during "$OUT/.cpu-before" "$OUT/.cpu-after" "$wall"
        local clients; clients=$(awk "BEGIN { print $(children_cpu "$OUT/.times-after") - $(children_cpu "$OUT/.times-before") }")
        awk -v wall="$wall" -v c="$clients" 'BEGIN { printf "    %-40s %7.1f s CPU (%.2f cores)\n", "load clients (benchmarks/serving/load.py)", c, c / wall }'
        awk -v wall="$wall" -v a="$busy_before" -v b="$busy_after" 'BEGIN { printf "    %-40s %7.1f s CPU (%.2f cores): the rest is other work\n", "whole machine busy", b - a, (b - a) / wall }'
    } >> "$OUT/conditions.txt"
    rm -f "$OUT/.cpu-before" "$OUT/.cpu-after" "$OUT/.times-before" "$OUT/.times-after" "$OUT"/.replicas-*
    kill -INT $server
    wait $server || true
    trap - EXIT
}

for replicas in $REPLICA_COUNTS; do
    case $replicas in 1|serve) run "$replicas" "$LOAD1" ;; *) run "$replicas" "$LOAD2" ;; esac
done
