"""Shared helpers for engine tests: official models and engines over the tiny synthetic checkpoints."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from qwen3tts_agent import Engine, Voice
from qwen3tts_agent.models.loading import load_official_model
from qwen3tts_agent.reference import demo_reference

REF_TEXT = "This is what my voice sounds like."
TEXT = "Hello there, how can I help you today? The weather is lovely."


@functools.cache
def official_model(spec: str) -> object:
    """The official `Qwen3TTSModel` for a synthetic spec, loaded once per test session."""
    return load_official_model(spec, device="cpu", dtype=torch.float32, progress=False)


def engine_for(spec: str, **kwargs: object) -> Engine:
    """An engine sharing the official model's weights (close it after use), on the PyTorch path unless a
    `backend` is given: the parity tests hold it to the official codes, which the int8 CPU backend (the
    default on a CPU) does not reproduce."""
    kwargs.setdefault("backend", "torch")
    return Engine(official_model(spec), keep_codes=True, **kwargs)  # type: ignore[arg-type]


def reference_audio(seconds: float = 3.0) -> tuple[np.ndarray, int]:
    wav, sr = demo_reference()
    return wav[: int(seconds * sr)], sr


def xvector_voice(engine: Engine) -> Voice:
    """An x-vector clone of the demo reference: the voice with no reference span to wait for."""
    return Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))


@contextlib.contextmanager
def recorded_decode_codes(official: object) -> Iterator[list[torch.Tensor]]:
    """Record the codes the official pipeline hands to its speech tokenizer (a pass-through spy)."""
    tokenizer = official.model.speech_tokenizer  # type: ignore[attr-defined]
    original = tokenizer.decode
    seen: list[torch.Tensor] = []

    def spy(encoded: list[dict[str, torch.Tensor]]) -> object:
        seen.extend(item["audio_codes"].detach().cpu() for item in encoded)
        return original(encoded)

    tokenizer.decode = spy
    try:
        yield seen
    finally:
        tokenizer.decode = original


def on_batched_launch(engine: Engine, record: Callable[[Any, float], None]) -> None:
    """Call `record(rows, now)` for every batched step the engine's core queues (a pass-through spy on the step
    launcher's `_queue_step`; steps of the first-frame slots alone are not recorded)."""
    launcher = engine.core.launcher
    queue_step = launcher._queue_step

    def spy(rows, now, *, batched=True):  # type: ignore[no-untyped-def]
        if batched:
            record(rows, now)
        queue_step(rows, now, batched=batched)

    launcher._queue_step = spy  # type: ignore[method-assign]
