"""The step clock (`Engine(step_period_s=...)`) on the CPU: under load batched steps keep to it, a new stream's
first frame does not wait for it, and no stream's codes or audio change.

Each stream's audio is one chunk here, so no stream has a chunk deadline while it steps and the clock is never
released early for one (`Scheduler.pace_release`, tested in tests/test_scheduler.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from qwen3tts_agent import SamplingParams
from qwen3tts_agent.engine.engine import STEP_CLOCK_LOAD
from tests.engine_helpers import engine_for, xvector_voice

TEXT = "Hello there, how can I help you today?"
PERIOD_S = 0.15  # well above a step of the tiny model on two cores (~45 ms with 9 rows)
FRAMES = 12


def test_paced_steps_are_a_period_apart_and_change_no_code() -> None:
    engine = engine_for(
        "synthetic:tiny", max_streams=STEP_CLOCK_LOAD + 2, step_period_s=PERIOD_S, chunk_schedule=(FRAMES,)
    )
    core = engine.core
    launches: list[tuple[float, int, bool]] = []  # (when, rows, whether every row had had its first frame)
    queue_step = core._queue_step

    def spy(rows, now, *, batched=True):  # type: ignore[no-untyped-def]  # pass-through: records each launch
        if batched:
            launches.append((now, len(rows), all(r.frames_launched for r in rows)))
        queue_step(rows, now, batched=batched)

    core._queue_step = spy  # type: ignore[method-assign]
    sampling = SamplingParams.greedy(max_frames=FRAMES, ignore_eos=True)
    try:
        voice = xvector_voice(engine)
        _, alone = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        launches.clear()
        streams = [engine.open_stream(TEXT, voice=voice, sampling=sampling) for _ in range(STEP_CLOCK_LOAD + 1)]
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
    np.testing.assert_allclose(audio[0], audio[-1], atol=1e-6)
    paced = [
        t1 - t0
        for (t0, _, _), (t1, rows, old) in zip(launches, launches[1:], strict=False)
        if rows >= STEP_CLOCK_LOAD and old
    ]
    assert len(paced) >= FRAMES - 2, launches
    assert min(paced) >= PERIOD_S - 1e-6
    assert elapsed >= (FRAMES - 2) * PERIOD_S


def test_a_negative_period_is_refused() -> None:
    with pytest.raises(ValueError, match="step_period_s"):
        engine_for("synthetic:tiny", max_streams=4, step_period_s=-0.01)
