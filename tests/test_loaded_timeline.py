"""The loaded-timeline benchmark's reading of a CUPTI trace (`benchmarks/engine/loaded_timeline.py`): steps found on
the steps' stream, the loop's work between them left out, other streams' kernels counted by kind inside each step."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.engine.loaded_timeline import busy_shares, by_overlap, host_calls, step_rows, stream_kinds

LAST = "_talker_code0_kernel_0d1d2"


def kernel(name: str, stream: int, start: float, end: float) -> dict[str, Any]:
    return {"name": name, "kind": "kernel", "stream": stream, "tid": 1, "start": start, "end": end}


def trace() -> list[dict[str, Any]]:
    return sorted([
        kernel("_feed_kernel", 7, 0, 5),  # the loop's text feed, long before the next step
        {"name": "Memcpy HtoD", "kind": "gpu_memcpy", "stream": 7, "tid": 1, "start": 900, "end": 950},
        kernel("_predictor_code_kernel_0d1", 7, 1000, 1100), kernel(LAST, 7, 1105, 1200),
        kernel("_predictor_code_kernel_0d1", 7, 2000, 2300), kernel(LAST, 7, 2310, 2400),
        kernel("conv_fprop", 13, 2100, 2250), kernel("_extend_kernel", 13, 2050, 2150),  # a codec lane
        kernel("prefill_gemm", 21, 1000, 1020), kernel(LAST, 21, 1020, 1050),  # a prefill samples codebook 0 too
    ], key=lambda e: e["start"])


def test_streams_are_told_apart_by_their_kernels() -> None:
    assert stream_kinds(trace()) == {7: "steps", 13: "codec", 21: "other"}


def test_each_step_is_split_into_its_kernels_gaps_and_the_overlap_of_other_streams() -> None:
    first, second = step_rows(trace())
    assert first == pytest.approx({
        "start": 1000, "span_us": 200, "kernels": 2, "kernel_us": 195, "gaps_us": 5, "codec_overlap_us": 0,
        "other_overlap_us": 50, "overlap_share": 0.25,
    })
    # the codec's two kernels overlap each other: counted once (2050-2250)
    assert second == pytest.approx({
        "start": 2000, "span_us": 400, "kernels": 2, "kernel_us": 390, "gaps_us": 10, "codec_overlap_us": 200,
        "other_overlap_us": 0, "overlap_share": 0.5,
    })
    groups = by_overlap([first, second], min_kernels=2)
    assert groups["overlap 0.25-0.50"]["span_us_p50"] == 200 and groups["overlap 0.50-0.75"]["span_us_p50"] == 400
    assert by_overlap([first, second], min_kernels=3) == {}  # neither is a batched step


def test_busy_shares_count_each_kind_of_stream_once_over_the_recording() -> None:
    shares = busy_shares(trace())
    assert shares["steps"] == pytest.approx((5 + 195 + 390) / 2400)
    assert shares["codec"] == pytest.approx(200 / 2400)
    assert shares["other"] == pytest.approx(50 / 2400)
    assert shares["any"] == pytest.approx((5 + 195 + 390) / 2400)  # the others ran inside the steps' kernels
    assert shares["recorded_s"] == pytest.approx(2400e-6)


def call(name: str, tid: int, start: float, us: float) -> dict[str, Any]:
    return {"name": name, "kind": "cuda_runtime", "stream": None, "tid": tid, "start": start, "end": start + us}


def test_host_calls_say_per_thread_how_long_each_kind_of_call_took_and_its_share_of_the_time() -> None:
    events = sorted(trace() + [
        *(call("cudaLaunchKernel", 1, 100 * i, 5) for i in range(19)), call("cudaLaunchKernel", 1, 1950, 300),
        call("cudaMemcpyAsync", 1, 600, 10), call("cudaGraphLaunch", 2, 700, 40),
    ], key=lambda e: e["start"])
    calls = host_calls(events)
    assert list(calls) == ["1", "2"]  # the thread with the most calls first
    seconds = 2400e-6  # the recording: the first event to the last
    engine = calls["1"]
    assert engine["busy_share"] == pytest.approx((19 * 5 + 300 + 10) / 1e6 / seconds)
    launches = engine["calls"]["cudaLaunchKernel"]
    assert launches["per_s"] == pytest.approx(20 / seconds)
    assert (launches["p50_us"], launches["p99_us"], launches["max_us"]) == (5, 300, 300)  # one launch waited
    assert list(engine["calls"]) == ["cudaLaunchKernel", "cudaMemcpyAsync"]  # costliest first
    assert calls["2"]["calls"]["cudaGraphLaunch"]["share"] == pytest.approx(40 / 1e6 / seconds)
    assert host_calls(trace()) == {}  # no host calls recorded
