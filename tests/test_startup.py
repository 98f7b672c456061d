"""`prepare` and the start-up benchmark on the CPU: `serve` started three times (cold, warm, after `prepare`),
each to `/ready`, with the engine core's own split of its start read from its log. Timings on a shared CPU
say nothing; the H200 figures come from `benchmarks/run_h200.sh OUT startup`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import startup
from qwen3tts_agent.cli import main


def test_serve_starts_cold_warm_and_prepared_and_reports_its_split(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    report = startup.main(["--model", "synthetic:tiny", "--device", "cpu", "--max-streams", "2", "--timeout", "300",
                           "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report["starts"]) == {"cold", "warm", "prepared"} and report["prepare_s"] > 0
    for case, start in report["starts"].items():
        core = start["core"]
        assert core is not None, f"{case}: the core logged no start-up line"
        assert core["weights_s"] > 0 and core["warmup_s"] > 0, case
        # the log gives each figure to 0.1 s, so each is off by up to 0.05 s
        assert core["weights_s"] + core["warmup_s"] <= core["total_s"] + 0.15, case
        assert core["total_s"] <= start["ready_s"] + 0.05, case
        assert 0 < core["warmup_utterance_s"] <= core["warmup_s"] + 0.05, case  # the warm-up's split
        assert core["graphs"] == {}, case  # no CUDA graphs on the CPU


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
