"""`benchmarks/serving/load.py --capacity`: the highest open-loop rate that meets the criteria, found in few windows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from benchmarks.serving.load import (
    LIVE_GAUGES,
    CapacitySearch,
    capacity_figures,
    device_ceiling_from_budget,
    missed_criteria,
)
from qwen3tts_agent.engine.core.launcher import GAP_HOLDS, GAP_LOOP, GAP_READ

LIMITS = {"refused_fraction": 0.01, "underrun_fraction": 0.01, "p95_first_audio_ms": 100.0}


def _search(passes: Callable[[float], bool], start: float = 10.0, resolution: float = 0.1, max_steps: int = 8) -> CapacitySearch:
    """Run the search against a server that passes a window at `rate` when `passes(rate)`."""
    search = CapacitySearch(start, resolution, max_steps)
    while (rate := search.next_rate()) is not None:
        search.record(rate, passes(rate))
    return search


def _rates(search: CapacitySearch) -> list[float]:
    return [rate for rate, _ in search.probes]


def test_the_search_doubles_while_windows_pass_then_bisects() -> None:
    search = _search(lambda rate: rate <= 50, resolution=0.05)
    assert _rates(search) == [10, 20, 40, 80, 60, 50, 55, 52.5]  # the eighth window ends it
    assert search.passing == 50 and search.failing == 52.5


def test_the_search_stops_once_the_gap_is_within_the_resolution() -> None:
    search = _search(lambda rate: rate <= 33)
    # 10, 20, 40 (fails); then 30 | 40 is a third of 30 apart, 30 | 35 a sixth, 32.5 | 35 under a tenth: done
    assert _rates(search) == [10, 20, 40, 30, 35, 32.5]
    assert search.passing == 32.5 and search.failing == 35
    assert search.next_rate() is None


def test_the_search_stops_after_its_steps() -> None:
    search = _search(lambda rate: True, max_steps=3)
    assert _rates(search) == [10, 20, 40]
    assert search.passing == 40 and search.failing is None


def test_a_failing_first_rate_halves_until_one_passes_then_bisects() -> None:
    """`--capacity-from 100` on an H100 whose 100 req/s window refused 1.5 % (the next window at 100 passed) ended
    the search with no capacity at all; a start above the capacity now comes down to it."""
    search = _search(lambda rate: rate <= 70, start=100)
    assert _rates(search) == [100, 50, 75, 62.5, 68.75]  # 68.75 | 75 within a tenth of 68.75: done
    assert search.passing == 68.75 and search.failing == 75


def test_a_server_that_passes_nothing_is_probed_lower_until_the_steps_are_spent() -> None:
    search = _search(lambda rate: False, max_steps=4)
    assert _rates(search) == [10, 5, 2.5, 1.25]
    assert search.passing is None and search.next_rate() is None


def test_every_rate_above_the_highest_passing_one_failed() -> None:
    # a noisy server: whatever the windows say, bisection probes only between the highest pass and lowest fail
    outcomes = iter([True, True, False, False, True, False, True, False])
    search = _search(lambda rate: next(outcomes))
    assert search.passing is not None
    assert all(not passed for rate, passed in search.probes if rate > search.passing)


def _summary(requests: int, errors: dict[str, int], underrun: float | None, p95: float | None) -> dict[str, object]:
    """The fields of `summarize`'s window summary that the criteria read."""
    return {"requests": requests, "errors": errors, "underrun_fraction": underrun, "first_audio_ms": {"p95": p95}}


def test_the_criteria_name_what_a_window_missed() -> None:
    assert missed_criteria(capacity_figures(_summary(200, {}, 0.0, 80.0)), LIMITS) == []
    assert missed_criteria(capacity_figures(_summary(200, {"busy": 2}, 0.01, 100.0)), LIMITS) == []  # the limits pass
    # any error counts as refused, whatever its kind
    refused = capacity_figures(_summary(200, {"busy": 2, "TimeoutError": 1}, 0.0, 80.0))
    assert refused["refused_fraction"] == 0.015
    assert missed_criteria(refused, LIMITS) == ["refused_fraction"]
    assert missed_criteria(capacity_figures(_summary(200, {}, 0.02, 120.0)), LIMITS) == [
        "underrun_fraction", "p95_first_audio_ms"]
    # a window that served nothing shows nothing served well
    assert missed_criteria(capacity_figures(_summary(0, {}, None, None)), LIMITS) == list(LIMITS)


