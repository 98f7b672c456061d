"""`benchmarks/serving/load.py --profile`: py-spy samples of the engine core and the API workers during a window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.serving import profiling


def test_a_raw_profile_is_summarized_per_thread_by_function() -> None:
    lines = [
        "thread (0x1): qwen3tts-engine;run (core.py:10);_turn (core.py:20);_wait (core.py:30) 6",
        "thread (0x1): qwen3tts-engine;run (core.py:10);_turn (core.py:21);_launch (core.py:40) 3",
        "thread (0x1): qwen3tts-engine;run (core.py:10);_turn (core.py:22);_launch (core.py:41);replay (g.py:5) 1",
        "thread (0x2): MainThread;main (cli.py:1) 4",
        "not a stack line",
    ]
    summary = profiling.summarize(lines)
    assert summary["samples"] == 14
    engine = summary["threads"]["qwen3tts-engine"]
    assert engine["samples"] == 10
    # line numbers dropped, so one function's lines add up; the frames under every sample are left out
    assert engine["self"] == [["_wait (core.py)", 0.6], ["_launch (core.py)", 0.3], ["replay (g.py)", 0.1]]
    assert engine["inclusive"] == [["_wait (core.py)", 0.6], ["_launch (core.py)", 0.4], ["replay (g.py)", 0.1]]
    assert summary["threads"]["MainThread"] == {"samples": 4, "self": [], "inclusive": []}


def test_the_load_benchmark_profiles_the_core_and_each_api_worker(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    command = [
        sys.executable, "-m", "benchmarks.serving.load", "--model", "synthetic:tiny", "--server-arg=--backend=torch",
        "--server-arg=--max-streams=4", "--server-arg=--workers=2", "--rates", "3", "--clients", "1",
        "--warmup", "1", "--duration", "3", "--frames", "4", "--profile", "2", "--out", str(out),
    ]
    subprocess.run(command, check=True, timeout=600, capture_output=True)
    [run] = json.loads(out.read_text())["runs"]
    assert run["completed"] > 0 and run["errors"] == {}
    processes = run["profile"]["processes"]
    assert set(processes) == {"serve", "core", "core-gil", "worker-1", "worker-2"}, processes
    engine = processes["core"]["threads"]["qwen3tts-engine"]  # the step loop, with where its time went
    assert engine["samples"] > 100 and engine["self"]
    # how much of the window it held the GIL: some (it ran Python), not all (it waits for work, and the model's
    # PyTorch maths runs without it)
    assert 0.0 < engine["holding_gil"] < 1.0
    assert processes["core-gil"]["threads"]["qwen3tts-engine"]["samples"] < engine["samples"]
    assert all(processes[w]["samples"] > 0 for w in ("worker-1", "worker-2"))
    assert (Path(run["profile"]["raw_dir"]) / "core.raw").stat().st_size > 0
