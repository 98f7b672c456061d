"""Cached voice prefixes: a stream whose voice's prompt head is copied from the prefix store makes the same
codes as one that prefills its whole prompt (engine/runner/prefixes.py, ModelRunner.copy_prefix)."""

from __future__ import annotations

import time

import pytest
import torch

from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.engine.runner.prefixes import PrefixCache
from qwen3tts_agent.kernels import common
from tests.engine_helpers import REF_TEXT, TEXT, engine_for, reference_audio

FRAMES = 12
TEXTS = [TEXT, "A second sentence, with other words.", "And a third one streams in."]


def _voices(engine: Engine) -> dict[str, Voice]:
    if engine.model_type == "custom_voice":
        return {"speaker": Voice(speaker=engine.speakers[0]), "other speaker": Voice(speaker=engine.speakers[1])}
    if engine.model_type == "voice_design":
        return {"instruct": Voice(instruct="A warm, low voice speaking slowly.")}
    return {
        "x-vector": Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True)),
        "icl": Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT)),
    }


def _codes(engine: Engine, voice: Voice, text: str, seed: int, streamed: bool) -> list[list[int]]:
    sampling = SamplingParams(seed=seed, max_frames=FRAMES)
    if not streamed:
        return engine.synthesize_blocking(text, voice=voice, language="english", sampling=sampling)[1].codes
    stream = engine.open_stream(voice=voice, language="english", sampling=sampling)
    time.sleep(0.2)  # the head (or its copy) runs before any text is there; the body follows on its own
    for word in text.split(" "):
        stream.push_text(word + " ")
    stream.close_input()
    list(stream.chunks(timeout=120))
    return stream.result.codes


@pytest.mark.parametrize("spec", ["synthetic:tiny", "synthetic:tiny-customvoice", "synthetic:tiny-voicedesign"])
def test_cached_prefix_gives_the_codes_of_a_full_prefill(spec: str) -> None:
    results: dict[bool, list[list[list[int]]]] = {}
    hits = 0
    for cached in (False, True):
        engine = engine_for(spec, prefix_cache=cached)
        try:
            voices = _voices(engine)
            results[cached] = [
                _codes(engine, voice, text, seed=i, streamed=i == len(TEXTS) - 1)
                for voice in voices.values()
                for i, text in enumerate(TEXTS)
            ]
            if cached:
                assert engine.core.prefills.prefixes is not None
                hits = engine.core.prefills.prefixes.hits
            else:
                assert engine.core.prefills.prefixes is None
        finally:
            engine.close()
    assert hits >= len(voices) * (len(TEXTS) - 1)  # every stream after a voice's first copied its prefix
    for uncached, cached in zip(results[False], results[True], strict=True):
        assert len(cached) == FRAMES
        assert cached == uncached


def test_copy_prefix_puts_the_stored_positions_in_the_slot() -> None:
    engine = engine_for("synthetic:tiny-customvoice", prefix_cache=True, max_streams=2)
    try:
        runner = engine.core.runner
        engine.synthesize_blocking("Hello.", voice=Voice(speaker=engine.speakers[0]), sampling=SamplingParams(max_frames=2))
        [(key, entry)] = list(engine.core.prefills.prefixes._held.items())
        # the first stream (slot 0) stored its head; copying it to slot 1 reproduces it position by position
        head = runner.kv_cache[:, :, 0, :, : entry.length].clone()
        runner.kv_cache[:, :, 1].zero_()
        runner.copy_prefix(entry.index, 1, entry.length)
        assert torch.equal(runner.kv_cache[:, :, 1, :, : entry.length], head)
        assert not runner.kv_cache[:, :, 1, :, entry.length :].any()
        with pytest.raises(ValueError, match="does not fit"):
            runner.copy_prefix(entry.index, 1, runner.prefix_len + 1)
    finally:
        engine.close()


def test_prefix_cache_reuses_the_least_recently_used_entry() -> None:
    cache = PrefixCache(entries=2, max_len=8)
    a, b = cache.claim("a", 5), cache.claim("b", 6)
    assert (a.index, b.index) == (0, 1) and cache.claim("a", 5) is None  # held already
    assert cache.get("a") == a  # "b" is now the least recently used
    c = cache.claim("c", 3)
    assert c.index == b.index and cache.get("b") is None and cache.get("c") == c
    assert cache.claim("long", 9) is None and cache.claim("empty", 0) is None
    assert (cache.hits, cache.misses) == (2, 1)


def test_own_counters_apply_to_this_thread_inside_the_block_only() -> None:
    """The staged prompt pieces' kernels count arrivals in a set of their own: they run on the prompt lane,
    beside the frame steps, whose kernels use the device's set."""
    import threading

    device = torch.device("cpu")
    shared, own = common.counters(device), common.new_counters(device)
    seen_elsewhere = []
    with common.own_counters(own):
        assert common.counters(device) is own
        thread = threading.Thread(target=lambda: seen_elsewhere.append(common.counters(device)))
        thread.start()
        thread.join()
    assert seen_elsewhere[0] is shared and common.counters(device) is shared
