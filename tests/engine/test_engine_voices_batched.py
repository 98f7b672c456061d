"""Streams with different voices batched together decode exactly as each one alone (greedy, CPU).

Continuous batching puts streams of different voices in one frame step: cloned voices with prompts of
different lengths (in-context and x-vector-only), named speakers in different languages, and designed voices
with different instructions. Each stream's codes must be those it gets alone, and its audio the same.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.reference import demo_reference, warmup_reference
from tests.engine_helpers import REF_TEXT, engine_for, reference_audio

TEXTS = [
    "Hello there, how can I help you today?",
    "The train leaves at nine.",
    "Good morning! The weather is lovely, isn't it?",
]
GREEDY = SamplingParams.greedy(max_frames=12)


def voices_for(engine: Engine) -> list[tuple[Voice, str]]:
    """Three different voices of the engine's model type, each with a language."""
    if engine.model_type == "base":
        return [
            (Voice(prompt=engine.create_voice(demo_reference(), REF_TEXT)), "english"),
            (Voice(prompt=engine.create_voice(warmup_reference(), x_vector_only=True)), "auto"),
            (Voice(prompt=engine.create_voice(reference_audio(2.0), "A shorter reference.")), "english"),
        ]
    if engine.model_type == "custom_voice":
        return [(Voice(speaker=s), lang) for s, lang in zip(engine.speakers[:3], ["english", "chinese", "auto"], strict=True)]
    return [
        (Voice(instruct="A warm, low voice that speaks slowly."), "english"),
        (Voice(instruct="Bright and quick."), "english"),
        (Voice(instruct=None), "auto"),
    ]


@pytest.mark.parametrize("spec", ["synthetic:tiny", "synthetic:tiny-customvoice", "synthetic:tiny-voicedesign"])
def test_streams_with_different_voices_batched_equal_each_alone(spec: str) -> None:
    engine = engine_for(spec, max_streams=4)
    try:
        voices = voices_for(engine)
        alone = [
            engine.synthesize_blocking(text, voice=voice, language=language, sampling=GREEDY)
            for text, (voice, language) in zip(TEXTS, voices, strict=True)
        ]
        streams = [
            engine.open_stream(text, voice=voice, language=language, sampling=GREEDY)
            for text, (voice, language) in zip(TEXTS, voices, strict=True)
        ]
        most_active = 0
        together = []
        for stream in streams:
            pcm = []
            for chunk in stream.chunks(timeout=120):
                most_active = max(most_active, engine.stats().active_streams)
                pcm.append(chunk.pcm)
            together.append(np.concatenate(pcm))
    finally:
        engine.close()
    assert most_active >= 2, "the streams were never batched together"
    for i, ((pcm_alone, result_alone), pcm, stream) in enumerate(zip(alone, together, streams, strict=True)):
        assert len(result_alone.codes) > 0
        assert stream.result.codes == result_alone.codes, f"voice {i}: codes differ when batched"
        np.testing.assert_allclose(pcm, pcm_alone, atol=1e-5, err_msg=f"voice {i}: audio differs when batched")
    assert len({tuple(map(tuple, r.codes)) for _, r in alone}) == len(alone), "the voices are not different"
