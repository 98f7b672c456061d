"""Built-in synthetic reference recordings, for when a Base model must clone a voice and none was given.

One place below the command line, the server and the engine's warm-up, so none of them imports another.
They are signals, not speech: a bare request works out of the box, but a real voice needs a real reference.
"""

from __future__ import annotations

import numpy as np

from .engine.types import SAMPLE_RATE


def demo_reference() -> tuple[np.ndarray, int]:
    """A 3 s voiced signal (harmonics with a gliding pitch and a syllable envelope): the default cloned voice."""
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    f0 = 140 + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 2.5 * t) ** 2)
    return (0.25 * wave / np.abs(wave).max()).astype(np.float32), SAMPLE_RATE


def warmup_reference() -> tuple[np.ndarray, int]:
    """A 2 s modulated tone: the cheapest reference the voice encoders accept, for warm-ups and tests."""
    t = np.arange(2 * SAMPLE_RATE) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * 150 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32), SAMPLE_RATE
