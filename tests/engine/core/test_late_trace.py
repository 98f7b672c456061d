"""Each late chunk's story in the log (`engine/core/late_trace.py`): the steps queued from a while before it was
due until it left, told relative to its deadline, a few lines a second at most; and on the real engine (CPU), a
second chunk made late by one slow step is told with that step."""

from __future__ import annotations

import logging
import re
import time

import pytest

from qwen3tts_agent import SamplingParams
from qwen3tts_agent.engine.core import late_trace
from qwen3tts_agent.engine.core.late_trace import LINES_PER_S, WINDOW_S, LateChunkTrace
from qwen3tts_agent.engine.scheduler import LateChunk, PromptShape, RequestState
from qwen3tts_agent.engine.types import TextLayout
from tests.engine_helpers import engine_for, xvector_voice

TRACE_LOGGER = late_trace.__name__


def _rows(*request_ids: str) -> list[RequestState]:
    return [RequestState(rid, PromptShape(TextLayout.INTERLEAVED), (1,), 0.0) for rid in request_ids]


def test_a_late_chunk_is_told_with_the_steps_around_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    trace = LateChunkTrace()
    due = 100.0
    trace.queued(1, _rows("a", "b"), due - WINDOW_S - 0.05, batched=True)  # before the window: left out
    trace.read(1, due - WINDOW_S - 0.04, 0.01)
    trace.queued(2, _rows("a", "b", "c"), due - 0.2, batched=True)
    trace.read(2, due - 0.19, 0.01)
    trace.queued(3, _rows("n1", "n2"), due - 0.15, batched=False)  # new streams' first frames, without "a"
    trace.read(3, due - 0.149, 0.001)
    trace.queued(4, _rows("a", "b", "c"), due + 0.01, batched=True)  # queued after the deadline, never read back
    late = LateChunk("a", 1, 2, first_audio=due - 0.08, due=due, cut_at=due + 0.02, left_at=due + 0.025)
    assert late.cause == "frames"
    with caplog.at_level(logging.INFO, logger=TRACE_LOGGER):
        trace.on_late(late)
    [line] = caplog.messages
    assert line.startswith("late chunk 1 (2 frames) of a: left +25 ms after it was due (frames); first audio -80, cut +20")
    assert line.endswith("-200~-190 B3*:10.0, -150~-149 F2:1.0, +10~? B3*")


def test_a_chunk_cut_in_time_is_the_codec_lanes_and_a_burst_is_told_a_few_times_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = LateChunkTrace()
    with caplog.at_level(logging.INFO, logger=TRACE_LOGGER):
        for i in range(LINES_PER_S + 3):  # within one second
            trace.on_late(LateChunk(f"s{i}", 1, 2, first_audio=9.9, due=10.0 + i / 100, cut_at=9.99, left_at=10.05 + i / 100))
        trace.on_late(LateChunk("later", 2, 4, first_audio=10.5, due=11.2, cut_at=11.1, left_at=11.3))
    assert len(caplog.messages) == LINES_PER_S + 1
    assert all("(decode)" in line and "steps since" in line and line.endswith("none") for line in caplog.messages[:-1])
    assert caplog.messages[-1].startswith("late chunk 2 (4 frames) of later") and caplog.messages[-1].endswith(
        "(3 more late chunks not logged before it)"
    )


def test_the_engine_logs_a_chunk_made_late_by_a_slow_step(caplog: pytest.LogCaptureFixture) -> None:
    """One frame a chunk, each due 80 ms after the one before it, and the first step after the stream's first audio
    has left sleeps 0.4 s (on the CPU the core reads a step back right after it runs)."""
    engine = engine_for("synthetic:tiny", max_streams=2, chunk_schedule=(1,))
    runner = engine.core.runner
    frame_step = runner.frame_step
    slept: list[float] = []

    def step(*args, **kwargs):  # type: ignore[no-untyped-def]
        heard = any(r.first_audio is not None for r in engine.core.scheduler.running.values())
        if heard and not slept:
            slept.append(time.perf_counter())
            time.sleep(0.4)
        return frame_step(*args, **kwargs)

    try:
        voice = xvector_voice(engine)
        runner.frame_step = step  # type: ignore[method-assign]
        with caplog.at_level(logging.INFO, logger=TRACE_LOGGER):
            engine.synthesize_blocking(
                "Hello there.", voice=voice, sampling=SamplingParams.greedy(max_frames=12, ignore_eos=True)
            )
    finally:
        engine.close()
    assert slept
    # a chunk cut before the sleep leaves late too, but for want of the core's loop (the codec lane's share)
    lines = [line for line in caplog.messages if line.startswith("late chunk ") and "(frames)" in line]
    assert lines, caplog.messages
    story = re.fullmatch(r"late chunk \d+ \(1 frames\) of \S+: left \+(\d+) ms after it was due \(frames\); .*: (.*)",
                         lines[0])
    assert story is not None and int(story.group(1)) >= 100, lines[0]  # 400 ms less the frames due before it
    # the slow step, with the stream in it, read back 400 ms or more after it was queued
    spans = [re.fullmatch(r"([+-]\d+)~([+-]\d+) B1\*", s) for s in story.group(2).split(", ")]  # no events on a CPU
    assert any(m is not None and int(m.group(2)) - int(m.group(1)) >= 400 for m in spans), story.group(2)