def test_the_load_benchmark_reports_the_capacity_its_probes_show(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    command = [
        sys.executable, "-m", "benchmarks.serving.load", "--model", "synthetic:tiny", "--server-arg=--backend=torch",
        "--capacity", "--capacity-from", "2", "--capacity-steps", "3", "--device-ceiling-frames-per-s", "1234",
        "--clients", "1", "--warmup", "1", "--duration", "3", "--frames", "4", "--out", str(out),
    ]
    result = subprocess.run(command, check=True, timeout=300, capture_output=True, text=True)
    report = json.loads(out.read_text())
    capacity = report["capacity"]
    probes = capacity["probes"]
    assert capacity["transport"] == "ws" and capacity["device_ceiling_frames_per_s"] == 1234
    assert capacity["criteria_max"] == LIMITS and capacity["frames_per_utterance"] == 4
    # one window per probe, kept in the runs at that rate; the first at --capacity-from, at most --capacity-steps
    assert 1 <= len(probes) <= 3 and probes[0]["rate_per_s"] == 2
    assert [p["run"] for p in probes] == list(range(len(report["runs"])))
    for probe in probes:
        run = report["runs"][probe["run"]]
        assert run["rate_per_s"] == probe["rate_per_s"] and run["transport"] == "ws"
        assert probe["passed"] == (probe["failed"] == [])
        assert set(probe["failed"]) <= set(LIMITS)
        assert run["idle_wait_s"] is not None  # the server had drained before every window
        # ... and after it: every stream of the window ended at its client and every live gauge came back to 0
        assert run["drained_s"] is not None and run["completed"] + sum(run["errors"].values()) == run["requests"]
        assert all(run["server_gauges_after"][name] == 0 for name in LIVE_GAUGES), run["server_gauges_after"]
        # the server counted every `busy` its clients got, by what refused it (warm-up and drain too)
        assert sum(run["engine"]["busy_by_reason"].values()) >= run["errors"].get("busy", 0)
        # a CPU engine refuses nothing for lateness: its stream limit stays off (at every slot) and is never cut
        gauges = run["server_gauges_after"]
        assert run["engine"]["stream_limit_cuts"] == 0
        # where the batched steps' time went: no device events on a CPU, and the gaps between its steps (the loop's
        # turns) a fraction of each step's share of the window
        assert run["engine"]["step_device_ms"] is None and run["engine"]["step_flight_beyond_device_ms"] is None
        assert 0 < run["engine"]["step_gap_ms"] < 1000 / run["engine"]["steps_per_s"]
        # a CPU's step runs within its launch: never two queued (the counter exported, and 0)
        assert run["engine"]["overlapped_step_share"] == run["server_metrics"]["qwen3tts_engine_steps_overlapped"] == 0.0
        # ... by what held each step back, all of it accounted for (a CPU's step runs within its launch, so the
        # loop's next look comes a turn after a read: "read"; the first chunks it waits for: "first_audio")
        by_hold = run["engine"]["step_gap_ms_by_hold"]
        assert set(by_hold) <= {*GAP_HOLDS, GAP_READ, GAP_LOOP} and by_hold[GAP_READ] > 0
        assert sum(by_hold.values()) == pytest.approx(run["engine"]["step_gap_ms"], rel=1e-6)
        assert run["server_metrics"]["qwen3tts_engine_stream_limit_seconds"] == 0.0  # exported, counted per window
        assert gauges["qwen3tts_engine_stream_limit"] == gauges["qwen3tts_engine_max_streams"] > 0
        # ... through the window too: sampled every half second from the warm-up's start while the clients ran (a
        # scrape of a busy server may take longer than that, so no count nor end is promised beyond a few)
        samples = run["stream_limit_samples"]
        assert samples["columns"] == ["s", "limit", "active", "queued"]
        seconds = [row[0] for row in samples["rows"]]
        assert len(seconds) >= 2 and seconds == sorted(seconds) and 0 <= seconds[0] < seconds[-1]
        assert all(row[1] == gauges["qwen3tts_engine_max_streams"] for row in samples["rows"])
    passing = [p for p in probes if p["passed"]]
    if passing:
        best = max(passing, key=lambda p: p["rate_per_s"])
        assert capacity["rate_per_s"] == best["rate_per_s"]
        assert capacity["frames_per_s_served"] == best["served_rate_per_s"] * 4
        assert capacity["frames_per_s_served"] == report["runs"][best["run"]]["served_rate_per_s"] * 4
        assert all(not p["passed"] for p in probes if p["rate_per_s"] > best["rate_per_s"])
    else:
        assert capacity["rate_per_s"] is None and capacity["frames_per_s_served"] is None
        assert len(probes) == 1
    assert result.stdout.splitlines()[-1].startswith("capacity over ws ")


def test_a_load_run_stopped_by_sigterm_stops_the_server_it_started(tmp_path: Path) -> None:
    """`timeout` or a job runner stops a benchmark with SIGTERM: it must take its `serve` (a session of its own,
    which no signal to the benchmark reaches) down with it, or the server holds the GPU that the next run needs."""
    command = [
        sys.executable, "-m", "benchmarks.serving.load", "--model", "synthetic:tiny", "--server-arg=--backend=torch",
        "--rates", "1", "--clients", "1", "--warmup", "1", "--duration", "600", "--frames", "4",
        "--out", str(tmp_path / "load.json"),
    ]
    load = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    servers: list[psutil.Process] = []
    try:
        assert load.stdout is not None
        for line in load.stdout:  # the server is ready once the first window starts
            if "ws at 1 req/s" in line:
                break
        servers = [p for p in psutil.Process(load.pid).children() if "qwen3tts_agent.cli" in " ".join(p.cmdline())]
        assert len(servers) == 1, servers
        load.send_signal(signal.SIGTERM)
        assert load.wait(90) == 128 + signal.SIGTERM
        assert not psutil.pid_exists(servers[0].pid)
    finally:
        load.kill()
        load.wait()
        for server in servers:  # this test's failure must not leave a server behind either
            if server.is_running():
                os.killpg(server.pid, signal.SIGKILL)


def test_the_device_ceiling_comes_from_a_budget_report() -> None:
    """A real budget (1.7B on an H100, the thirtieth session): its most utterances a second are at its fullest
    frame steps (192 rows) and codec calls (192 chunks), 107.6 a second of 100 frames."""
    path = (Path(__file__).parent.parent / "benchmarks/results/2026-12-07-h100-epilogues-channels-last"
            / "call-1-budget-1.7b-epilogues.json")
    budget = json.loads(path.read_text())
    fullest = max(budget["budget"], key=lambda row: (row["rows"], row["codec_batch"]))
    assert device_ceiling_from_budget(path) == fullest["utterances_per_s"] * 100
    assert round(device_ceiling_from_budget(path)) == 10763
