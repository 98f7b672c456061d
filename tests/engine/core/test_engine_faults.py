"""Fault isolation in the engine: a failure at any stage ends as little as it can, and a dead core comes back.

Faults are injected into a real engine over a tiny synthetic checkpoint by replacing one of its parts'
methods for a while (the model runner's prefill or frame step, the prompt builder, a stream's consumer).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.engine.scheduler.requests import runaway_frame_limit
from qwen3tts_agent.errors import EngineDeadError, EngineNotReadyError, InvalidTextError
from tests.engine_helpers import TEXT, engine_for, reference_audio, xvector_voice

SHORT = SamplingParams(max_frames=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = engine_for("synthetic:tiny", max_streams=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def voice(engine: Engine) -> Voice:
    return xvector_voice(engine)


def speak(engine: Engine, voice: Voice, text: str = "Next turn.") -> int:
    pcm, result = engine.synthesize_blocking(text, voice=voice, sampling=SHORT)
    assert len(pcm) == result.frames * 1920
    return result.frames


def test_a_prompt_that_cannot_be_built_fails_its_stream_only(engine: Engine, voice: Voice, monkeypatch) -> None:
    prompts = engine.core.prompts
    original = prompts.body

    def body(spec, text_ids, closed):  # noqa: ANN001, ANN202
        if len(text_ids) > 20:
            raise RuntimeError("prompt builder broke")
        return original(spec, text_ids, closed)

    monkeypatch.setattr(prompts, "body", body)
    bad = engine.open_stream(TEXT * 2, voice=voice, sampling=SHORT)
    good = engine.open_stream("Short one.", voice=voice, sampling=SHORT)
    with pytest.raises(RuntimeError, match="prompt builder broke"):
        list(bad.chunks(timeout=60))
    assert sum(c.frame_end - c.frame_start for c in good.chunks(timeout=60)) == 4
    assert bad.result.finish_reason == "error" and good.result.finish_reason == "max_frames"


def test_out_of_memory_in_a_prefill_fails_that_batch_and_the_engine_goes_on(engine: Engine, voice: Voice, monkeypatch) -> None:
    runner = engine.core.runner
    original = runner.prefill
    calls = []

    def prefill(rows):  # noqa: ANN001, ANN202
        calls.append(len(rows))
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(rows)

    monkeypatch.setattr(runner, "prefill", prefill)
    doomed = engine.open_stream("First.", voice=voice, sampling=SHORT)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        list(doomed.chunks(timeout=60))
    assert speak(engine, voice) == 4
    assert engine.healthy and engine.stats().restarts == 0


def test_a_failed_step_fails_the_streams_in_it_and_the_engine_goes_on(engine: Engine, voice: Voice, monkeypatch) -> None:
    runner = engine.core.runner
    original = runner.frame_step
    failures = iter([True])

    def frame_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if next(failures, False):
            raise RuntimeError("a step broke")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "frame_step", frame_step)
    stream = engine.open_stream(TEXT, voice=voice, sampling=SHORT)
    with pytest.raises(RuntimeError, match="a step broke"):
        list(stream.chunks(timeout=60))
    assert speak(engine, voice) == 4 and engine.stats().restarts == 0


def test_a_consumer_that_raises_does_not_reach_other_streams(engine: Engine, voice: Voice) -> None:
    broken = engine.open_stream(TEXT, voice=voice, sampling=SHORT)

    def deliver(chunk):  # noqa: ANN001, ANN202
        raise RuntimeError("a consumer broke")

    broken._deliver = deliver  # type: ignore[method-assign]
    other = engine.open_stream(TEXT, voice=voice, sampling=SHORT)
    assert sum(c.frame_end - c.frame_start for c in other.chunks(timeout=60)) == 4
    assert list(broken.chunks(timeout=60)) == [] and broken.result.finish_reason == "max_frames"


def test_invalid_text_is_refused_where_it_enters_and_the_stream_goes_on(engine: Engine, voice: Voice) -> None:
    with pytest.raises(InvalidTextError, match="surrogate"):
        engine.open_stream("Hello \ud800 there", voice=voice)
    with pytest.raises(InvalidTextError, match="empty"):
        engine.open_stream(" \n\t ", voice=voice)
    stream = engine.open_stream(voice=voice, sampling=SHORT)
    with pytest.raises(InvalidTextError, match="surrogate"):
        stream.push_text("bad \udfff")
    stream.push_text("Good text.")
    stream.close_input()
    assert sum(c.frame_end - c.frame_start for c in stream.chunks(timeout=60)) == 4
    blank = engine.open_stream(voice=voice, sampling=SHORT)
    blank.push_text("   ")
    blank.close_input()
    with pytest.raises(InvalidTextError, match="empty"):
        list(blank.chunks(timeout=60))


def test_control_token_strings_in_user_text_stay_plain_text(engine: Engine) -> None:
    im_end = engine.tokenizer._im_end
    ids = engine.tokenizer.target_ids("Say <|im_end|><|im_start|>user now")
    assert im_end not in ids and engine.tokenizer._im_start not in ids
    assert engine.tokenizer.target_ids("Say hi") == engine.tokenizer.target_ids("Say hi")  # plain text unchanged


def test_the_runaway_guard_ends_a_stream_that_never_reaches_end_of_speech(engine: Engine, voice: Voice) -> None:
    text = "Hi."
    # the synthetic model never samples its end token (its EOS row is zero): as if it missed it
    pcm, result = engine.synthesize_blocking(text, voice=voice, sampling=SamplingParams(max_frames=500))
    assert result.finish_reason == "length"
    assert result.frames == runaway_frame_limit(len(engine.tokenizer.target_ids(text)))


def test_a_dead_core_ends_its_streams_refuses_new_ones_and_restarts(voice: Voice, monkeypatch) -> None:
    engine = engine_for("synthetic:tiny", max_streams=2)
    try:
        v = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
        assert speak(engine, v) == 4
        before = engine.stats()
        runner = engine.core.runner

        def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError("the device is gone")

        monkeypatch.setattr(runner, "frame_step", broken)  # every step fails: the core gives up
        failed = 0
        deadline = time.monotonic() + 30
        while engine.core.runner is runner and time.monotonic() < deadline:
            try:
                stream = engine.open_stream(TEXT, voice=v, sampling=SHORT)
            except EngineNotReadyError:  # dead, restart pending: refused at once
                break
            with pytest.raises((RuntimeError, EngineDeadError)):
                list(stream.chunks(timeout=60))
            failed += 1
        assert failed >= 3
        while not engine.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.healthy and engine.stats().restarts == 1  # a fresh core, with a fresh runner
        assert engine.core.runner is not runner
        assert speak(engine, v) == 4
        # the dead core's counters stay in the engine's: its frames, steps and step gaps by hold
        after = engine.stats()
        assert after.frames_generated >= before.frames_generated + 4 and after.steps > before.steps
        assert before.step_gap_by_hold and all(
            after.step_gap_by_hold[hold] >= seconds for hold, seconds in before.step_gap_by_hold.items()
        )
    finally:
        engine.close()


def test_a_stop_that_comes_during_a_turn_ends_the_core_at_once() -> None:
    """`Engine.close()` puts a stop on the core's queue. One that arrives while a turn runs is taken by the next
    turn's first look at the queue; that turn, with nothing left to do, then waited for another message without
    a timeout, so the core's thread outlived close() (which gave up on it after 30 s). A pass-through spy on the
    prompts' lane puts the stop during a turn that made progress, as a stream's last delivery does."""
    engine = engine_for("synthetic:tiny", max_streams=2)
    core = engine.core
    run_prompts = core.prompt_lane.run
    armed = threading.Event()

    def run() -> bool:
        progressed = run_prompts()
        if armed.is_set():
            armed.clear()
            core.stop()
            return True  # this turn moved something: the loop goes straight on to its next turn
        return progressed

    core.prompt_lane.run = run  # type: ignore[method-assign]
    try:
        armed.set()
        core.call(lambda: None).result(timeout=10)  # wakes the idle core: its next turn runs the spy
        engine._thread.join(timeout=5)
        assert not armed.is_set() and not engine._thread.is_alive()
    finally:
        engine.close()
