#!/usr/bin/env bash
# Wheels for the `ray-2gpu` stage of benchmarks/run_h200.sh: Ray Serve on the offline GPU machine
# (Python 3.12, x86_64), in .whl/ray/ (git-ignored), beside what benchmarks/fetch_wheels.sh fetches.
#
# The ray cp312 wheel is ~79 MB and one device call carries at most 64 MiB, so it is trimmed here to
# what Serve runs on: out go the Java jar (ray/jars, ~33 MB, Ray's Java API), the dashboard's web UI
# (ray/dashboard/client/build), RLlib, Tune, Train, Ray LLM, and the C++ API headers, none of which a
# Serve application imports (the trimmed wheel's RECORD is rewritten to match). The result is about
# 45 MB. Because .whl/official + .whl/common + .whl/server also travel with the stages that need them,
# the plan is two calls to the same warm machine:
#
#   1. carry .whl/ray only:       bash benchmarks/run_h200.sh OUT ray-install   (installs into .ray-site/)
#   2. carry the usual wheels:    bash benchmarks/run_h200.sh OUT ray-2gpu      (finds .ray-site/ kept)
#
# Ignored outputs of a call stay on a warm machine for the next, so .ray-site/ is there in call 2.
# Every dependency of ray[serve] that the GPU machine lacks is fetched too (small pure-Python wheels
# and rpds-py), with --no-deps at exact versions, as in fetch_wheels.sh.
#
# Usage: bash benchmarks/fetch_ray_wheels.sh     Env: PYTHON (default python3), WHEEL_DIR (<repo>/.whl)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${WHEEL_DIR:-$ROOT/.whl}/ray"
PYTHON="${PYTHON:-python3}"

RAY_VERSION=2.60.0
DEPS=(
    jsonschema==4.26.0                  # ray core (runtime-env schemas)
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
    rpds-py==2026.9.1
    colorful==0.5.8                     # ray[serve] / [default]
    aiohttp-cors==0.8.1
    opencensus==0.11.4                  # the metrics agent's Prometheus export
    opencensus-context==0.1.3
    google-api-core==2.44.0             # opencensus imports it
    google-auth==2.63.0
    googleapis-common-protos==1.76.0
    proto-plus==1.29.0
    pyasn1==0.6.5
    pyasn1-modules==0.4.2
    opentelemetry-sdk==1.45.2           # Ray's metric recorder (opentelemetry-api is in .whl/server)
    opentelemetry-proto==1.45.2
    opentelemetry-exporter-prometheus==0.66b2
    opentelemetry-semantic-conventions==0.66b2
    grpcio-reflection==1.81.1           # Serve's proxy imports it (1.81 is the last on protobuf 6)
    smart-open==9.0.2
    wrapt==2.5.2
    mmh3==5.3.1
    watchfiles==1.3.0
)
DROP_PREFIXES=(ray/jars/ ray/dashboard/client/build/ ray/rllib/ ray/tune/ ray/train/ ray/llm/ ray/cpp/)

PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
mkdir -p "$DEST" "$DEST/.download"
echo "== ray $RAY_VERSION and ${#DEPS[@]} dependencies for cp312"
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --progress-bar off -q -d "$DEST/.download" "ray==$RAY_VERSION" \
    2> >(grep -v "is ignored: it is neither" >&2)
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --progress-bar off -q -d "$DEST" "${DEPS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)

"$PYTHON" - "$DEST" "${DROP_PREFIXES[@]}" <<'PY'
"""Rewrite the ray wheel without the dropped folders (entries and their RECORD lines)."""
import sys
import zipfile
from pathlib import Path

dest, drop = Path(sys.argv[1]), tuple(sys.argv[2:])
source = next((dest / ".download").glob("ray-*.whl"))
target = dest / source.name
kept = removed = 0
with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as out:
    for info in src.infolist():
        name = info.filename
        if name.startswith(drop):
            removed += info.file_size
            continue
        data = src.read(info)
        if name.endswith(".dist-info/RECORD"):
            lines = [line for line in data.decode().splitlines() if not line.startswith(drop)]
            data = ("\n".join(lines) + "\n").encode()
        out.writestr(info, data)
        kept += info.file_size
print(f"   {source.name}: {source.stat().st_size / 2**20:.1f} MiB -> {target.stat().st_size / 2**20:.1f} MiB "
      f"({removed / 2**20:.0f} MiB of files dropped, {kept / 2**20:.0f} MiB kept)")
source.unlink()
PY
rmdir "$DEST/.download"
du -ch "$DEST"/*.whl | tail -1 | sed 's/^/   total /'
