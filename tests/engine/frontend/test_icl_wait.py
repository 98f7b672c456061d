"""The wait of a stream's first frame for text (`StreamResult.text_wait`), and the two ways to shorten an
in-context clone's: a trimmed reference (exactly the official voice of that shorter reference) and the
opt-in early start (not the official prompt)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from qwen3tts_agent import Engine, SamplingParams, TextLayout, Voice
from qwen3tts_agent.engine.frontend.voices import MIN_REFERENCE_SECONDS, TRIM_SEARCH_S, trim_reference
from qwen3tts_agent.errors import InvalidRequestError
from tests.engine_helpers import (
    REF_TEXT,
    TEXT,
    engine_for,
    official_model,
    recorded_decode_codes,
    reference_audio,
)

FRAMES = 10
SR = 24_000


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = engine_for("synthetic:tiny", max_streams=2)
    yield engine
    engine.close()


def _looped_reference(seconds: float) -> tuple[np.ndarray, int]:
    wav, sr = reference_audio()
    return np.resize(wav, int(seconds * sr)), sr


def _push_words(stream, words: list[str]) -> None:  # noqa: ANN001
    for word in words:
        stream.push_text(word)


def test_text_wait_is_the_time_the_first_frame_waited_for_text(engine: Engine) -> None:
    voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
    sampling = SamplingParams(seed=1, max_frames=4)
    _, whole = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
    assert whole.text_wait < 0.1  # the text came with the request

    stream = engine.open_stream(voice=voice, sampling=sampling)
    time.sleep(0.4)
    stream.push_text("Hello")  # one word: not final until the next character arrives
    time.sleep(0.3)
    stream.push_text(", there ")  # "Hello" and "," are final: the first frame has its two tokens
    stream.close_input()
    list(stream.chunks(timeout=60))
    assert 0.65 <= stream.result.text_wait < 1.5
    assert stream.result.frames == 4


def test_in_context_clone_waits_for_text_covering_the_reference_unless_early_start(engine: Engine) -> None:
    prompt = engine.create_voice(reference_audio(), REF_TEXT)
    words = TEXT.split(" ")
    results = {}
    for early in (False, True):
        stream = engine.open_stream(
            voice=Voice(prompt=prompt, icl_early_start=early), sampling=SamplingParams(seed=3, max_frames=FRAMES)
        )
        _push_words(stream, [w + " " for w in words[:3]])  # a few tokens: far fewer than the reference's frames
        if early:
            first = next(stream.chunks(timeout=60))  # speaks before the rest of the text exists
            assert first.frame_start == 0
        else:
            with pytest.raises(TimeoutError):
                next(stream.chunks(timeout=1.5))  # the official prompt needs the text to cover the reference span
        _push_words(stream, [w + " " for w in words[3:]])
        stream.close_input()
        list(stream.chunks(timeout=60))
        results[early] = stream.result
    assert results[True].frames == results[False].frames == FRAMES
    assert results[True].text_wait < 0.3 <= results[False].text_wait


def test_early_start_lays_the_known_text_over_the_reference_span(engine: Engine) -> None:
    prompt = engine.create_voice(reference_audio(), REF_TEXT)
    builder = engine.core.prompts
    spec = engine.prompt_spec(Voice(prompt=prompt, icl_early_start=True), "english", TextLayout.INTERLEAVED)
    pad = engine.model.config.tts_pad_token_id
    span = 1 + prompt.ref_codes.shape[0]
    ref = list(spec.ref_text_ids)
    body = builder.body(spec, [11, 12, 13], closed=False)
    # the known text but its last token, then padding, over the span; the last token opens the text track
    expected = builder._text(ref + [11, 12] + [pad] * (span - len(ref) - 2)) + builder._reference_track(spec)
    assert torch.equal(body.embeds, expected) and body.trailing_ids == [13]
    # enough text to cover the span, or a closed text: the official layout, as without early start
    official = engine.prompt_spec(Voice(prompt=prompt), "english", TextLayout.INTERLEAVED)
    for ids, closed in (([7] * (span - len(ref) + 3), False), ([11, 12, 13], True)):
        ours, theirs = builder.body(spec, ids, closed), builder.body(official, ids, closed)
        assert torch.equal(ours.embeds, theirs.embeds) and ours.trailing_ids == theirs.trailing_ids


def test_early_start_keeps_the_official_prompt_for_a_whole_text(engine: Engine) -> None:
    prompt = engine.create_voice(reference_audio(), REF_TEXT)
    sampling = SamplingParams(seed=5, max_frames=FRAMES)
    _, official = engine.synthesize_blocking(TEXT, voice=Voice(prompt=prompt), sampling=sampling)
    _, early = engine.synthesize_blocking(TEXT, voice=Voice(prompt=prompt, icl_early_start=True), sampling=sampling)
    assert early.codes == official.codes


def test_trim_reference_cuts_whole_sentences_in_the_pause() -> None:
    """Three 'sentences' of tone (1.4 s, 1.4 s, 2.8 s: as long as their letters say) with 0.3 s pauses."""
    lengths, pause = (1.4, 1.4, 2.8), 0.3
    parts = []
    for i, seconds in enumerate(lengths):
        t = np.arange(int(seconds * SR)) / SR
        parts.append(0.3 * np.sin(2 * np.pi * 180 * t))
        if i < len(lengths) - 1:
            parts.append(np.zeros(int(pause * SR)))
    wav = np.concatenate(parts).astype(np.float32)
    first, second = "Some text goes here okay.", "Then more text will come!"
    text = f"{first} {second} Last part runs much more than both were, then ends."
    kept, kept_text = trim_reference(wav, SR, text, max_seconds=3.5)
    assert kept_text == f"{first} {second}"
    gap_start = 1.4 + pause + 1.4
    assert gap_start <= len(kept) / SR <= gap_start + pause, len(kept) / SR
    assert np.array_equal(kept, wav[: len(kept)])
    # one sentence fits in 2 s (cut in the first pause); none in 1.2 s, so the first is kept, longer than asked
    kept, kept_text = trim_reference(wav, SR, text, max_seconds=2.0)
    assert kept_text == first and 1.4 <= len(kept) / SR <= 1.4 + pause
    assert trim_reference(wav, SR, text, max_seconds=1.2)[1] == first
    # short enough already, or nowhere to cut: unchanged
    assert trim_reference(wav, SR, text, max_seconds=10.0)[1] == text
    assert trim_reference(wav, SR, "one long clause without any stop", max_seconds=2.0)[1] == "one long clause without any stop"
    # no sentence end fits: a clause end does
    clauses = "Some text goes here okay, then more text will come, last part runs much more than both were then ends."
    assert trim_reference(wav, SR, clauses, max_seconds=3.5)[1] == "Some text goes here okay, then more text will come,"
    assert MIN_REFERENCE_SECONDS + TRIM_SEARCH_S < 1.4  # the cuts above were not held back by the minimum


def test_trimmed_voice_is_the_official_voice_of_the_trimmed_reference() -> None:
    official = official_model("synthetic:tiny")
    wav, sr = _looped_reference(7.0)
    text = "This is my voice on a quiet day. I read a few lines aloud. Then a longer third sentence ends it."
    trimmed_wav, trimmed_text = trim_reference(wav, sr, text, max_seconds=4.5)
    assert trimmed_text == "This is my voice on a quiet day. I read a few lines aloud."
    items = official.create_voice_clone_prompt(ref_audio=(trimmed_wav, sr), ref_text=trimmed_text)
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1)
    with recorded_decode_codes(official) as seen:
        official.generate_voice_clone(TEXT, language="english", voice_clone_prompt=items, non_streaming_mode=False, **greedy)
    official_codes = seen[0][items[0].ref_code.shape[0]:]
    engine = engine_for("synthetic:tiny")
    try:
        full = engine.create_voice((wav, sr), text)
        voice = engine.create_voice((wav, sr), text, max_ref_seconds=4.5)
        assert voice.ref_text == trimmed_text and voice.voice_id != full.voice_id
        assert np.array_equal(voice.ref_codes, items[0].ref_code.cpu().numpy())
        assert voice.ref_codes.shape[0] < full.ref_codes.shape[0]
        _, result = engine.synthesize_blocking(
            TEXT, voice=Voice(prompt=voice), language="english", sampling=SamplingParams.greedy(max_frames=FRAMES)
        )
        with pytest.raises(InvalidRequestError, match="max_ref_seconds"):
            engine.create_voice((wav, sr), text, max_ref_seconds=0.5)
    finally:
        engine.close()
    assert torch.equal(torch.tensor(result.codes), official_codes.cpu())
