"""Greedy parity: the engine's codes and audio equal the official `qwen-tts` generation on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen3tts_agent import SamplingParams, TextLayout, Voice
from tests.engine_helpers import (
    REF_TEXT,
    TEXT,
    engine_for,
    official_model,
    recorded_decode_codes,
    reference_audio,
)

FRAMES = 24
GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1)


def _ours(engine, voice: Voice, layout: TextLayout, language: str = "english") -> tuple[np.ndarray, torch.Tensor]:
    stream = engine.open_stream(
        TEXT, voice=voice, language=language, text_layout=layout,
        sampling=SamplingParams.greedy(max_frames=FRAMES), chunk_schedule=(1, 2, 4, 8),
    )
    chunks = list(stream.chunks(timeout=120))
    assert [c.frame_start for c in chunks] == [0] + [c.frame_end for c in chunks[:-1]]
    assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
    return np.concatenate([c.pcm for c in chunks]), torch.tensor(stream.result.codes)


def _assert_same_audio(ours: np.ndarray, official: np.ndarray) -> None:
    # the official voice-clone cut is int(ref / total * samples): it may land one sample early
    assert 0 <= len(official) - len(ours) <= 1, (len(ours), len(official))
    np.testing.assert_allclose(ours, official[len(official) - len(ours):], atol=1e-4, rtol=0)
    assert np.abs(ours).max() > 1e-3, "audio is silent"


@pytest.mark.parametrize("layout", [TextLayout.INTERLEAVED, TextLayout.PREFILL])
@pytest.mark.parametrize("icl", [True, False], ids=["icl", "xvector"])
def test_voice_clone_matches_official(layout: TextLayout, icl: bool) -> None:
    official = official_model("synthetic:tiny")
    ref = reference_audio()
    items = official.create_voice_clone_prompt(ref_audio=ref, ref_text=REF_TEXT if icl else None, x_vector_only_mode=not icl)
    with recorded_decode_codes(official) as seen:
        wavs, sr = official.generate_voice_clone(
            TEXT, language="english", voice_clone_prompt=items, non_streaming_mode=layout is TextLayout.PREFILL, **GREEDY
        )
    official_codes = seen[0][items[0].ref_code.shape[0]:] if icl else seen[0]
    engine = engine_for("synthetic:tiny")
    try:
        voice = engine.create_voice(ref, REF_TEXT if icl else None, x_vector_only=not icl)
        assert np.array_equal(voice.speaker_embedding, items[0].ref_spk_embedding.float().cpu().numpy())
        pcm, codes = _ours(engine, Voice(prompt=voice), layout)
    finally:
        engine.close()
    assert sr == 24000
    assert torch.equal(codes, official_codes.cpu()), "codes differ from the official generation"
    _assert_same_audio(pcm, wavs[0])


@pytest.mark.parametrize("layout", [TextLayout.INTERLEAVED, TextLayout.PREFILL])
def test_custom_voice_matches_official(layout: TextLayout) -> None:
    official = official_model("synthetic:tiny-customvoice")
    speaker = sorted(official.get_supported_speakers())[0]
    with recorded_decode_codes(official) as seen:
        wavs, _ = official.generate_custom_voice(
            TEXT, speaker=speaker, language="english", non_streaming_mode=layout is TextLayout.PREFILL, **GREEDY
        )
    engine = engine_for("synthetic:tiny-customvoice")
    try:
        pcm, codes = _ours(engine, Voice(speaker=speaker), layout)
    finally:
        engine.close()
    assert torch.equal(codes, seen[0].cpu())
    _assert_same_audio(pcm, wavs[0])


@pytest.mark.parametrize("layout", [TextLayout.INTERLEAVED, TextLayout.PREFILL])
def test_voice_design_matches_official(layout: TextLayout) -> None:
    official = official_model("synthetic:tiny-voicedesign")
    instruct = "A warm, low voice speaking slowly."
    with recorded_decode_codes(official) as seen:
        wavs, _ = official.generate_voice_design(
            TEXT, instruct=instruct, language="auto", non_streaming_mode=layout is TextLayout.PREFILL, **GREEDY
        )
    engine = engine_for("synthetic:tiny-voicedesign")
    try:
        pcm, codes = _ours(engine, Voice(instruct=instruct), layout, language="auto")
    finally:
        engine.close()
    assert torch.equal(codes, seen[0].cpu())
    _assert_same_audio(pcm, wavs[0])


def test_batched_streams_match_single_streams() -> None:
    """Streams that share frames (continuous batching, joining at different times) decode as if alone."""
    engine = engine_for("synthetic:tiny", max_streams=4)
    sampling = SamplingParams(seed=7, max_frames=16)
    try:
        voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
        texts = [TEXT, "A second, shorter sentence.", "Third one joins late and speaks for a while."]
        alone = [engine.synthesize_blocking(text, voice=voice, sampling=sampling) for text in texts]
        first = engine.open_stream(texts[0], voice=voice, sampling=sampling)
        first_chunks = first.chunks(timeout=120)
        head = next(first_chunks)  # the first stream is already running when the others join
        others = [engine.open_stream(t, voice=voice, sampling=sampling) for t in texts[1:]]
        together = [np.concatenate([head.pcm] + [c.pcm for c in first_chunks])]
        together += [np.concatenate([c.pcm for c in s.chunks(timeout=120)]) for s in others]
        results = [first.result, *(s.result for s in others)]
    finally:
        engine.close()
    for (pcm_alone, result_alone), pcm, result in zip(alone, together, results, strict=True):
        assert result.codes == result_alone.codes
        np.testing.assert_allclose(pcm, pcm_alone, atol=1e-5)


def test_end_of_speech_matches_official() -> None:
    """With an EOS row that fires (synthetic checkpoints never end on their own), both stop on the same frame."""
    official = official_model("synthetic:tiny-customvoice")
    speaker = sorted(official.get_supported_speakers())[0]
    head = official.model.talker.codec_head.weight
    eos = official.model.config.talker_config.codec_eos_token_id
    saved = head.data[eos].clone()
    engine = engine_for("synthetic:tiny-customvoice")
    try:
        _, codes = _ours(engine, Voice(speaker=speaker), TextLayout.INTERLEAVED)
        head.data[eos] = 2 * head.data[int(codes[8, 0])]  # EOS now outscores the code chosen around frame 8
        with recorded_decode_codes(official) as seen:
            official.generate_custom_voice(TEXT, speaker=speaker, language="english", non_streaming_mode=False, **GREEDY)
        stream = engine.open_stream(TEXT, voice=Voice(speaker=speaker), language="english",
                                    sampling=SamplingParams.greedy(max_frames=FRAMES))
        chunks = list(stream.chunks(timeout=60))
    finally:
        head.data[eos] = saved
        engine.close()
    assert stream.result.finish_reason == "eos" and stream.result.frames < FRAMES
    assert torch.equal(torch.tensor(stream.result.codes), seen[0].cpu())
    assert chunks[-1].is_last and chunks[-1].frame_end == stream.result.frames
