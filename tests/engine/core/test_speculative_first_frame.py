"""The speculative first frame through the engine: a streamed text's first frame runs on the second token as
the text stands, its audio waits until that token is final, and a token that changes starts the stream over.
Either way the codes are the whole text's (greedy, synthetic tiny model, x-vector voice)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from qwen3tts_agent import Engine, EngineStats, SamplingParams, SpeechStream, Voice
from tests.engine_helpers import engine_for, xvector_voice

SAMPLING = SamplingParams.greedy(max_frames=24)


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = engine_for("synthetic:tiny", max_streams=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def voice(engine: Engine) -> Voice:
    return xvector_voice(engine)


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _whole_codes(engine: Engine, voice: Voice, text: str) -> list[list[int]]:
    return engine.synthesize_blocking(text, voice=voice, sampling=SAMPLING)[1].codes


def _speculating(engine: Engine, voice: Voice, second: str, **options: object) -> tuple[SpeechStream, EngineStats]:
    """A stream given "Hello" (final once `second` begins) and `second` (tentative), once its first frame has
    run on `second`; with the engine's stats from before it opened."""
    before = engine.stats()
    stream = engine.open_stream(voice=voice, sampling=SAMPLING, **options)  # type: ignore[arg-type]
    stream.push_text("Hello")
    stream.push_text(second)
    _wait_for(lambda: engine.stats().frames_generated > before.frames_generated, "the speculative first frame")
    return stream, before


def test_the_first_frame_runs_before_its_token_is_final_and_its_audio_waits_for_it(engine: Engine, voice: Voice) -> None:
    text = "Hello there, friend. How are you?"
    whole = _whole_codes(engine, voice, text)
    stream, before = _speculating(engine, voice, " there", chunk_schedule=(1,))  # " there" may still grow
    assert engine.stats().speculations == before.speculations + 1
    chunks = stream.chunks(timeout=0.3)
    with pytest.raises(TimeoutError):  # its audio is held: " there" may still grow
        next(chunks)
    stream.push_text(",")  # " there" is final, and the same token
    first = next(stream.chunks(timeout=30))
    assert first.frame_start == 0
    stream.push_text(" friend. How are you?")
    stream.close_input()
    list(stream.chunks(timeout=60))
    assert stream.result.codes == whole
    assert engine.stats().speculation_misses == before.speculation_misses


def test_a_token_that_changes_starts_the_stream_over_with_the_final_text(engine: Engine, voice: Voice) -> None:
    text = "Hello world again, my friend."
    whole = _whole_codes(engine, voice, text)
    stream, before = _speculating(engine, voice, " wor", chunk_schedule=(1,))  # the first frame runs on " wor" ...
    stream.push_text("ld")  # ... which is " world" now (letters only: the core learns it with the next piece)
    stream.push_text(" again")
    _wait_for(lambda: engine.stats().speculation_misses > before.speculation_misses, "the restart")
    stream.push_text(", my friend.")
    stream.close_input()
    pcm = [chunk.pcm for chunk in stream.chunks(timeout=60)]
    assert stream.result.codes == whole
    assert sum(len(p) for p in pcm) == len(whole) * 1920
    assert engine.stats().speculations == before.speculations + 1  # the restarted stream did not speculate


def test_a_cancel_while_the_first_frame_is_held_ends_the_stream_cleanly(engine: Engine, voice: Voice) -> None:
    stream, _ = _speculating(engine, voice, " there")
    stream.cancel()
    assert list(stream.chunks(timeout=30)) == []
    _wait_for(lambda: engine.stats().active_streams == 0, "the slot to be free")
    codes = _whole_codes(engine, voice, "Hello there.")  # the engine goes on
    assert codes


def test_without_speculation_the_first_frame_waits_for_the_final_token(voice: Voice) -> None:
    engine = engine_for("synthetic:tiny", max_streams=1, speculative_first_frame=False)
    try:
        stream = engine.open_stream(voice=voice, sampling=SAMPLING)
        stream.push_text("Hello")
        stream.push_text(" there")
        time.sleep(0.5)
        assert engine.stats().frames_generated == 0 and engine.stats().speculations == 0
        stream.push_text(",")
        stream.close_input()
        assert list(stream.chunks(timeout=60))
    finally:
        engine.close()
