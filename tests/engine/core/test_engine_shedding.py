"""Refusing new streams (`shed_when_behind`) is a statement about load now: the real engine on the CPU, driven
through one slow step (issue 42: one slow step made an idle engine refuse every stream from then on), and
through a request kept waiting for a slot.

The slow step is the runner's own frame step with a sleep before it, once (`_slow_step_once`): on the CPU the
core times a batched step around that call (`StepLauncher._queue_step`), so the sleep is the step's time, as
a first Triton compile or a graph capture is inside a GPU step's events.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.engine.scheduler import device_load
from qwen3tts_agent.engine.scheduler.scheduler import SLOT_WAIT_TO_SHED_S
from qwen3tts_agent.errors import EngineOverloadedError
from tests.engine_helpers import engine_for, xvector_voice

TEXT = "Hello there, how can I help you today?"
SLOW_STEP_S = 2.0  # far past a frame's 80 ms: a compile or a capture
WINDOW_S = 2.0  # the step window for these tests (default 1 s), so that the evidence is surely fresh when read


def _slow_step_once(engine: Engine, call: int) -> Callable[[], list[float]]:
    """Make the runner's `call`-th frame step (1-based) sleep SLOW_STEP_S first; returns a function that gives
    when every frame step so far ended."""
    runner = engine.core.runner
    frame_step = runner.frame_step
    ends: list[float] = []

    def step(*args, **kwargs):  # type: ignore[no-untyped-def]
        if len(ends) + 1 == call:
            time.sleep(SLOW_STEP_S)
        frame_step(*args, **kwargs)
        ends.append(time.perf_counter())

    runner.frame_step = step  # type: ignore[method-assign]
    return lambda: list(ends)


def _sampling(frames: int) -> SamplingParams:
    return SamplingParams.greedy(max_frames=frames, ignore_eos=True)


@pytest.fixture()
def engine(monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setattr(device_load, "STEP_WINDOW_S", WINDOW_S)
    engine = engine_for("synthetic:tiny", max_streams=2, shed_when_behind=True)
    yield engine
    engine.close()


def test_after_one_slow_step_an_engine_with_nothing_live_admits_the_next_stream(engine: Engine) -> None:
    """The issue's case: a stream's step takes seconds (here its last one), the stream ends, and the next
    request, with nothing else running, is admitted at once and runs to completion."""
    voice: Voice = xvector_voice(engine)
    frames = 6
    step_ends = _slow_step_once(engine, call=frames)
    _, first = engine.synthesize_blocking(TEXT, voice=voice, sampling=_sampling(frames))
    assert first.frames == frames and len(step_ends()) == frames
    load = engine.core.scheduler.load
    now = time.perf_counter()
    assert now - step_ends()[-1] < WINDOW_S and load.step_seconds(now) > SLOW_STEP_S / frames
    assert load.slow_steps(now)  # the device's recent steps say it is behind, yet nothing is live:
    assert not engine.stats().overloaded
    pcm, second = engine.synthesize_blocking(TEXT, voice=voice, sampling=_sampling(frames))
    assert second.finish_reason == "max_frames" and second.frames == frames and len(pcm) == frames * 1920


def test_a_slow_step_refuses_new_streams_beside_a_live_one_until_it_is_a_window_old(engine: Engine) -> None:
    """A stream waits for more text (an LLM's next tokens) after one of its steps took seconds: while that step
    is recent, new streams are refused; a window after it, with no step since, they are admitted again."""
    voice = xvector_voice(engine)
    step_ends = _slow_step_once(engine, call=2)
    waiting = engine.open_stream(voice=voice, sampling=_sampling(200))
    waiting.push_text("Hello there, how can I help you with your order today, and ")  # frames, then a wait for text
    deadline = time.monotonic() + 60
    quiet_since, seen = time.monotonic(), 0
    while seen < 2 or time.monotonic() - quiet_since < 0.3:  # the slow step ran, and then its text was used up
        assert time.monotonic() < deadline, "the stream never stopped stepping"
        if len(step_ends()) != seen:
            quiet_since, seen = time.monotonic(), len(step_ends())
        time.sleep(0.02)
    assert not waiting.done  # live, waiting for text
    last_step = step_ends()[-1]
    assert time.perf_counter() - step_ends()[1] < WINDOW_S
    with pytest.raises(EngineOverloadedError) as refused:
        engine.open_stream(TEXT, voice=voice, sampling=_sampling(4))
    assert refused.value.reason == "slow_steps" and engine.stats().refusal_reason == "slow_steps"
    # no step runs from here on until a new stream is admitted: the evidence fades with time alone
    time.sleep(max(0.0, last_step + max(WINDOW_S, device_load.LATE_WINDOW_S) + 0.05 - time.perf_counter()))
    assert len(step_ends()) == seen
    pcm, result = engine.synthesize_blocking(TEXT, voice=voice, sampling=_sampling(4))
    assert result.finish_reason == "max_frames" and len(pcm) == 4 * 1920
    waiting.push_text("what else?")
    waiting.close_input()
    assert sum(chunk.frame_end - chunk.frame_start for chunk in waiting.chunks(timeout=60)) == waiting.result.frames > seen


def test_a_request_kept_waiting_for_a_slot_refuses_new_streams_until_it_has_one(engine: Engine) -> None:
    """Both slots held by streams waiting for their callers' text, a third request queues in the core for a
    slot. Once it has waited `SLOT_WAIT_TO_SHED_S`, new streams are refused at once (`busy`) instead of queueing
    behind it for seconds (no chunk is late: a queued request has no deadline yet); when a slot frees, the queued
    request takes it and runs, and new streams are admitted again."""
    voice = xvector_voice(engine)
    scheduler = engine.core.scheduler
    holders = [engine.open_stream(voice=voice, sampling=_sampling(200)) for _ in range(2)]
    for holder in holders:
        holder.push_text("Hello there, ")  # a few frames, then a wait for more text, in its slot
    queued = engine.open_stream(TEXT, voice=voice, sampling=_sampling(4))
    deadline = time.monotonic() + 30
    while scheduler.slot_wait(time.perf_counter()) < SLOT_WAIT_TO_SHED_S:
        assert time.monotonic() < deadline, "the third request never waited for a slot"
        time.sleep(0.01)
    assert len(scheduler.running) == 2 and not queued.done
    with pytest.raises(EngineOverloadedError) as refused:
        engine.open_stream(TEXT, voice=voice, sampling=_sampling(4))
    assert refused.value.reason == "slot_wait" and engine.stats().refusal_reason == "slot_wait"
    assert engine.stats().overloaded and scheduler.load.stats.late_chunks == 0

    holders[0].cancel()
    assert sum(chunk.frame_end - chunk.frame_start for chunk in queued.chunks(timeout=60)) == 4
    assert scheduler.slot_wait(time.perf_counter()) == 0.0 and not engine.stats().overloaded
    assert engine.stats().refusal_reason is None
    pcm, result = engine.synthesize_blocking(TEXT, voice=voice, sampling=_sampling(4))
    assert result.finish_reason == "max_frames" and len(pcm) == 4 * 1920
    holders[1].cancel()


@pytest.mark.parametrize("shed", [True, False])
def test_the_stream_limit_in_the_stats_is_the_one_admission_applies(shed: bool) -> None:
    """Late chunks cut the stream limit of an engine that sheds, and its stats show the cut; an engine that does
    not (the CPU's default) takes on every slot whatever its chunks' lateness, and its stats say so. (A shared
    CPU's chunks do leave late: CI's capacity run through `serve` saw its scheduler cut twice.)"""
    engine = engine_for("synthetic:tiny", max_streams=4, shed_when_behind=shed)
    try:
        limit = engine.core.scheduler.stream_limit
        cut_at = time.perf_counter()
        assert limit.on_late(streams=4, now=cut_at)  # the evidence of three late chunks, as the core books it
        stats = engine.stats()
        if shed:
            assert (stats.stream_limit, stats.stream_limit_cuts) == (3, 1)  # 90 % of the 4 streams there
            assert 0.0 < stats.stream_limit_seconds <= time.perf_counter() - cut_at  # below the slots since the cut
        else:
            assert (stats.stream_limit, stats.stream_limit_cuts) == (stats.max_streams, 0) == (4, 0)
            assert stats.stream_limit_seconds == 0.0
    finally:
        engine.close()
