"""Streaming behaviour: text pushed in pieces, chunk schedule and timings, cancel, async API, errors."""

from __future__ import annotations

import asyncio
import io
import random
import time

import numpy as np
import pytest
import soundfile as sf

from qwen3tts_agent import Engine, SamplingParams, TextLayout, Voice
from qwen3tts_agent.engine.frontend import IncrementalText, TextTokenizer
from qwen3tts_agent.errors import (
    EngineOverloadedError,
    InvalidReferenceAudioError,
    InvalidRequestError,
    InvalidTextError,
    StreamCancelledError,
    UnknownVoiceError,
    UnsupportedFeatureError,
    UnsupportedLanguageError,
)
from tests.engine_helpers import REF_TEXT, TEXT, engine_for, official_model, reference_audio


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = engine_for("synthetic:tiny", max_streams=3, max_queue=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def voice(engine: Engine) -> Voice:
    return Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))


def _split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_incremental_tokenization_equals_whole_text() -> None:
    """Tokens committed while text streams in are exactly the whole text's tokens, however it is split."""
    tokenizer = TextTokenizer(official_model("synthetic:tiny").processor.tokenizer)
    rng = random.Random(0)
    samples = [
        TEXT, "It's 3:45pm — isn't it?  Yes!!\nNew line, then   spaces.", "Numbers 12345 and 6.78e9; don't stop.",
        "你好，世界。今天天气很好。", "Ünïcödé wörds: café naïve résumé.", "Hello   world  ", "a b c d e f g",
    ]
    for text in samples:
        whole = tokenizer.target_ids(text)
        for _ in range(15):
            incremental = IncrementalText(tokenizer)
            ids: list[int] = []
            for piece in _split_randomly(text, rng):
                ids += incremental.push(piece)
                assert ids == whole[: len(ids)], (text, piece)
            ids += incremental.close()
            assert ids == whole


def test_streamed_text_gives_the_whole_text_codes(engine: Engine, voice: Voice) -> None:
    sampling = SamplingParams.greedy(max_frames=30)
    _, whole = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
    stream = engine.open_stream(voice=voice, sampling=sampling)
    for word in TEXT.split(" "):
        stream.push_text(word + " " if word != TEXT.split(" ")[-1] else word)
        time.sleep(0.01)
    stream.close_input()
    pcm = np.concatenate([c.pcm for c in stream.chunks(timeout=60)])
    assert stream.result.codes == whole.codes
    assert len(pcm) == stream.result.frames * 1920


def test_stream_waits_for_text_instead_of_padding(engine: Engine) -> None:
    """With input open and no text-track token pending, the stream pauses; it resumes when text arrives."""
    tokenizer = TextTokenizer(official_model("synthetic:tiny").processor.tokenizer)
    voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
    stream = engine.open_stream(voice=voice, sampling=SamplingParams.greedy(max_frames=40), chunk_schedule=(1,))
    stream.push_text("One two three four")  # commits "One two three": body + 2 text-track tokens
    chunks = stream.chunks(timeout=30)
    got = [next(chunks)]
    while got[-1].frame_end < 2:
        got.append(next(chunks))
    time.sleep(0.3)
    assert stream.result.frames == len(tokenizer.target_ids("One two three")) - 1
    stream.push_text(" five six.")
    stream.close_input()
    got += list(chunks)
    assert got[-1].frame_end > 2


def test_chunk_schedule_and_timings(voice: Voice) -> None:
    """The schedule is kept as given (the engine's, or the stream's own) when chunks are not adapted to
    deadlines (a CPU engine runs near real time, so adaptation would cut chunks short; see test_scheduler.py
    for that behaviour)."""
    engine = engine_for("synthetic:tiny", max_streams=1, adapt_chunks=False, chunk_schedule=(1, 1, 2))
    sampling = SamplingParams(max_frames=17, ignore_eos=True, seed=1)
    default = list(engine.open_stream(TEXT, voice=voice, sampling=sampling).chunks(timeout=60))
    assert [c.frame_end - c.frame_start for c in default] == [1, 1] + [2] * 7 + [1]  # the engine's schedule
    stream = engine.open_stream(TEXT, voice=voice, chunk_schedule=(1, 3, 5), sampling=sampling)
    chunks = list(stream.chunks(timeout=60))
    assert [c.frame_end - c.frame_start for c in chunks] == [1, 3, 5, 5, 3]
    # the streaming codec is exact: chunk boundaries change no sample
    np.testing.assert_allclose(np.concatenate([c.pcm for c in chunks]), np.concatenate([c.pcm for c in default]), atol=1e-5)
    assert all(len(c.pcm) == 1920 * (c.frame_end - c.frame_start) for c in chunks)
    assert len(chunks[0].pcm16) == 2 * 1920
    for c in chunks:
        t = c.timings
        assert t.submitted <= t.prefill_done <= t.first_frame <= t.ready
    assert stream.result.finish_reason == "max_frames" and stream.result.frames == 17
    assert stream.result.first_audio_latency == pytest.approx(chunks[0].timings.ready - chunks[0].timings.submitted)
    assert stream.result.real_time_factor > 0
    engine.close()


