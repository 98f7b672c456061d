"""Start-up: how long `qwen3tts-agent serve` takes from launch to `/ready`, cold, warm and after `prepare`.

What a restart costs is what an operator feels when a container is replaced or a core process comes back. Each
start runs `serve` as a user would (its own process, the engine core in another), polls `/ready` and stops
it. The three cases differ only in the disk caches of what a start compiles: Triton's kernels
(`TRITON_CACHE_DIR`) and, where the installed packages carry no Python bytecode, the bytecode cache
(`QWEN3TTS_AGENT_BYTECODE_CACHE`, `qwen3tts_agent/caches.py`), fresh folders per case:

- cold: the caches start empty (a fresh container);
- warm: a second start on the same caches (a restart on the same machine);
- prepared: `qwen3tts-agent prepare` ran first on empty caches (an image built with the kernels baked in),
  then `serve` starts;
- profiled: another warm start, sampled by py-spy (`--py-spy`) across the server's process tree, so that the
  report says where the engine core's start goes, function by function, on its main thread (imports,
  weights) and its engine thread (graph capture, the warm-up utterance); the raw stacks stay beside it.

The report gives the seconds to ready of each start and the core's own split (weights, warm-up) from its
log; each start's whole log is kept beside the report (`startup.json` -> `startup/cold.log`, ...). CUDA graphs are captured at every start: they belong to a process.

    python -m benchmarks.serving.startup --model synthetic:0.6b --max-streams 256 --out startup.json
    python -m benchmarks.serving.startup --cases cold,warm ...      # without the prepared case
    python -m benchmarks.serving.startup --cases cold,warm,profiled --py-spy /path/to/py-spy ...
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.serving.load import free_port, stop_server, unwind_on_sigterm

CORE_STARTED = re.compile(r"engine core started in ([\d.]+) s: imports and weights ([\d.]+) s, warm-up ([\d.]+) s")
# the warm-up's parts, as the core logs them: each graph family's capture, then the warm-up utterance
# (the count of eager runs is logged since 2026-12-03)
CAPTURED = re.compile(r"captured (\d+) ([a-z -]+?) graphs in ([\d.]+) s(?: \((\d+) eager runs\))?")
WARMUP_UTTERANCE = re.compile(r"warm-up utterance: voice ([\d.]+) s, \d+ frames ([\d.]+) s")
PROFILE_RATE_HZ = 100
PROFILE_TOP = 60
ENGINE_THREAD = "qwen3tts-engine"  # the core's thread that captures the graphs and runs the warm-up utterance
PROFILED_THREADS = ("MainThread", ENGINE_THREAD)
_LINE_NUMBER = re.compile(r":\d+\)$")
_PROCESS = re.compile(r'process (\d+):"[^"]*";')
_PROCESSES = re.compile(r'(?:process \d+:"[^"]*";)+')


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "qwen3tts_agent.cli", *args]


def _model_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--device", args.device, "--max-streams", str(args.max_streams)]


def _tail(log_path: Path, lines: int = 30) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def start_to_ready(
    args: argparse.Namespace, env: dict[str, str], log_path: Path, profile: Path | None = None
) -> dict[str, Any]:
    """Launch `serve`, wait for `/ready`, stop it: seconds from launch to ready, and the core's split. With
    `profile`, py-spy samples the whole process tree from launch to ready into that raw file."""
    port = free_port()
    command = _cli("serve", *_model_args(args), "--port", str(port), "--log-level", "info")
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        sampler = None
        if profile is not None:
            sampler = subprocess.Popen(
                [args.py_spy, "record", "--subprocesses", "--idle", "--threads", "--nonblocking", "--format", "raw",
                 "--rate", str(PROFILE_RATE_HZ), "--pid", str(server.pid), "--output", str(profile)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        try:
            deadline = time.monotonic() + args.timeout
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"serve exited with code {server.returncode}:\n{_tail(log_path)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"serve was not ready within {args.timeout} s:\n{_tail(log_path)}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.1)
            ready_s = time.perf_counter() - started
            if sampler is not None:
                sampler.send_signal(signal.SIGINT)  # py-spy writes what it has sampled and exits
                sampler.wait(60)
        finally:
            if sampler is not None and sampler.poll() is None:  # the start failed before ready
                sampler.kill()
                sampler.wait()
            stop_server(server)
    result: dict[str, Any] = {"ready_s": ready_s, "core": core_split(log_path.read_text(errors="replace"))}
    if profile is not None and profile.exists():
        result["core_profile"] = core_profile(profile.read_text(errors="replace").splitlines())
    return result


def core_split(log: str) -> dict[str, Any] | None:
    """The engine core's own split of its start, from its log lines (None if it logged no start): seconds
    in all, to loaded, warming up, each graph family's capture and the warm-up utterance's parts."""
    found = CORE_STARTED.search(log)
    if found is None:
        return None
    core: dict[str, Any] = dict(zip(("total_s", "weights_s", "warmup_s"), map(float, found.groups()), strict=True))
    core["graphs"] = {
        kind: {"count": int(n), "s": float(s), **({"eager_runs": int(eager)} if eager else {})}
        for n, kind, s, eager in CAPTURED.findall(log)
    }
    utterance = WARMUP_UTTERANCE.search(log)
    if utterance is not None:
        core["warmup_voice_s"], core["warmup_utterance_s"] = map(float, utterance.groups())
    return core


def core_profile(lines: list[str], top: int = PROFILE_TOP) -> dict[str, Any]:
    """The engine core's main thread and engine thread (which captures the graphs and runs the warm-up) in a
    `py-spy record --subprocesses` raw profile: each one's seconds sampled, and the functions holding the most
    of them anywhere on the stack (inclusive) and at its top (self). A raw line is `process A;process
    B;...;thread (tid): name;frame;... count`, the last process the sampled one; the core is the process
    whose stacks pass through `core_main`."""
    stacks: dict[tuple[str, str], list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        processes = _PROCESSES.match(stack)  # a command line may hold ";": taken whole, quotes and all
        if processes is None:
            continue
        thread, *frames = stack[processes.end():].split(";")
        name = thread.rpartition(": ")[2]
        if name in PROFILED_THREADS:
            stacks[(_PROCESS.findall(processes.group())[-1], name)].append(
                ([_LINE_NUMBER.sub(")", frame) for frame in frames], int(count))
            )
    core = next((pid for (pid, name), s in stacks.items()
                 if name == "MainThread" and any("core_main" in f for frames, _ in s for f in frames)), None)
    if core is None:
        return {"error": "no process of the tree ran core_main"}
    main = _thread_profile(stacks[(core, "MainThread")], top)
    engine = _thread_profile(stacks.get((core, ENGINE_THREAD), []), top)
    return {"main_thread_s": main.pop("sampled_s"), **main, "engine_thread": engine}


def _thread_profile(samples: list[tuple[list[str], int]], top: int) -> dict[str, Any]:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for frames, n in samples:
        own[frames[-1] if frames else "(idle)"] += n
        for frame in set(frames):
            inclusive[frame] += n

    def seconds(counter: collections.Counter[str]) -> list[list[Any]]:
        return [[frame, round(n / PROFILE_RATE_HZ, 2)] for frame, n in counter.most_common(top)]

    total = sum(n for _, n in samples)
    return {"sampled_s": round(total / PROFILE_RATE_HZ, 2), "inclusive_s": seconds(inclusive), "self_s": seconds(own)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"model": args.model, "device": args.device, "max_streams": args.max_streams, "starts": {}}
    logs = args.out.with_suffix("")  # each start's log: next to the report, kept
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) if args.cache_root is None else args.cache_root

        def env_with_cache(name: str, existing: bool = False) -> dict[str, str]:
            cache = root / name
            if existing and not cache.is_dir():
                raise SystemExit(f"no caches of an earlier cold start in {cache}: run the cold case first")
            cache.mkdir(parents=True, exist_ok=existing)
            return {**os.environ, "TRITON_CACHE_DIR": str(cache / "triton"),
                    "QWEN3TTS_AGENT_BYTECODE_CACHE": str(cache / "bytecode")}

        # without the cold case, the warm starts take the caches an earlier run's cold start left in --cache-root
        cold = env_with_cache("cold", existing="cold" not in args.cases and any(c in args.cases for c in ("warm", "profiled")))
        for case, env in (("cold", cold), ("warm", cold), ("profiled", cold)):
            if case not in args.cases:
                continue
            profile = logs / "profiled.raw" if case == "profiled" else None
            report["starts"][case] = start_to_ready(args, env, logs / f"{case}.log", profile)
            print(f"{case}: ready in {report['starts'][case]['ready_s']:.1f} s (core: {report['starts'][case]['core']})",
                  flush=True)
        if "prepared" not in args.cases:
            return report
        prepared = env_with_cache("prepared")
        started = time.perf_counter()
        subprocess.run(_cli("prepare", *_model_args(args)), env=prepared, check=True, stdout=subprocess.DEVNULL)
        report["prepare_s"] = time.perf_counter() - started
        report["starts"]["prepared"] = start_to_ready(args, prepared, logs / "prepared.log")
        print(f"prepare: {report['prepare_s']:.1f} s, then ready in {report['starts']['prepared']['ready_s']:.1f} s",
              flush=True)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:0.6b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-streams", default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=["cold", "warm", "prepared"],
                        help="which starts to run, of cold,warm,profiled,prepared (warm and profiled follow cold, "
                        "on its caches; without cold, on the caches of an earlier run's cold start in --cache-root)")
    parser.add_argument("--py-spy", default="py-spy", help="py-spy, for the profiled case")
    parser.add_argument("--cache-root", type=Path,
                        help="where each case's caches go, kept (default: a temporary folder, removed); it must not "
                        "hold them already when the cold case runs: that one starts empty")
    parser.add_argument("--out", type=Path, default=Path("startup.json"))
    args = parser.parse_args(argv)
    unknown = set(args.cases) - {"cold", "warm", "profiled", "prepared"}
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))} (of cold, warm, profiled, prepared)")
    unwind_on_sigterm()
    report = run(args)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
