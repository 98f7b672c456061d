"""`prepare` and the start-up benchmark on the CPU: `serve` started three times (cold, warm, after `prepare`),
each to `/ready`, with the engine core's own split of its start read from its log. Timings on a shared CPU
say nothing; the H200 figures come from `benchmarks/run_h200.sh OUT startup`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks.serving import startup
from qwen3tts_agent.cli import main


def test_serve_starts_cold_warm_and_prepared_and_reports_its_split(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    report = startup.main(["--model", "synthetic:tiny", "--device", "cpu", "--max-streams", "2", "--timeout", "300",
                           "--cases", "cold,warm,profiled,prepared", "--py-spy", _py_spy(), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report["starts"]) == {"cold", "warm", "profiled", "prepared"} and report["prepare_s"] > 0
    # the profiled start: py-spy across the tree, the engine core's main thread summed by function
    profile = report["starts"]["profiled"]["core_profile"]
    assert 0 < profile["main_thread_s"] <= report["starts"]["profiled"]["ready_s"] + 1
    inclusive = dict(profile["inclusive_s"])
    assert inclusive["core_main (qwen3tts_agent/engine/process/core_server.py)"] > 0
    assert 0 < inclusive["Engine.load (qwen3tts_agent/engine/frontend/engine.py)"] < profile["main_thread_s"]
    assert (out.with_suffix("") / "profiled.raw").stat().st_size > 0
    for case, start in report["starts"].items():
        core = start["core"]
        assert core is not None, f"{case}: the core logged no start-up line"
        assert core["weights_s"] > 0 and core["warmup_s"] > 0, case
        # the log gives each figure to 0.1 s, so each is off by up to 0.05 s
        assert core["weights_s"] + core["warmup_s"] <= core["total_s"] + 0.15, case
        assert core["total_s"] <= start["ready_s"] + 0.05, case
        assert 0 < core["warmup_utterance_s"] <= core["warmup_s"] + 0.05, case  # the warm-up's split
        assert core["graphs"] == {}, case  # no CUDA graphs on the CPU


def _py_spy() -> str:
    return shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def test_the_core_profile_takes_the_core_process_main_thread_whatever_its_command_line_holds() -> None:
    serve = 'process 10:"python -m qwen3tts_agent.cli serve --model m"'
    spawned = 'process 11:"python -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=6)"'
    worker = 'process 12:"python -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=9)"'
    lines = [
        f"{serve};{spawned};thread (11): MainThread;run_core (supervisor.py:40);core_main (core_server.py:230);load (engine.py:9) 300",
        f"{serve};{spawned};thread (11): MainThread;run_core (supervisor.py:40);core_main (core_server.py:235);wait (threading.py:3) 100",
        f"{serve};{spawned};thread (13): qwen3tts-engine;capture (cuda_graphs.py:1) 500",
        f"{serve};{worker};thread (12): MainThread;serve (uvicorn.py:1) 400",
        f"{serve};thread (10): MainThread;serve (launcher.py:1) 400",
        "not a stack line",
    ]
    profile = startup.core_profile(lines)
    assert profile["main_thread_s"] == 4.0  # 400 samples of the core's main thread at 100 a second
    assert dict(profile["inclusive_s"]) == {
        "run_core (supervisor.py)": 4.0, "core_main (core_server.py)": 4.0, "load (engine.py)": 3.0, "wait (threading.py)": 1.0,
    }
    assert profile["self_s"] == [["load (engine.py)", 3.0], ["wait (threading.py)", 1.0]]
    assert profile["engine_thread"] == {
        "sampled_s": 5.0, "inclusive_s": [["capture (cuda_graphs.py)", 5.0]], "self_s": [["capture (cuda_graphs.py)", 5.0]],
    }
    assert startup.core_profile(lines[3:]) == {"error": "no process of the tree ran core_main"}


def test_prepare_on_the_cpu_with_the_pytorch_backend_says_there_is_nothing_to_compile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["prepare", "--model", "synthetic:tiny", "--device", "cpu", "--backend", "torch", "--max-streams", "2"]) == 0
    out = capsys.readouterr().out
    assert "torch backend, 2 slots" in out and "compiles nothing ahead of time" in out


def test_the_split_keeps_each_graph_family_apart() -> None:
    """The lines a GPU core logs (from the H200 run in benchmarks/results/2026-12-01-h200-d/startup/warm.log):
    the codec lane's graphs and the early lane's are two families, neither overwriting the other."""
    log = (Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-01-h200-d/startup/warm.log").read_text()
    core = startup.core_split(log)
    assert core is not None
    assert core["graphs"] == {
        "frame": {"count": 45, "s": 5.6}, "prefill": {"count": 53, "s": 2.0},
        "codec": {"count": 36, "s": 4.4}, "early-lane codec": {"count": 10, "s": 0.4},
    }
    assert (core["total_s"], core["weights_s"], core["warmup_s"]) == (26.3, 13.3, 13.1)
    later = startup.core_split(log.replace("captured 36 codec graphs in 4.4 s", "captured 36 codec graphs in 2.1 s (3 eager runs)"))
    assert later is not None and later["graphs"]["codec"] == {"count": 36, "s": 2.1, "eager_runs": 3}
