"""The step clock (`Engine(step_period_s=...)`) on the CPU: under load batched steps keep to it (back to back once
every slot is held), a new stream's first frame does not wait for it, a paced step waits while a new stream's
first chunk decodes (and with `first_audio_alone` any step that carries no first frame), and no stream's codes or
audio change.

Each stream's audio is one chunk here, so no stream has a chunk deadline while it steps and the clock is never
released early for one (`Scheduler.pace_release`, tested in tests/engine/scheduler/test_scheduler.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from qwen3tts_agent import SamplingParams
from qwen3tts_agent.engine.frontend.engine import STEP_CLOCK_LOAD
from tests.engine_helpers import engine_for, on_batched_launch, xvector_voice

TEXT = "Hello there, how can I help you today?"
PERIOD_S = 0.15  # well above a step of the tiny model on two cores (~45 ms with 9 rows)
FRAMES = 12


@pytest.mark.parametrize("slots", ["room", "full"])
def test_paced_steps_are_a_period_apart_and_change_no_code(slots: str) -> None:
    """With slots to spare (half of them held) paced steps are a period apart; with every slot held the clock's
    period shrinks to none (`Scheduler.clock_period`) and they go back to back. The codes are the same."""
    streams_held = STEP_CLOCK_LOAD + 1
    max_streams = 2 * streams_held if slots == "room" else streams_held
    engine = engine_for("synthetic:tiny", max_streams=max_streams, step_period_s=PERIOD_S, chunk_schedule=(FRAMES,))
    launches: list[tuple[float, int, bool]] = []  # (when, rows, whether every row had had its first frame)
    on_batched_launch(engine, lambda rows, now: launches.append((now, len(rows), all(r.frames_launched for r in rows))))
    sampling = SamplingParams.greedy(max_frames=FRAMES, ignore_eos=True)
    try:
        voice = xvector_voice(engine)
        _, alone = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        launches.clear()
        streams = [engine.open_stream(TEXT, voice=voice, sampling=sampling) for _ in range(streams_held)]
        audio: list[np.ndarray] = [np.zeros(0)] * len(streams)

        def drain(i: int) -> None:
            audio[i] = np.concatenate([chunk.pcm for chunk in streams[i].chunks(timeout=120)])

        readers = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
        started = time.perf_counter()
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=120)
        elapsed = time.perf_counter() - started
        releases = engine.stats().clock_releases
    finally:
        engine.close()
    assert releases == 0
    for stream in streams:
        assert stream.result.codes == alone.codes
    # which chunks share a codec call depends on timing, and a batched call's float sums may differ in the
    # last bits (up to ~1.5e-6 seen on two busy cores): the codes above are the exact check
    np.testing.assert_allclose(audio[0], audio[-1], atol=1e-5)
    paced = [
        t1 - t0
        for (t0, _, _), (t1, rows, old) in zip(launches, launches[1:], strict=False)
        if rows >= STEP_CLOCK_LOAD and old
    ]
    assert len(paced) >= FRAMES - 2, launches
    if slots == "room":
        assert min(paced) >= PERIOD_S - 1e-6
        assert elapsed >= (FRAMES - 2) * PERIOD_S
    else:
        assert max(paced) < PERIOD_S, paced  # a step of the tiny model takes ~45 ms here
        assert elapsed < (FRAMES - 2) * PERIOD_S


def test_a_paced_step_waits_while_a_first_chunk_decodes() -> None:
    """The CPU has no early codec lane, so the first chunk's decode in flight is played by the test: from the
    third paced step on, for `hold_s`. No stream has a chunk deadline (one chunk each), so nothing releases the
    step before the decode is over."""
    hold_s = 0.3
    engine = engine_for(
        "synthetic:tiny", max_streams=STEP_CLOCK_LOAD + 2, step_period_s=0.001, chunk_schedule=(FRAMES,)
    )
    core = engine.core
    paced: list[float] = []  # when each step whose rows had all had their first frame was queued
    hold_until = [0.0]

    def record(rows: Any, now: float) -> None:
        if len(rows) >= STEP_CLOCK_LOAD and all(r.frames_launched for r in rows):
            paced.append(now)
            if len(paced) == 3:
                hold_until[0] = now + hold_s

    on_batched_launch(engine, record)
    core.audio.first_audio_in_flight = lambda: time.perf_counter() < hold_until[0]  # type: ignore[method-assign]
    sampling = SamplingParams.greedy(max_frames=FRAMES, ignore_eos=True)
    try:
        voice = xvector_voice(engine)
        _, alone = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        paced.clear()
        streams = [engine.open_stream(TEXT, voice=voice, sampling=sampling) for _ in range(STEP_CLOCK_LOAD + 1)]
        for stream in streams:
            list(stream.chunks(timeout=120))
        holds = engine.stats().first_audio_holds
    finally:
        engine.close()
    assert len(paced) >= FRAMES - 2, paced
    assert paced[3] - paced[2] >= hold_s - 0.005  # the launch reads its clock just before it asks
    assert max(b - a for a, b in zip(paced[3:], paced[4:], strict=False)) < hold_s
    assert holds == 1
    for stream in streams:
        assert stream.result.codes == alone.codes


@pytest.mark.parametrize("alone", [True, False], ids=["first_audio_alone", "paced_only"])
def test_a_lone_streams_step_waits_while_its_first_chunk_decodes_with_first_audio_alone(alone: bool) -> None:
    """`first_audio_alone` (on by default on a GPU): below the clock's load, one stream, a step waits while a
    first chunk decodes (played by the test from the third step on, as above); without it, it does not."""
    hold_s = 0.3
    engine = engine_for("synthetic:tiny", max_streams=2, first_audio_alone=alone, chunk_schedule=(FRAMES,))
    launches: list[float] = []
    hold_until = [0.0]

    def record(rows: Any, now: float) -> None:
        launches.append(now)
        if len(launches) == 3:
            hold_until[0] = now + hold_s

    sampling = SamplingParams.greedy(max_frames=FRAMES, ignore_eos=True)
    try:
        voice = xvector_voice(engine)
        _, reference = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        on_batched_launch(engine, record)
        engine.core.audio.first_audio_in_flight = lambda: time.perf_counter() < hold_until[0]  # type: ignore[method-assign]
        _, held = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        holds = engine.stats().first_audio_holds
    finally:
        engine.close()
    assert len(launches) == FRAMES, launches
    gaps = [b - a for a, b in zip(launches, launches[1:], strict=False)]
    if alone:
        assert gaps[2] >= hold_s - 0.005 and holds == 1
    else:
        assert max(gaps) < hold_s and holds == 0
    assert held.codes == reference.codes


def test_a_negative_period_is_refused() -> None:
    with pytest.raises(ValueError, match="step_period_s"):
        engine_for("synthetic:tiny", max_streams=4, step_period_s=-0.01)


def test_the_gap_between_batched_steps_is_counted_only_while_rows_could_step() -> None:
    """`EngineStats.step_gap_seconds`: the time no batched step was queued after one was read with rows left to
    step (on a CPU, the loop's turn between steps). An idle engine's seconds, between one utterance and the next,
    are no gap; a CPU's steps have no device events, so none is timed."""
    engine = engine_for("synthetic:tiny", max_streams=4)
    sampling = SamplingParams.greedy(max_frames=FRAMES, ignore_eos=True)
    try:
        voice = xvector_voice(engine)
        engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        before = engine.stats()
        time.sleep(2.0)  # idle: nothing to step
        started = time.perf_counter()
        engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        busy = time.perf_counter() - started
        after = engine.stats()
    finally:
        engine.close()
    gap = after.step_gap_seconds - before.step_gap_seconds
    assert 0 < gap < busy, (gap, busy)  # the second utterance's turns between its steps, not the idle seconds
    assert after.timed_steps == 0 and after.step_device_seconds == after.step_flight_seconds == 0