async def test_async_iteration_and_cancel_within_a_frame(engine: Engine, voice: Voice) -> None:
    stream = engine.open_stream(TEXT, voice=voice, sampling=SamplingParams(max_frames=2000, ignore_eos=True, seed=2))
    received = 0
    async for chunk in stream:
        received += 1
        if chunk.frame_end >= 3:
            break
    frames_at_cancel = engine.stats().frames_generated
    latency = await stream.acancel()
    frames_after = engine.stats().frames_generated
    await asyncio.sleep(0.2)
    assert engine.stats().frames_generated == frames_after, "the engine kept stepping a cancelled stream"
    assert frames_after - frames_at_cancel <= 2  # the frame in flight at most
    assert latency < 5.0
    assert stream.result.finish_reason == "cancelled" and stream.result.cancel_latency is not None
    assert [c async for c in stream] == []
    with pytest.raises(StreamCancelledError):
        stream.push_text("more")
    # the slot is free again: a new stream runs
    pcm, result = engine.synthesize_blocking("Next turn.", voice=voice, sampling=SamplingParams(max_frames=3))
    assert result.frames >= 1 and len(pcm) == result.frames * 1920


async def test_synthesize_async_generator(engine: Engine, voice: Voice) -> None:
    chunks = [c async for c in engine.synthesize(TEXT, voice=voice, sampling=SamplingParams(max_frames=6, ignore_eos=True))]
    assert sum(c.frame_end - c.frame_start for c in chunks) == 6


def test_admission_control(engine: Engine, voice: Voice) -> None:
    sampling = SamplingParams(max_frames=2000, ignore_eos=True)
    streams = [engine.open_stream(TEXT, voice=voice, sampling=sampling) for _ in range(5)]  # 3 running + 2 queued
    try:
        with pytest.raises(EngineOverloadedError):
            engine.open_stream(TEXT, voice=voice, sampling=sampling)
        assert engine.stats().active_streams <= 3
    finally:
        for s in streams:
            s.cancel()
    deadline = time.time() + 10
    while engine.stats().queued_streams + engine.stats().active_streams and time.time() < deadline:
        time.sleep(0.02)
    assert engine.stats().active_streams == 0


def test_bad_requests_raise_typed_errors(engine: Engine, voice: Voice) -> None:
    for text in ["", "   \n\t "]:
        with pytest.raises(InvalidTextError):
            engine.open_stream(text, voice=voice)
    with pytest.raises(InvalidTextError):
        engine.open_stream("x" * (engine.max_text_chars + 1), voice=voice)
    with pytest.raises(UnsupportedLanguageError):
        engine.open_stream(TEXT, voice=voice, language="klingon")
    with pytest.raises(UnknownVoiceError):
        engine.open_stream(TEXT)  # Base without a cloned voice
    with pytest.raises(UnsupportedFeatureError):
        engine.open_stream(TEXT, voice=Voice(prompt=voice.prompt, instruct="whisper"))
    for bad in (SamplingParams(top_k=0), SamplingParams(top_k=10_000), SamplingParams(temperature=0.0),
                SamplingParams(subtalker_top_p=0.0), SamplingParams(max_frames=0)):
        with pytest.raises(InvalidRequestError):
            engine.open_stream(TEXT, voice=voice, sampling=bad)
    stream = engine.open_stream(voice=voice, sampling=SamplingParams(max_frames=5))
    with pytest.raises(InvalidTextError):
        stream.push_text("y" * (engine.max_text_chars + 1))
    # a stream closed with no text at all ends with an error, and the engine carries on
    empty = engine.open_stream(voice=voice)
    empty.close_input()
    with pytest.raises(InvalidTextError):
        list(empty.chunks(timeout=30))
    _, result = engine.synthesize_blocking("Still fine.", voice=voice, sampling=SamplingParams(max_frames=2))
    assert result.frames >= 1


