"""Later chunks held for batched codec calls (`Engine(codec_hold_s=...)`) change no audio and lose no chunk.

Streams start one after another, so their chunks are cut at different steps and wait in the codec queue for
each other (`engine/scheduler/codec_queue.py`). Each stream's codes and audio must be those it gets alone, its chunks
must arrive in order and whole, and the engine's codec counters must account for every chunk.
"""

from __future__ import annotations

import numpy as np

from qwen3tts_agent import SamplingParams, Voice
from tests.engine_helpers import REF_TEXT, engine_for, reference_audio

TEXTS = ["Hello there, how can I help you today?", "The train leaves at nine.", "Good morning to you."]
SAMPLING = SamplingParams(seed=7, max_frames=30, ignore_eos=True)


def test_held_chunks_decode_the_same_audio_in_order() -> None:
    engine = engine_for("synthetic:tiny", max_streams=4, codec_hold_s=0.5)
    try:
        voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
        alone = [engine.synthesize_blocking(text, voice=voice, sampling=SAMPLING) for text in TEXTS]
        before = engine.stats()
        streams, frames = [], []
        for text in TEXTS:  # each opens once the one before it has its first audio: out of step
            stream = engine.open_stream(text, voice=voice, sampling=SAMPLING)
            streams.append((stream, stream.chunks(timeout=120)))
            frames.append([next(streams[-1][1])])
        for (_, chunks), got in zip(streams, frames, strict=True):
            got.extend(chunks)
        after = engine.stats()
    finally:
        engine.close()
    for i, ((pcm_alone, result_alone), (stream, _), chunks) in enumerate(zip(alone, streams, frames, strict=True)):
        assert [c.frame_start for c in chunks] == [0, *(c.frame_end for c in chunks[:-1])], f"stream {i}: out of order"
        assert chunks[-1].frame_end == SAMPLING.max_frames and chunks[-1].is_last
        assert stream.result.codes == result_alone.codes, f"stream {i}: codes differ"
        np.testing.assert_allclose(np.concatenate([c.pcm for c in chunks]), pcm_alone, atol=1e-5,
                                   err_msg=f"stream {i}: audio differs when its chunks were held")
    delivered = sum(len(chunks) for chunks in frames)
    assert after.codec_chunks - before.codec_chunks == delivered
    assert 0 < after.codec_decodes - before.codec_decodes <= delivered
    assert after.early_codec_decodes == before.early_codec_decodes == 0  # the early lane is a GPU's
