"""Where `serve`'s processes spend a load window: py-spy samples of the engine core and the API workers.

`benchmarks/serving/load.py --profile SECONDS` starts one `py-spy record` per process of the server's tree when a
rate's measured window opens (raw collapsed stacks, every thread, idle frames included, so a thread that
waits shows where it waits), and puts a summary of each into the report: per thread, the share of its
samples in each function at the top of the stack (self) and anywhere on it (inclusive). The raw files stay
beside the report for flame graphs. The engine core is told apart from the API workers by its size: it is
the process of the tree that holds the model.

The core is sampled twice, the second time only while a thread holds the GIL (`core-gil`): each of its threads'
`holding_gil` share says how much of the time the thread held it. A thread in Python code that does not hold the
GIL is waiting for it, so a function's self samples in the two profiles tell its GIL waits apart (the core's
engine thread shares the GIL with its I/O thread, which forwards every output to the API workers).
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path
from typing import Any

import psutil

SAMPLE_RATE_HZ = 200
GIL_SUFFIX = "-gil"  # the core's second profile, of the threads holding the GIL
TOP_FUNCTIONS = 12
_THREAD = re.compile(r"^thread \(\w+\): ?(.*)$")
_LINE_NUMBER = re.compile(r":\d+\)$")


def serve_processes(server_pid: int) -> dict[str, int]:
    """Name -> pid of the server's processes: "core", "serve" (the supervisor, which runs the app itself
    when there is one API worker) and "worker-N". The engine core is the largest child: it holds the model
    (what it maps does not tell it apart: an API worker may map a library from torch's folder)."""
    root = psutil.Process(server_pid)
    children = [c for c in root.children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())]
    named = {"serve": root.pid}
    if not children:
        return named
    core = max(children, key=lambda child: child.memory_info().rss)
    named["core"] = core.pid
    workers = [child for child in children if child.pid != core.pid]
    named.update({f"worker-{i}": child.pid for i, child in enumerate(workers, 1)})
    return named


def start(processes: dict[str, int], seconds: float, out_dir: Path, py_spy: str) -> dict[str, subprocess.Popen[bytes]]:
    """Start sampling every process for `seconds`, and the core a second time only while its threads hold the GIL
    (`core-gil`); raw stacks go to `out_dir/<name>.raw`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recordings = [(name, pid, "--idle") for name, pid in processes.items()]
    if "core" in processes:
        recordings.append((f"core{GIL_SUFFIX}", processes["core"], "--gil"))
    return {
        name: subprocess.Popen(
            [py_spy, "record", "--nonblocking", "--format", "raw", "--threads", which, "--rate",
             str(SAMPLE_RATE_HZ), "--duration", str(max(1, round(seconds))), "--pid", str(pid),
             "--output", str(out_dir / f"{name}.raw")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        for name, pid, which in recordings
    }


def finish(recorders: dict[str, subprocess.Popen[bytes]], out_dir: Path, timeout: float) -> dict[str, Any]:
    """Wait for the recorders; each process's summary (`summarize`), or why there is none."""
    report: dict[str, Any] = {}
    for name, recorder in recorders.items():
        try:
            _, stderr = recorder.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            recorder.kill()
            report[name] = {"error": "py-spy did not finish"}
            continue
        raw = out_dir / f"{name}.raw"
        if recorder.returncode != 0 or not raw.exists():
            report[name] = {"error": stderr.decode(errors="replace").strip()[-500:] or f"exit {recorder.returncode}"}
            continue
        report[name] = summarize(raw.read_text(errors="replace").splitlines())
    holding = report.get(f"core{GIL_SUFFIX}", {}).get("threads")
    for thread, summary in report.get("core", {}).get("threads", {}).items():
        if holding is not None:  # the same rate and window: sample counts compare
            summary["holding_gil"] = round(holding.get(thread, {}).get("samples", 0) / summary["samples"], 4)
    return report


def summarize(lines: list[str], top: int = TOP_FUNCTIONS) -> dict[str, Any]:
    """Per thread of one raw py-spy profile: its samples, and the functions holding the largest shares of
    them, at the top of the stack (`self`) and anywhere on it (`inclusive`). Functions are named without
    their line numbers, so one function's lines add up."""
    samples: collections.Counter[str] = collections.Counter()
    self_counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        found = _THREAD.match(head)
        thread = (found.group(1) or "unnamed") if found else head
        frames = [_LINE_NUMBER.sub(")", frame) for frame in frames]
        n = int(count)
        samples[thread] += n
        if frames:
            self_counts[thread][frames[-1]] += n
        for frame in set(frames):
            inclusive[thread][frame] += n

    def shares(counter: collections.Counter[str], total: int) -> list[list[Any]]:
        # frames under every sample (the thread's entry point and its loop) say nothing: left out
        ranked = [(frame, count) for frame, count in counter.most_common() if count < total]
        return [[frame, round(count / total, 4)] for frame, count in ranked[:top]]

    return {
        "samples": sum(samples.values()),
        "threads": {
            thread: {
                "samples": total,
                "self": shares(self_counts[thread], total),
                "inclusive": shares(inclusive[thread], total),
            }
            for thread, total in samples.most_common()
        },
    }
