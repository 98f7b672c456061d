"""The CPU's codec thread (`engine/audio.py`): on a CPU the codec's calls, slot set-ups included, run on a
thread of their own beside the frame steps, and give the codes and audio of the codec on the loop's thread
(`overlap_codec=False`); a decode that fails there fails its stream and the engine goes on."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from qwen3tts_agent import SamplingParams, Voice
from qwen3tts_agent.engine.audio import cpu_thread_split
from tests.engine_helpers import REF_TEXT, TEXT, engine_for, reference_audio

CODEC_THREAD = "qwen3tts-codec"
TEXTS = [TEXT, "A second stream, beside the first.", "And a third one, after them."]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The engine splits PyTorch's thread count between the frame steps and the codec: two, as on CI."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_cores_are_split_between_the_frame_steps_and_the_codec() -> None:
    assert cpu_thread_split(1) == (1, 0)  # one core cannot run both at once
    assert cpu_thread_split(2) == (1, 1)
    assert cpu_thread_split(16) == (12, 4)


def test_decodes_run_on_the_codec_thread_and_match_the_codec_on_the_loops_thread(
    two_threads: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: dict[bool, set[str]] = {True: set(), False: set()}
    runs: dict[bool, list[tuple[list[list[int]], np.ndarray]]] = {}
    for overlap in (True, False):
        engine = engine_for("synthetic:tiny", max_streams=2, overlap_codec=overlap)
        codec = engine.core.audio.codec
        for name in ("decode", "reset", "prime", "restore"):
            original = getattr(codec, name)

            def spy(*args, _original=original, _seen=calls[overlap], **kwargs):
                _seen.add(threading.current_thread().name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(codec, name, spy)
        try:
            # an in-context clone: its first stream primes the codec state with the reference codes, the
            # later ones restore it; two streams share the steps
            voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
            sampling = SamplingParams.greedy(max_frames=14, ignore_eos=True)
            streams = [engine.open_stream(text, voice=voice, sampling=sampling) for text in TEXTS[:2]]
            audio = [np.concatenate([chunk.pcm for chunk in stream.chunks(timeout=120)]) for stream in streams]
            third, result = engine.synthesize_blocking(TEXTS[2], voice=voice, sampling=sampling)
            runs[overlap] = [*((s.result.codes, a) for s, a in zip(streams, audio, strict=True)), (result.codes, third)]
        finally:
            engine.close()
    assert calls[True] and all(name.startswith(CODEC_THREAD) for name in calls[True])
    assert not any(name.startswith(CODEC_THREAD) for name in calls[False])
    for (codes, pcm), (codes_loop, pcm_loop) in zip(runs[True], runs[False], strict=True):
        assert len(codes) == 14 and codes == codes_loop
        np.testing.assert_allclose(pcm, pcm_loop, atol=1e-5)  # PyTorch's CPU kernels on 1 or 2 threads


def test_a_decode_that_fails_on_the_codec_thread_fails_its_stream_and_the_engine_goes_on(
    two_threads: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engine_for("synthetic:tiny", max_streams=2)
    try:
        codec = engine.core.audio.codec
        original = codec.decode
        failures = iter([True])

        def decode(*args, **kwargs):
            if next(failures, False):
                raise RuntimeError("a decode broke")
            return original(*args, **kwargs)

        monkeypatch.setattr(codec, "decode", decode)
        voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
        sampling = SamplingParams(max_frames=4, ignore_eos=True)
        stream = engine.open_stream(TEXT, voice=voice, sampling=sampling)
        with pytest.raises(RuntimeError, match="a decode broke"):
            list(stream.chunks(timeout=60))
        pcm, result = engine.synthesize_blocking("Next turn.", voice=voice, sampling=sampling)
        assert result.frames == 4 and len(pcm) == 4 * 1920
        assert engine.stats().restarts == 0
    finally:
        engine.close()
