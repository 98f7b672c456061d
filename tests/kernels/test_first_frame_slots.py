"""New streams through the first-frame slots on a GPU, with the engine full: every stream keeps its codes.

Under load a new stream steps in a first-frame slot, in steps of those slots alone, then moves above them:
between steps on the steps' stream (`Scheduler.moves`), or, while every slot is taken, right before a new
request takes the slot it leaves (`Scheduler.make_room`: on the prompts' lane, or on the steps' stream behind
a frame in flight with the prompts' lane waiting for it). The copies race nothing only if the lanes are
ordered as the scheduler assumes; in fp32 (TF32 off) each stream's greedy codes must then be those it makes
alone. The engine does not shed, so the requests past its slots wait for one rather than being refused. Only the GPU has the lanes, so this runs with `pytest -m gpu tests/kernels`.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

FRAMES = 40


@pytest.mark.gpu
def test_streams_through_first_frame_slots_of_a_full_engine_make_their_codes_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qwen3tts_agent import Engine, SamplingParams, Voice
    from qwen3tts_agent.engine.frontend.engine import FIRST_FRAME_SLOTS
    from qwen3tts_agent.engine.scheduler import Scheduler, device_load
    from qwen3tts_agent.models.loading import load_official_model

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    made_room: list[int] = []
    make_room = Scheduler.make_room

    def recorded(self: Scheduler, now: float, period_s: float) -> Any:
        moves = make_room(self, now, period_s)
        made_room.extend(move.old for move in moves)
        return moves

    monkeypatch.setattr(Scheduler, "make_room", recorded)
    monkeypatch.setattr(device_load, "FIRST_FRAME_PAUSE_S", 0.0)  # a late chunk would pause the slots
    official = load_official_model("synthetic:tiny-customvoice", device="cuda", dtype=torch.float32, progress=False)
    engine = Engine(official, keep_codes=True, max_streams=2 * FIRST_FRAME_SLOTS + 2, max_seq_len=256,
                    first_frame_step_load=FIRST_FRAME_SLOTS, backend="torch",
                    shed_when_behind=False)  # queue the surplus: refusing it (slot_wait) would empty the slots
    text = "Hello there, how can I help you today?"
    try:
        engine.warmup(progress=False)
        voice = Voice(speaker=engine.speakers[0])

        def run(frames: int) -> Any:
            return engine.open_stream(text, voice=voice, sampling=SamplingParams.greedy(max_frames=frames, ignore_eos=True))

        alone = run(FRAMES)
        list(alone.chunks(timeout=120))
        before = engine.stats()
        streams = []
        for i in range(48):  # more than the engine holds, arriving faster than streams end
            streams.append(run(16 + (i * 7) % (FRAMES - 15)))
            time.sleep(0.004)
        for stream in streams:
            list(stream.chunks(timeout=120))
        after = engine.stats()
    finally:
        engine.close()
    assert after.first_frame_steps > before.first_frame_steps
    assert made_room and all(slot < FIRST_FRAME_SLOTS for slot in made_room), made_room
    for stream in streams:
        frames = len(stream.result.codes)
        assert stream.result.codes == alone.result.codes[:frames]