def test_reference_audio_validation(engine: Engine) -> None:
    wav, sr = reference_audio()
    bad = {
        "unreadable": b"this is not audio",
        "too short": (wav[: sr // 4], sr),
        "silent": (np.zeros_like(wav), sr),
        "nan": (np.where(np.arange(len(wav)) == 100, np.nan, wav).astype(np.float32), sr),
    }
    for reason, audio in bad.items():
        with pytest.raises(InvalidReferenceAudioError):
            engine.create_voice(audio, REF_TEXT)
        assert reason
    with pytest.raises(InvalidRequestError):
        engine.create_voice((wav, sr), None)  # ICL needs the transcript
    # stereo WAV bytes at another sample rate are mixed down and resampled, not refused
    buffer = io.BytesIO()
    stereo = np.stack([wav, 0.5 * wav], axis=1)[::3]
    sf.write(buffer, stereo, sr // 3, format="WAV")
    prompt = engine.create_voice(buffer.getvalue(), REF_TEXT)
    assert prompt.ref_codes is not None and prompt.ref_codes.shape[1] == 16


def test_voice_prompt_cache_and_persistence(engine: Engine, tmp_path) -> None:
    first = engine.create_voice(reference_audio(), REF_TEXT)
    again = engine.create_voice(reference_audio(), REF_TEXT)
    assert again is first  # encoded once, keyed by content
    other = engine.create_voice(reference_audio(), "Another transcript.")
    assert other.voice_id != first.voice_id
    Engine.save_voice(first, tmp_path / "voice.safetensors")
    loaded = Engine.load_voice(tmp_path / "voice.safetensors")
    assert loaded.voice_id == first.voice_id and loaded.ref_text == REF_TEXT
    sampling = SamplingParams.greedy(max_frames=8)
    _, a = engine.synthesize_blocking(TEXT, voice=Voice(prompt=first), sampling=sampling)
    _, b = engine.synthesize_blocking(TEXT, voice=Voice(prompt=loaded), sampling=sampling)
    assert a.codes == b.codes
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(InvalidRequestError):
        Engine.load_voice(tmp_path / "junk.safetensors")


def test_icl_stream_with_streamed_text(engine: Engine, voice: Voice) -> None:
    """In-context cloning needs reference-aligned text before the first frame; streaming still matches."""
    sampling = SamplingParams.greedy(max_frames=20)
    for layout in (TextLayout.INTERLEAVED, TextLayout.PREFILL):
        _, whole = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling, text_layout=layout)
        stream = engine.open_stream(voice=voice, sampling=sampling, text_layout=layout)
        for i in range(0, len(TEXT), 4):
            stream.push_text(TEXT[i : i + 4])
        stream.close_input()
        list(stream.chunks(timeout=60))
        assert stream.result.codes == whole.codes


def test_a_full_kv_cache_ends_the_stream_cleanly() -> None:
    engine = engine_for("synthetic:tiny", max_streams=2, max_seq_len=96)
    try:
        voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
        pcm, result = engine.synthesize_blocking(TEXT, voice=voice, sampling=SamplingParams(max_frames=500, ignore_eos=True))
        assert result.finish_reason == "max_frames" and 0 < result.frames < 96
        assert len(pcm) == result.frames * 1920
        with pytest.raises(InvalidTextError):  # a prompt that cannot fit fails its stream, not the engine
            list(engine.open_stream("word " * 200, voice=voice, text_layout=TextLayout.PREFILL).chunks(timeout=30))
        _, again = engine.synthesize_blocking("Short.", voice=voice, sampling=SamplingParams(max_frames=3))
        assert again.frames == 3
    finally:
        engine.close()


def test_slot_set_up_copies_no_host_scalar(engine: Engine) -> None:
    """Setting up a slot writes no Python number into a tensor (`t[i] = x`): on a GPU that is a copy from
    pageable memory, which waits for every step queued on the stream (it once held the loaded engine's thread
    for 16% of its time). Uploads and fills are asynchronous."""
    from dataclasses import asdict

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar_copies: list[tuple[int, ...]] = []

    class Spy(TorchDispatchMode):  # thread-local: sees this thread's ops only, not the engine thread's
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default and args[1].dim() == 0:
                scalar_copies.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    runner, slot = engine.core.runner, engine.max_streams - 1  # idle between tests: no stream holds this slot
    with Spy():
        runner.reset_slot(slot, asdict(SamplingParams(seed=5, top_k=7, temperature=0.7)))
        runner.append_text(slot, 0, [11, 12, 13])
        engine.core.audio.codec.reset(slot)
    assert scalar_copies == []
    assert runner.top_k[slot] == 7 and runner.seed[slot] == 5 and runner.text_len[slot] == 3
    assert abs(float(runner.temperature[slot]) - 0.7) < 1e-6 and runner.pos[slot] == 0
    expected = runner.text_track_embeddings(torch.tensor([11, 12, 13]))
    assert torch.equal(runner.text_embeds[slot, :3], expected)  # projected on arrival, looked up by frames


def test_a_failed_decode_fails_the_streams_in_flight_and_the_engine_goes_on(engine: Engine, voice: Voice) -> None:
    """An error inside a step (here the codec's) ends the streams in flight with it; later streams are served."""
    codec = engine.core.audio.codec
    original = codec.decode

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("the codec broke")

    codec.decode = broken
    try:
        stream = engine.open_stream(TEXT, voice=voice, sampling=SamplingParams(max_frames=4, ignore_eos=True))
        with pytest.raises(RuntimeError, match="the codec broke"):
            list(stream.chunks(timeout=60))
    finally:
        codec.decode = original
    assert stream.result.finish_reason == "error"
    pcm, result = engine.synthesize_blocking("Next turn.", voice=voice, sampling=SamplingParams(max_frames=3, ignore_eos=True))
    assert result.frames == 3 and len(pcm) == 3 * 1920
