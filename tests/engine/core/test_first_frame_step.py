"""A new stream's first frame in a step of its own under load (`Engine(first_frame_step_load=...)`), CPU.

Under load a new stream takes a first-frame slot, its first frame runs in a step of those slots alone, and
its state then moves to a slot above them (`Scheduler.first_frame_rows`, `Scheduler.moves`,
`ModelRunner.move_slot`). Each stream's codes and audio must be exactly those it gets alone.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from qwen3tts_agent import SamplingParams, Voice
from qwen3tts_agent.engine.frontend.engine import FIRST_FRAME_SLOTS, STEP_CLOCK_LOAD
from qwen3tts_agent.engine.scheduler import device_load
from tests.engine_helpers import engine_for, on_batched_launch, xvector_voice

TEXT = "Hello there, how can I help you today?"


def _run(engine, voice: Voice, frames: int):  # type: ignore[no-untyped-def]
    return engine.open_stream(TEXT, voice=voice, sampling=SamplingParams.greedy(max_frames=frames, ignore_eos=True))


def _audio(chunks, first: list | None = None) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.concatenate([chunk.pcm for chunk in [*(first or []), *chunks]])


def _assert_as_alone(alone, *groups) -> None:  # type: ignore[no-untyped-def]
    """Each (streams, their audio, frames) group's codes and audio are those of the stream of `frames` run alone."""
    for streams, audio, frames in groups:
        pcm_alone, result_alone = alone[frames]
        for stream, pcm in zip(streams, audio, strict=True):
            assert stream.result.codes == result_alone.codes
            np.testing.assert_allclose(pcm, pcm_alone, atol=1e-5)


def test_first_frames_in_steps_of_their_own_change_no_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_load, "FIRST_FRAME_PAUSE_S", 0.0)  # a late chunk on a busy CPU would pause them
    slots = FIRST_FRAME_SLOTS
    engine = engine_for("synthetic:tiny", max_streams=2 * slots + 2, first_frame_step_load=slots)
    runner = engine.core.runner
    moves: list[tuple[int, int]] = []
    move_slot = runner.move_slot

    def spy(src: int, dst: int, positions: int, text_tokens: int) -> None:  # pass-through: records the moves
        moves.append((src, dst))
        move_slot(src, dst, positions, text_tokens)

    runner.move_slot = spy  # type: ignore[method-assign]
    scheduler = engine.core.scheduler
    batched_steps: list[int] = []  # rows of every batched step queued
    timed_steps: list[float] = []  # every step time the scheduler was given
    on_batched_launch(engine, lambda rows, now: batched_steps.append(len(rows)))
    record_step_time = scheduler.load.record_step_time

    def record_spy(seconds: float, now: float) -> None:
        timed_steps.append(seconds)
        record_step_time(seconds, now)

    scheduler.load.record_step_time = record_spy  # type: ignore[method-assign]
    try:
        voice = xvector_voice(engine)
        alone = {n: engine.synthesize_blocking(TEXT, voice=voice, sampling=SamplingParams.greedy(max_frames=n, ignore_eos=True))
                 for n in (8, 40, 24)}
        before = engine.stats()
        short = [_run(engine, voice, 8) for _ in range(slots)]  # the lowest slots, at light load
        first_chunks = short[0].chunks(timeout=120)
        started = [next(first_chunks)]  # they are stepping now
        # under load: short streams make room (`make_room`) or the long ones take the slots above
        long = [_run(engine, voice, 40) for _ in range(slots)]
        short_audio = [_audio(first_chunks, started)] + [_audio(s.chunks(timeout=120)) for s in short[1:]]
        new = [_run(engine, voice, 24) for _ in range(2)]  # the short ones ended: first-frame slots, then above
        new_audio = [_audio(s.chunks(timeout=120)) for s in new]
        long_audio = [_audio(s.chunks(timeout=120)) for s in long]
        after = engine.stats()
    finally:
        engine.close()
    assert after.first_frame_steps > before.first_frame_steps, "no first frame ran in a step of its own"
    # every move leaves a first-frame slot for one above them (which streams move depends on timing: a stream
    # leaving after its early frames, or one making room for an arrival)
    assert moves and all(src < slots <= dst for src, dst in moves), moves
    # the step time the clock's release and the overload check go by is a batched step's: the first-frame
    # steps (a few rows, far quicker under load) are left out of it
    assert len(timed_steps) == len(batched_steps), (len(timed_steps), len(batched_steps))
    _assert_as_alone(alone, (short, short_audio, 8), (long, long_audio, 40), (new, new_audio, 24))


