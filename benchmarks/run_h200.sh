#!/usr/bin/env bash
# The H200 run: installs the carried wheels, builds the synthetic checkpoints, checks parity, benchmarks the
# engine and the peers on the same checkpoints. Usage (from the repo root, wheels in .whl/ from
# benchmarks/fetch_wheels.sh):  bash benchmarks/run_h200.sh OUT_DIR STAGE...  (benchmarks/device_ab.sh runs cases of one
# stage, e.g. a tree against a BASELINE_PACKAGE, one after another in one call)
# Stages: smoke, sweep, kernels, codec-profile (a graphed codec call's kernels by kind, CODEC_SHAPES="1x1,16x8", CODEC_TAG),
# kernel-tests (pytest -m gpu tests/kernels: the compiled kernels against PyTorch; KERNEL_TESTS names other test files,
# e.g. "tests/kernels/test_conv_epilogue_kernel.py tests/kernels/test_history_kernel.py": the whole suite takes ~6.5 min on an H100),
# timeline (where a 0.6B frame's time goes), first-audio (where one stream's first audio goes on every lane,
# and the one-frame codec graph: benchmarks/engine/first_audio_timeline.py), loop (where a live stream's frame period goes),
# loaded-timeline (CUPTI over a loaded engine: a batched step's kernels, gaps and the other lanes' overlap;
# benchmarks/engine/loaded_timeline.py; LOADED_MODEL, LOADED_RATE, LOADED_ARGS, LOAD_TAG), parity,
# parity-1.7b (fp32), parity-odd (fp32, checkpoints in shapes no released model has, one per model type,
# and one whose predictor the kernels refuse), engine-0.6b, engine-1.7b, single-0.6b (one stream only), peers-0.6b, peers-1.7b,
# budget-1.7b and budget-0.6b (the device time one utterance costs a loaded engine, by part:
# benchmarks/engine/bench_device_budget.py; BUDGET_STREAMS slots, default 256; an H100 holds 192 of 1.7B beside
# the official model, 224 of 0.6B),
# load-1.7b and load-0.6b (through `serve` from client processes: benchmarks/serving/load.py; LOAD_RATES, LOAD_HELD,
# LOAD_WINDOW, LOAD_TRANSPORTS override the rates, streams held, window seconds and transports; LOAD_SERVER_ARGS
# adds `serve` options, e.g. "--workers=2"; LOAD_TAG suffixes the reports' names (a second run beside the
# first, e.g. LOAD_TAG=-hold0 LOAD_SERVER_ARGS=--codec-hold-ms=0); LOAD_PROFILE=SECONDS samples the core and the API workers with
# py-spy from .whl/tools in each window: benchmarks/serving/profiling.py), capacity-1.7b and capacity-0.6b (the
# highest rate with <= 1 % refused, <= 1 % underrun, first audio p95 <= 100 ms: load.py --capacity, as the load
# stages take LOAD_WINDOW (default 30 here), LOAD_TRANSPORTS (the first), LOAD_SERVER_ARGS, LOAD_TAG and LOAD_PROFILE;
# CAPACITY_ARGS adds options, e.g. "--capacity-from 40"; a budget-1.7b / budget-0.6b stage run before it in the same
# OUT_DIR gives the device's ceiling beside the capacity), soak (10,000
# mixed utterances through the server at load: flat RSS, CUDA memory back to its value, metrics that add up;
# SOAK_UTTERANCES, SOAK_CONCURRENCY), hostile (good clients at 20 req/s of 1.7B-CustomVoice through `serve` beside
# every kind of hostile client, one SIGKILL of the engine core under load, then every gauge back to 0:
# benchmarks/serving/hostile.py; HOSTILE_DURATION seconds of arrivals, default 3600; HOSTILE_RATE, HOSTILE_MODEL,
# HOSTILE_CONCURRENCY, HOSTILE_ARGS (more options, e.g. "--workers 2") and HOSTILE_TAG (suffixes the reports' names)
# override it), cpu-0.6b (the CPU backend on the host's CPU cores only), turn-latency
# (an LLM's first token -> first audio, text paced at 30/60/100 tokens/s, through the engine, Pipecat
# TOKEN/SENTENCE and the WebSocket: benchmarks/serving/turn_latency.py; Pipecat from .whl/pipecat; TURN_MODELS,
# TURN_ARGS and TURN_TAG override the models, add options and suffix the report's name), prefix-ab (one
# stream, first audio with the voice-prefix cache off, on, and on with the staged prefill, 0.6B and 1.7B),
# startup (`serve` launch -> /ready with 256 slots: cold, warm, and after `prepare`; benchmarks/serving/startup.py;
# STARTUP_CASES picks them, `profiled` adds a warm start sampled by py-spy from .whl/tools, STARTUP_CACHE_ROOT
# keeps each case's caches there),
# ray-install (Ray Serve from .whl/ray into .ray-site/: a call of its own that carries .whl/ray only, see
# benchmarks/fetch_ray_wheels.sh), ray-1gpu (in a later call to the same warm machine: two replicas of synthetic:0.6b
# sharing its one GPU, half a GPU each (slots by their share of its memory), beside plain `serve`, at 1, 20 and 40 req/s over the WebSocket
# and 20 req/s over HTTP; RAY_WINDOW sets the window seconds; RAY_REPLICA_COUNTS="serve" the baseline alone, "2" the
# replicas alone), ray-1gpu-faults (the two replicas at 20 req/s while one engine-core process and then one replica
# are SIGKILLed: benchmarks/serving/ray_faults.py), ray-1gpu-autoscale (one half-GPU replica that may become two,
# --autoscale-on RAY_AUTOSCALE_ON (engine-load; ongoing-requests is Serve's signal), --upscale-delay RAY_UPSCALE_DELAY (10 s), the server's own
# queue bounds (a full replica refuses), arrivals ramping from 5 to 40 req/s over RAY_RAMP_WINDOW s (180); RAY_SERVE_ARGS adds serve-ray options, RAY_MPS=1 runs it
# under CUDA MPS) and ray-2gpu (on nvidia-h200-x2, likewise:
# `serve-ray` with 1 then 2 replicas of synthetic:0.6b, one GPU each, through the Serve endpoint:
# benchmarks/serving/ray_scaling.sh; RAY_LOAD1 / RAY_LOAD2 override the load of each).
# Also ray-1gpu-direct (after ray-install, like ray-1gpu: Serve's direct ingress, `serve-ray --direct-ingress`, two
# replicas of half the GPU then one of all of it, the load's 4 client processes on the replicas' own ports
# (load.py --client-urls) at ray-1gpu's rates; RAY_REPLICA_COUNTS, RAY_WINDOW, RAY_SERVE_ARGS as there), and
# ray-1gpu-mps (likewise, after ray-install: the two half-GPU replicas on their own ports under a CUDA MPS control
# daemon of the stage's own, so that their kernels share the GPU at once rather than by turns; RAY_MPS_INGRESS="direct
# proxy" runs them on their own ports and then through Serve's proxy). stress (mixed streams in-process at an open-loop
# rate, no server: benchmarks/engine/stress.py; STRESS_MODEL, STRESS_ARGS, STRESS_TAG; by default 1.7B-CustomVoice at 75
# req/s with the 1-frame second chunk, where the engine core once died of an illegal memory access) and sanitize (the
# same on synthetic:tiny-customvoice under compute-sanitizer's memcheck, which names the kernel and address of an
# out-of-bounds access; every step is slow there, so at a low rate with refusals off; SANITIZE_ARGS; SANITIZE_EAGER=1
# runs it without CUDA graphs and with PyTorch's caching allocator off, so that memcheck sees each tensor's own bounds).
# The smoke stage tries the engine's defaults, then without the Triton kernels, then also without the
# codec's own stream; the later stages run with the first set of flags that passed (and say so). NO_PDL=1 adds --no-pdl (no programmatic
# dependent launch for the Triton kernels) to the smoke, sweep, kernels, parity and engine stages.
set -uo pipefail
out=${1:?output folder}; shift
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: a baseline's stages run from another folder
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
install="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
if [ "$*" = ray-install ]; then  # its call carries .whl/ray alone (64 MiB per call), so not ray.serve's needs
  rm -rf .ray-site && $install --target .ray-site .whl/ray/*.whl && PYTHONPATH=.ray-site python3 -c \
    "import ray; print('ray', ray.__version__, 'installed in .ray-site')" | tee -a "$out/environment.txt"
  exit $?
fi
[ -d /tmp/official ] || $install --target /tmp/official .whl/official/*.whl .whl/common/*.whl .whl/server/*.whl || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  PYTHONPATH=/tmp/official python3 -c "import transformers; print('transformers (engine, official)', transformers.__version__)"
  date -u; } | tee -a "$out/environment.txt"

# BASELINE_PACKAGE=.whl/baseline.tgz (made here with `git archive REV qwen3tts_agent | gzip > .whl/baseline.tgz`,
# and carried): the stages run that earlier package instead of this tree's, for a before and after on one machine
# in one call (give its runs a LOAD_TAG of their own). They run from /tmp/baseline, which holds that package beside
# links to the rest of this tree (the benchmarks, the wheels), since `python -m` puts the working folder first.
if [ -n "${BASELINE_PACKAGE:-}" ]; then
  repo=$PWD
  rm -rf /tmp/baseline && mkdir -p /tmp/baseline && tar xzf "$BASELINE_PACKAGE" -C /tmp/baseline || exit 1
  for f in "$repo"/* "$repo"/.[!.]*; do [ "$(basename "$f")" = qwen3tts_agent ] || ln -s "$f" /tmp/baseline/; done
  cd /tmp/baseline || exit 1
  echo "baseline package from $BASELINE_PACKAGE" | tee -a "$out/environment.txt"
fi
official() { PYTHONPATH=/tmp/official:. python3 "$@"; }
official -c "import importlib.util as u; print('qwen3tts_agent from', u.find_spec('qwen3tts_agent').origin)" | tee -a "$out/environment.txt"
checkpoint() { official -c "from qwen3tts_agent.models import ensure_synthetic_checkpoint as e; print(e('$1'))" | tail -1; }

flags=""
pdl=${NO_PDL:+--no-pdl}
server_args=()  # LOAD_SERVER_ARGS="--workers=2 ...": extra `serve` options for the load stages
for a in ${LOAD_SERVER_ARGS:-}; do server_args+=("--server-arg=$a"); done
if [ -n "${LOAD_PROFILE:-}" ]; then  # py-spy from .whl/tools: each window's profile in the report, raw stacks tarred
  [ -x /tmp/py-spy/bin/py-spy ] || $install --target /tmp/py-spy .whl/tools/py_spy-*.whl || exit 1
  server_args+=(--profile "$LOAD_PROFILE" --py-spy /tmp/py-spy/bin/py-spy)
fi
tar_profile() { if [ -d "$out/$1" ]; then tar czf "$out/$1-profile.tgz" -C "$out" "$1" && rm -rf "${out:?}/$1"; fi; }
# the Ray stages' needs on this warm machine: Ray from ray-install, the server's wheels, the 0.6B checkpoint
ray_ready() {
  [ -f .ray-site/ray/__init__.py ] || { echo "run the ray-install stage first (same warm machine)"; exit 2; }
  [ -f /tmp/official/fastapi/__init__.py ] || $install --target /tmp/official .whl/server/*.whl || exit 1
  checkpoint synthetic:0.6b > /dev/null
}
# CMD... under CUDA MPS: one control daemon with pipe and log folders of its own (processes started without
# CUDA_MPS_PIPE_DIRECTORY never see it; no setting of the GPU changes), quit when CMD is done; its log lands in
# $out/mps-daemon-log-STAGE.tgz. Where the machine has no nvidia-cuda-mps-control, says so and runs nothing.
with_mps() {
  command -v nvidia-cuda-mps-control > /dev/null || { echo "no nvidia-cuda-mps-control on this machine: skipped"; return 0; }
  ( export CUDA_MPS_PIPE_DIRECTORY=/tmp/qwen3tts-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/qwen3tts-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || exit 1
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    "$@" )
  tar czf "$out/mps-daemon-log-$stage.tgz" -C /tmp/qwen3tts-mps log
}
# benchmarks/serving/ray_scaling.sh on this one GPU into $out/NAME, with the one-GPU stages' load; the VAR=value
# arguments after NAME say how the deployments differ (replica counts, GPUs, direct ingress)
ray_1gpu_load() {
  local name=$1; shift
  env "$@" PYTHON=python3 PYTHONPATH="/tmp/official:$PWD/.ray-site:$PWD" PATH="$PWD/.ray-site/bin:$PATH" NUM_CPUS=4 \
    ENGINE_CORE=process MODEL=synthetic:0.6b TORCH_THREADS= SERVE_ARGS="${RAY_SERVE_ARGS:-}" \
    LOAD_COMMON="--clients 4 --warmup 3 --duration ${RAY_WINDOW:-15} --frames 100 --transports ws http --http-rates 20" \
    bash benchmarks/serving/ray_scaling.sh "$out/$name" "${RAY_LOAD1:---rates 1 20 40}" "${RAY_LOAD1:---rates 1 20 40}" \
    2>&1 | tee -a "$out/$name.log"
}
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    smoke)
      for flags in "" "--no-fused-kernels" "--no-fused-kernels --no-overlap-codec"; do
        if timeout 300 bash -c "PYTHONPATH=/tmp/official:. python3 -m benchmarks.engine.bench_engine --model synthetic:0.6b \
             --smoke $flags $pdl --out $out/smoke-0.6b.json" >> "$out/smoke.log" 2>&1; then echo "smoke passed with flags: '$flags'"; break
        else echo "smoke FAILED with flags: '$flags'"; grep -v Assertion "$out/smoke.log" | tail -4; fi
      done ;;
    sweep) official -m benchmarks.kernels.sweep_gemv $pdl --out "$out/gemv-sweep.json" 2>&1 | tee "$out/gemv-sweep.log" ;;
    kernels) official -m benchmarks.kernels.bench_kernels --batches ${KERNEL_BATCHES:-1 4 16 32 64 128 256} --no-fp32-timing $pdl \
               --out "$out/kernels.json" 2>&1 | tee "$out/kernels.log" ;;
    codec-profile) official -m benchmarks.kernels.profile_codec ${CODEC_SHAPES:+--shapes $CODEC_SHAPES} \
                     --out "$out/codec-profile${CODEC_TAG:-}.json" 2>&1 | tee "$out/codec-profile${CODEC_TAG:-}.log" ;;
    timeline) official -m benchmarks.engine.frame_timeline --model synthetic:0.6b --out "$out/timeline-b1.json" 2>&1 | tee "$out/timeline.log" ;;
    loaded-timeline) official -m benchmarks.engine.loaded_timeline --model ${LOADED_MODEL:-synthetic:0.6b} --rate ${LOADED_RATE:-120} \
                       ${LOADED_ARGS:-} --out "$out/loaded-timeline${LOAD_TAG:-}.json" 2>&1 | tee "$out/loaded-timeline${LOAD_TAG:-}.log" ;;
    loop) official -m benchmarks.engine.loop_timeline --model synthetic:0.6b --out "$out/loop-timeline.json" 2>&1 | tee "$out/loop-timeline.log" ;;
    # 205 frames: at least 200, and the last chunk (6 frames) decodes in two graphed pieces
    parity) official -m benchmarks.engine.gpu_parity --model synthetic:0.6b --frames 205 ${PARITY_DTYPES:+--dtypes $PARITY_DTYPES} \
              $flags $pdl --out "$out/parity-0.6b.json" 2>&1 | tee "$out/parity.log" ;;
    parity-1.7b) official -m benchmarks.engine.gpu_parity --model synthetic:1.7b --frames 205 --dtypes float32 $flags $pdl \
                   --out "$out/parity-1.7b.json" 2>&1 | tee "$out/parity-1.7b.log" ;;
    # fp32 with TF32 off (gpu_parity sets it): head_dim 24/40, GQA 5:1/3:1, predictor as wide as the talker;
    # widehead's predictor (head_dim 272) runs on the PyTorch layers beside a Triton talker
    parity-odd) official -m benchmarks.engine.gpu_parity --frames 40 --dtypes float32 --max-seq-len 256 $flags $pdl \
                  --model synthetic:odd,synthetic:odd-customvoice,synthetic:odd-voicedesign,synthetic:widehead \
                  --out "$out/parity-odd.json" 2>&1 | tee "$out/parity-odd.log" ;;
    kernel-tests) PYTHONPATH=/tmp/official:. python3 -m pytest -m gpu -q -p no:cacheprovider ${KERNEL_TESTS:-tests/kernels} \
                    2>&1 | tee "$out/kernel-tests.log" ;;
    engine-0.6b) official -m benchmarks.engine.bench_engine --model synthetic:0.6b --rates ${RATES:-8,16,32,48} --window ${WINDOW:-8} \
                   $flags $pdl --out "$out/engine-0.6b.json" 2>&1 | tee "$out/engine-0.6b.log" ;;
    first-audio) models=${FIRST_AUDIO_MODELS:-synthetic:0.6b-customvoice,synthetic:1.7b-customvoice}
                 for m in ${models//,/ }; do checkpoint $m > /dev/null; done
                 official -m benchmarks.engine.first_audio_timeline --model "$models" ${FIRST_AUDIO_ARGS:-} --out "$out/first-audio${FIRST_AUDIO_TAG:-}.json" \
                   2>&1 | tee "$out/first-audio${FIRST_AUDIO_TAG:-}.log" ;;
    single-0.6b) official -m benchmarks.engine.bench_engine --model synthetic:0.6b --single-only $flags $pdl \
                   --out "$out/single-0.6b.json" 2>&1 | tee "$out/single-0.6b.log" ;;
    budget-1.7b|budget-0.6b) model=synthetic:${stage#budget-}; [ "$stage" = budget-1.7b ] && model+=-customvoice
                   official -m benchmarks.engine.bench_device_budget --model "$model" \
                   --max-streams ${BUDGET_STREAMS:-256} --out "$out/$stage.json" 2>&1 | tee "$out/$stage.log" ;;
    load-1.7b) checkpoint synthetic:1.7b-customvoice > /dev/null
               official -m benchmarks.serving.load --model synthetic:1.7b-customvoice --rates ${LOAD_RATES:-1 20 40 80} \
                 --held ${LOAD_HELD:-} --transports ${LOAD_TRANSPORTS:-ws http} --http-rates ${LOAD_HTTP_RATES:-20} \
                 --duration ${LOAD_WINDOW:-60} --warmup 5 "${server_args[@]}" \
                 --server-log "$out/serve-1.7b${LOAD_TAG:-}.log" --out "$out/load-1.7b${LOAD_TAG:-}.json" 2>&1 \
                 | tee "$out/load-1.7b${LOAD_TAG:-}.log"
               tar_profile "load-1.7b${LOAD_TAG:-}" ;;
    load-0.6b) checkpoint synthetic:0.6b > /dev/null
               official -c "import soundfile as sf; from qwen3tts_agent.reference import demo_reference as d; sf.write('/tmp/ref.wav', *d())"
               ref_text=$(official -c "import benchmarks.engine.bench_engine as b; print(b.REF_TEXT)" | tail -1)
               official -m benchmarks.serving.load --model synthetic:0.6b --rates ${LOAD_RATES:-20} --held ${LOAD_HELD:-256} \
                 --transports ${LOAD_TRANSPORTS:-ws} --duration ${LOAD_WINDOW:-60} --warmup 5 "${server_args[@]}" \
                 --server-arg=--default-voice-audio=/tmp/ref.wav "--server-arg=--default-voice-text=$ref_text" \
                 --server-log "$out/serve-0.6b${LOAD_TAG:-}.log" --out "$out/load-0.6b${LOAD_TAG:-}.json" 2>&1 \
                 | tee "$out/load-0.6b${LOAD_TAG:-}.log"
               tar_profile "load-0.6b${LOAD_TAG:-}" ;;
    capacity-1.7b) checkpoint synthetic:1.7b-customvoice > /dev/null
               official -m benchmarks.serving.load --model synthetic:1.7b-customvoice --capacity ${CAPACITY_ARGS:-} \
                 $( [ -f "$out/budget-1.7b.json" ] && echo --device-budget "$out/budget-1.7b.json" ) \
                 --transports ${LOAD_TRANSPORTS:-ws} --duration ${LOAD_WINDOW:-30} --warmup 5 "${server_args[@]}" \
                 --server-log "$out/serve-capacity-1.7b${LOAD_TAG:-}.log" --out "$out/capacity-1.7b${LOAD_TAG:-}.json" 2>&1 \
                 | tee "$out/capacity-1.7b${LOAD_TAG:-}.log"
               tar_profile "capacity-1.7b${LOAD_TAG:-}" ;;
    capacity-0.6b) checkpoint synthetic:0.6b > /dev/null
               official -c "import soundfile as sf; from qwen3tts_agent.reference import demo_reference as d; sf.write('/tmp/ref.wav', *d())"
               ref_text=$(official -c "import benchmarks.engine.bench_engine as b; print(b.REF_TEXT)" | tail -1)
               official -m benchmarks.serving.load --model synthetic:0.6b --capacity ${CAPACITY_ARGS:-} \
                 $( [ -f "$out/budget-0.6b.json" ] && echo --device-budget "$out/budget-0.6b.json" ) \
                 --transports ${LOAD_TRANSPORTS:-ws} --duration ${LOAD_WINDOW:-30} --warmup 5 "${server_args[@]}" \
                 --server-arg=--default-voice-audio=/tmp/ref.wav "--server-arg=--default-voice-text=$ref_text" \
                 --server-log "$out/serve-capacity-0.6b${LOAD_TAG:-}.log" --out "$out/capacity-0.6b${LOAD_TAG:-}.json" 2>&1 \
                 | tee "$out/capacity-0.6b${LOAD_TAG:-}.log"
               tar_profile "capacity-0.6b${LOAD_TAG:-}" ;;
    stress) model=${STRESS_MODEL:-synthetic:1.7b-customvoice}
            checkpoint "$model" > /dev/null
            official -m benchmarks.engine.stress --model "$model" \
              ${STRESS_ARGS:---rate 75 --duration 30 --frames 100 --chunk-schedule 1,1,2,4,8} \
              --out "$out/stress${STRESS_TAG:-}.json" 2>&1 | tee "$out/stress${STRESS_TAG:-}.log" ;;
    sanitize) checkpoint synthetic:tiny-customvoice > /dev/null
              # SANITIZE_EAGER=1: no CUDA graphs and no caching allocator, so memcheck sees each tensor's bounds
              PYTHONPATH=/tmp/official:. env ${SANITIZE_EAGER:+PYTORCH_NO_CUDA_MEMORY_CACHING=1} compute-sanitizer --tool memcheck --target-processes all --print-limit 20 \
                python3 -m benchmarks.engine.stress --model synthetic:tiny-customvoice \
                ${SANITIZE_ARGS:---rate 4 --duration 20 --frames 40 --max-streams 64 --no-shed --hang-s 600 --chunk-schedule 1,1,2,4,8} \
                ${SANITIZE_EAGER:+--no-graphs} --out "$out/sanitize${SANITIZE_EAGER:+-eager}.json" 2>&1 | tail -300 \
                | tee "$out/sanitize${SANITIZE_EAGER:+-eager}.log" ;;
    cpu-0.6b)
      # the int8 CPU backend beside PyTorch's CPU path on the host's cores (no GPU), then the int8 backend on
      # ONNX Runtime's one shared pool instead of a pool per graph (dedicated cores); docs/cpu-backend.md
      threads=${CPU_THREADS:-16}
      CUDA_VISIBLE_DEVICES= official -m benchmarks.cpu.bench_cpu --model synthetic:0.6b --threads "$threads" --micro \
        --agreement --out "$out/cpu-0.6b.json" 2>&1 | tee "$out/cpu-0.6b.log"
      CUDA_VISIBLE_DEVICES= official -m benchmarks.cpu.bench_cpu --model synthetic:0.6b --threads "$threads" \
        --backends int8 --pool shared --out "$out/cpu-0.6b-shared.json" 2>&1 | tee -a "$out/cpu-0.6b.log" ;;
    engine-1.7b) official -m benchmarks.engine.bench_engine --model synthetic:1.7b --single-only $flags $pdl \
                   --out "$out/engine-1.7b.json" 2>&1 | tee "$out/engine-1.7b.log" ;;
    peers-0.6b|peers-1.7b)
      # the same text, 3 s reference and frame count as benchmarks/engine/bench_engine.py
      size=${stage#peers-}; ckpt=$(checkpoint "synthetic:$size")
      official -c "import soundfile as sf; from qwen3tts_agent.reference import demo_reference as d; sf.write('/tmp/ref.wav', *d())"
      text=$(official -c "import benchmarks.engine.bench_engine as b; print(b.BENCH_TEXT)" | tail -1)
      ref_text=$(official -c "import benchmarks.engine.bench_engine as b; print(b.REF_TEXT)" | tail -1)
      same=(--checkpoint "$ckpt" --frames 100 --ref-audio /tmp/ref.wav --ref-text "$ref_text" --text "$text")
      official -m benchmarks.peers.peers --system official "${same[@]}" --runs "${OFFICIAL_RUNS:-5}" \
        --out "$out/official-$size.json" 2>&1 | tee -a "$out/peers-$size.log"
      [ -d /tmp/faster ] || $install --target /tmp/faster .whl/faster/*.whl .whl/common/*.whl || exit 1
      for c in 1 8; do
        PYTHONPATH=/tmp/faster python3 -m benchmarks.peers.peers --system faster --chunk-size $c "${same[@]}" \
          --runs 5 --out "$out/faster-c$c-$size.json" 2>&1 | tee -a "$out/peers-$size.log"
      done ;;
    soak)
      [ -f /tmp/official/fastapi/__init__.py ] || $install --target /tmp/official .whl/server/*.whl || exit 1
      official -m benchmarks.serving.soak --model synthetic:0.6b --device cuda --utterances ${SOAK_UTTERANCES:-10000} \
        --concurrency ${SOAK_CONCURRENCY:-64} --max-streams 64 --frames 12 --max-rss-growth-mb 50 \
        --out "$out/soak-gpu.json" 2>&1 | tee "$out/soak.log" ;;
    hostile)
      [ -f /tmp/official/fastapi/__init__.py ] || $install --target /tmp/official .whl/server/*.whl || exit 1
      model=${HOSTILE_MODEL:-synthetic:1.7b-customvoice}
      checkpoint "$model" > /dev/null
      official -m benchmarks.serving.hostile --model "$model" --duration "${HOSTILE_DURATION:-3600}" --rate "${HOSTILE_RATE:-20}" \
        --frames 100 --clients 8 --hostile-concurrency "${HOSTILE_CONCURRENCY:-4}" --hostile-pause 0.5 ${HOSTILE_ARGS:-} \
        --server-log "$out/serve-hostile${HOSTILE_TAG:-}.log" --out "$out/hostile${HOSTILE_TAG:-}.json" 2>&1 \
        | tee "$out/hostile${HOSTILE_TAG:-}.log" ;;
    turn-latency)
      [ -f /tmp/official/fastapi/__init__.py ] || $install --target /tmp/official .whl/server/*.whl || exit 1
      [ -f /tmp/official/pipecat/__init__.py ] || $install --target /tmp/official .whl/pipecat/*.whl \
        || echo "no Pipecat wheels (.whl/pipecat): the Pipecat rows will say so"
      models=${TURN_MODELS:-synthetic:0.6b,synthetic:0.6b-customvoice,synthetic:1.7b-customvoice}
      for m in ${models//,/ }; do checkpoint $m > /dev/null; done
      official -m benchmarks.serving.turn_latency --models "$models" ${TURN_ARGS:-} \
        --out "$out/turn-latency${TURN_TAG:-}.json" 2>&1 | grep -v " | DEBUG " | tee "$out/turn-latency${TURN_TAG:-}.log" ;;
    prefix-ab)
      for m in synthetic:0.6b synthetic:0.6b-customvoice synthetic:1.7b-customvoice; do
        checkpoint $m > /dev/null
        official -m benchmarks.engine.bench_engine --model $m --prefix-ab --frames 25 --runs 20 $flags $pdl \
          --out "$out/prefix-ab-${m#synthetic:}.json" 2>&1 | tee -a "$out/prefix-ab.log"
      done ;;
    startup)
      [ -f /tmp/official/fastapi/__init__.py ] || $install --target /tmp/official .whl/server/*.whl || exit 1
      checkpoint synthetic:0.6b > /dev/null
      cases=${STARTUP_CASES:-cold,warm,prepared}
      if [[ $cases == *profiled* ]]; then
        [ -x /tmp/py-spy/bin/py-spy ] || $install --target /tmp/py-spy .whl/tools/py_spy-*.whl || exit 1
      fi
      official -m benchmarks.serving.startup --model synthetic:0.6b --device cuda --max-streams 256 --cases "$cases" \
        --py-spy /tmp/py-spy/bin/py-spy ${STARTUP_CACHE_ROOT:+--cache-root "$STARTUP_CACHE_ROOT"} \
        --out "$out/startup.json" 2>&1 | tee "$out/startup.log"
      if [ -f "$out/startup/profiled.raw" ]; then gzip "$out/startup/profiled.raw"; fi ;;
    ray-2gpu)
      ray_ready
      PYTHON=python3 PYTHONPATH="/tmp/official:$PWD/.ray-site:$PWD" PATH="$PWD/.ray-site/bin:$PATH" NUM_GPUS=1 NUM_CPUS=4 \
        ENGINE_CORE=process MODEL=synthetic:0.6b TORCH_THREADS= LOAD_COMMON="--clients 8 --warmup 5 --duration 30 --frames 100" \
        bash benchmarks/serving/ray_scaling.sh "$out/ray-2gpu" "${RAY_LOAD1:---held 128 --rates 24}" "${RAY_LOAD2:---held 256 --rates 48}" \
        2>&1 | tee "$out/ray-2gpu.log" ;;
    ray-1gpu)
      # two replicas sharing this one GPU (half a GPU each, slots by their share of its memory) beside plain `serve`,
      # same load; RAY_SERVE_ARGS adds serve-ray options;
      # RAY_REPLICA_COUNTS="serve" runs the baseline alone (no Ray needed), "2" the replicas alone
      counts=${RAY_REPLICA_COUNTS:-serve 2}
      if [[ $counts == *[0-9]* ]]; then
        [ -f .ray-site/ray/__init__.py ] || { echo "run the ray-install stage first (same warm machine)"; exit 2; }
      fi
      [ -f /tmp/official/fastapi/__init__.py ] || $install --target /tmp/official .whl/server/*.whl || exit 1
      checkpoint synthetic:0.6b > /dev/null
      ray_1gpu_load ray-1gpu NUM_GPUS=0.5 REPLICA_COUNTS="$counts" ;;
    ray-1gpu-direct)
      # Serve's direct ingress: each replica serves its own port (no proxy hop per WebSocket message); the load's
      # clients spread over those ports, metrics through the proxy; 2 replicas of half the GPU, then 1 of all of it
      ray_ready
      ray_1gpu_load ray-1gpu-direct DIRECT=1 GPUS_PER_DEPLOYMENT=1 PORT=18203 REPLICA_COUNTS="${RAY_REPLICA_COUNTS:-2 1}" ;;
    ray-1gpu-mps)
      # the two half-GPU replicas of ray-1gpu-direct under CUDA MPS (with_mps), so the replicas' kernels run at once
      # instead of by turns. RAY_MPS_INGRESS="direct proxy" also runs them through Serve's proxy (ray-1gpu's
      # ingress; default: direct)
      ray_ready
      mps_ingress() {
        for ingress in ${RAY_MPS_INGRESS:-direct}; do
          case $ingress in
            direct) ray_1gpu_load ray-1gpu-mps DIRECT=1 GPUS_PER_DEPLOYMENT=1 PORT=18204 REPLICA_COUNTS="${RAY_REPLICA_COUNTS:-2}" ;;
            proxy) ray_1gpu_load ray-1gpu-mps-proxy NUM_GPUS=0.5 PORT=18205 REPLICA_COUNTS="${RAY_REPLICA_COUNTS:-2}" ;;
            *) echo "RAY_MPS_INGRESS: direct or proxy, not $ingress" ;;
          esac
        done
      }
      with_mps mps_ingress ;;
    ray-1gpu-faults)
      # the same two replicas at 20 req/s: one engine-core process SIGKILLed, then one replica's actor process
      ray_ready
      ( export PYTHONPATH="/tmp/official:$PWD/.ray-site:$PWD" PATH="$PWD/.ray-site/bin:$PATH"
        python3 -m qwen3tts_agent.cli serve-ray --model synthetic:0.6b --replicas 2 --num-gpus 0.5 --num-cpus 4 \
          --engine-core process ${RAY_SERVE_ARGS:-} --port 18201 --max-queued 100000 --queue-timeout 60 \
          --max-sessions 100000 --log-level warning > "$out/serve-ray-faults.log" 2>&1 &
        server=$!
        for _ in $(seq 600); do curl -sf http://127.0.0.1:18201/ready > /dev/null && break; sleep 1; done
        python3 -m benchmarks.serving.ray_faults faults --url ws://127.0.0.1:18201 --rate ${RAY_FAULT_RATE:-20} \
          --duration ${RAY_FAULT_WINDOW:-45} --kill-core-at 10 --kill-replica-at 25 --settle 10 --out "$out/ray-1gpu-faults.json" \
          2>&1 | tail -60 | tee "$out/ray-1gpu-faults.log"
        kill -INT $server; wait $server ) ;;
    ray-1gpu-autoscale)
      # one half-GPU replica, a second allowed: arrivals ramp from 5 to 40 req/s (benchmarks/serving/ray_faults.py);
      # RAY_MPS=1 runs it under CUDA MPS (with_mps)
      ray_ready
      autoscale() {
        export PYTHONPATH="/tmp/official:$PWD/.ray-site:$PWD" PATH="$PWD/.ray-site/bin:$PATH"
        python3 -m qwen3tts_agent.cli serve-ray --model synthetic:0.6b --min-replicas 1 --max-replicas 2 \
          --autoscale-on ${RAY_AUTOSCALE_ON:-engine-load} --upscale-delay ${RAY_UPSCALE_DELAY:-10} \
          --look-back-period 10 --num-gpus 0.5 --num-cpus 4 --engine-core process \
          ${RAY_SERVE_ARGS:-} --port 18202 --max-sessions 100000 \
          --log-level warning > "$out/serve-ray-autoscale.log" 2>&1 &
        local server=$!
        for _ in $(seq 600); do curl -sf http://127.0.0.1:18202/ready > /dev/null && break; sleep 1; done
        python3 -m benchmarks.serving.ray_faults autoscale --url ws://127.0.0.1:18202 --rate 5 --ramp-to 40 \
          --duration ${RAY_RAMP_WINDOW:-180} --settle 10 --out "$out/ray-1gpu-autoscale.json" \
          2>&1 | tail -60 | tee "$out/ray-1gpu-autoscale.log"
        kill -INT $server; wait $server
      }
      if [ "${RAY_MPS:-0}" = 1 ]; then with_mps autoscale; else ( autoscale ); fi ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