def test_streams_through_the_first_frame_slots_of_a_full_engine_make_their_codes_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More streams than the engine holds, arriving faster than they end: while every slot is taken, a stream
    leaves its first-frame slot for the one a stream that ended frees (`Scheduler.make_room`, copied on the
    prompts' lane before the arrival's set-up there). Every stream's codes are still those it makes alone.
    (tests/kernels/test_first_frame_slots.py runs the same on a GPU, where the lanes are CUDA streams.) On
    this CPU chunks leave late, which would pause first-frame slots (`DeviceLoad.first_frames_paused`, tested
    in test_scheduler.py): no pause here, so that the slots are exercised."""
    monkeypatch.setattr(device_load, "FIRST_FRAME_PAUSE_S", 0.0)
    slots = FIRST_FRAME_SLOTS
    engine = engine_for("synthetic:tiny-customvoice", max_streams=2 * slots + 2, max_seq_len=256, first_frame_step_load=slots)
    made_room: list[int] = []
    make_room = engine.core.scheduler.make_room

    def spy(now: float, period_s: float) -> list:  # type: ignore[type-arg]
        moves = make_room(now, period_s)
        made_room.extend(move.old for move in moves)
        return moves

    engine.core.scheduler.make_room = spy  # type: ignore[method-assign]
    voice = Voice(speaker=engine.speakers[0])
    try:
        alone = _run(engine, voice, 40)
        list(alone.chunks(timeout=120))
        streams = []
        for i in range(36):
            streams.append(_run(engine, voice, 16 + (i * 7) % 25))
            time.sleep(0.01)
        for stream in streams:
            list(stream.chunks(timeout=300))
    finally:
        engine.close()
    assert made_room and all(slot < slots for slot in made_room), made_room
    for stream in streams:
        assert stream.result.codes == alone.result.codes[: len(stream.result.codes)]


def test_on_a_full_device_first_frames_wait_for_the_clock_and_change_no_code() -> None:
    """From `clock_first_frame_load` streams stepping, a new stream's first frame goes in the step clock's
    batched steps (`Scheduler.paced` holds the step that carries it, as it holds every other); each stream's
    codes and audio are still those it makes alone. Step clock and loads set low for a CPU."""
    load = STEP_CLOCK_LOAD
    engine = engine_for("synthetic:tiny", max_streams=load + 4, step_period_s=0.05, first_frame_step_load=0,
                        clock_first_frame_load=load)
    scheduler = engine.core.scheduler
    paced_first_frames: list[bool] = []  # for each pacing decision over a step that carries a first frame
    paced = scheduler.paced

    def spy(rows):  # type: ignore[no-untyped-def]
        result = paced(rows)
        if sum(1 for r in rows if r.frames_launched) >= load and any(not r.frames_launched for r in rows):
            paced_first_frames.append(result)
        return result

    scheduler.paced = spy  # type: ignore[method-assign]
    try:
        voice = xvector_voice(engine)
        alone = {n: engine.synthesize_blocking(TEXT, voice=voice, sampling=SamplingParams.greedy(max_frames=n, ignore_eos=True))
                 for n in (40, 24)}
        running = [_run(engine, voice, 40) for _ in range(load)]
        chunks = [s.chunks(timeout=120) for s in running]
        # every one of them is stepping now (the first alone would not do: on a busy machine the others' prompts
        # may still run when the new streams come, whose first frames then share a step with theirs)
        started = [[next(c)] for c in chunks]
        new = [_run(engine, voice, 24) for _ in range(2)]
        new_audio = [_audio(s.chunks(timeout=120)) for s in new]
        running_audio = [_audio(c, first) for c, first in zip(chunks, started, strict=True)]
    finally:
        engine.close()
    assert paced_first_frames and all(paced_first_frames), paced_first_frames
    _assert_as_alone(alone, (running, running_audio, 40), (new, new_audio, 24))
