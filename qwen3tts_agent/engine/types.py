"""Public value types of the engine: what a request asks for and what a stream yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1_920  # one 12.5 Hz codec frame = 80 ms at 24 kHz


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters; defaults are the official `qwen-tts` ones.

    `top_k` must lie in 1..the engine's `top_k_cap` (64 by default) when sampling. `max_frames` caps the
    audio at max_frames * 80 ms (finish reason `max_frames`). The runaway guard also bounds it by the
    text's length (`requests.runaway_frame_limit`, finish reason `length`), since real models can miss
    their end token on short inputs. `ignore_eos` forbids the end token so that every request yields
    exactly `max_frames` frames (fixed-length generation for benchmarks); it turns the guard off.
    """

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    seed: int | None = None
    max_frames: int | None = None
    ignore_eos: bool = False

    @classmethod
    def greedy(cls, **overrides: Any) -> SamplingParams:
        """Deterministic decoding for both the talker and the code predictor (used for parity)."""
        return cls(**{"do_sample": False, "subtalker_do_sample": False, **overrides})


# Final target tokens the interleaved layout's first frame needs: the body's first token, and the second on
# the text track (what the frontend sends tentative text for until then: `Scheduler.speculate`).
FIRST_FRAME_TEXT_TOKENS = 2


class TextLayout(str, Enum):
    """How the target text meets the codec track (the official `non_streaming_mode`).

    INTERLEAVED feeds one text token per audio frame (official non_streaming_mode=False) and is the only
    layout that can start speaking before all text has arrived. PREFILL puts the whole text into the
    prompt (official non_streaming_mode=True, the official default for CustomVoice and VoiceDesign).
    """

    INTERLEAVED = "interleaved"
    PREFILL = "prefill"


@dataclass(frozen=True)
class Voice:
    """Who speaks and how. Which fields apply depends on the model type.

    - Base: `prompt` (a cloned voice from `Engine.create_voice`), required.
    - CustomVoice: `speaker` (a named speaker), required; `instruct` on 1.7B only.
    - VoiceDesign: `instruct` (a description of the voice), may be empty.

    `icl_early_start` (in-context clones only; no effect on other voices) lets a stream whose text arrives
    in pieces start speaking on its first text token, instead of waiting until the text covers the
    reference audio's span as the official prompt needs (one token per reference frame, less the reference
    transcript's tokens: tens of LLM tokens for a few seconds of reference). The span is then laid out with the text known at that
    moment and padding, and the rest of the text follows it one token per frame. That is NOT the official
    prompt: what it does to the speech has not been judged (no real weights were available), so it is off
    by default. A whole text given at once (`open_stream(text)`) always gets the official prompt.
    """

    speaker: str | None = None
    instruct: str | None = None
    prompt: VoicePrompt | None = None
    icl_early_start: bool = False


@dataclass(frozen=True)
class VoicePrompt:
    """A reference voice encoded once (speaker embedding, reference codes and text), reusable across requests.

    `voice_id` is a content hash of the reference audio, text and mode, so the same reference gives the same id.
    Its arrays are NumPy's (float32 and int64), so processes that only pass voices along (the server's API
    workers) never load torch; the engine copies them to its device.
    """

    voice_id: str
    speaker_embedding: np.ndarray  # [hidden], float32
    ref_codes: np.ndarray | None  # [frames, 16], int64 (ICL mode) or None (x-vector only)
    ref_text: str | None
    x_vector_only: bool


@dataclass(frozen=True)
class ChunkTimings:
    """Monotonic clock readings (time.perf_counter seconds) along one chunk's way."""

    submitted: float
    prefill_done: float
    first_frame: float
    ready: float
    admitted: float = 0.0  # when the engine gave the request a slot (0: not told)
    arrived: float = 0.0  # when the engine's loop took the request in (0: not told)


@dataclass(frozen=True)
class AudioChunk:
    """A piece of a stream's audio: 24 kHz mono float32 PCM for codec frames [frame_start, frame_end)."""

    pcm: np.ndarray
    frame_start: int
    frame_end: int
    is_last: bool
    timings: ChunkTimings
    sample_rate: int = SAMPLE_RATE

    @property
    def pcm16(self) -> bytes:
        """Little-endian int16 PCM bytes (the wire format of most voice stacks)."""
        return (np.clip(self.pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.sample_rate


class FinishReason(str, Enum):
    """Why a stream ended."""

    EOS = "eos"  # the model's end-of-speech token
    MAX_FRAMES = "max_frames"  # the caller's max_frames, or the KV cache is full
    LENGTH = "length"  # the runaway guard: far more audio than the text's length explains
    CANCELLED = "cancelled"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass
class StreamResult:
    """Summary of a finished stream, filled in by the engine."""

    frames: int = 0  # frames the engine made for the stream (a cancelled stream may not have received all)
    audio_seconds: float = 0.0  # audio delivered
    first_audio_latency: float | None = None  # submit -> first chunk ready, seconds
    wall_seconds: float = 0.0
    queue_wait: float = 0.0  # submit -> slot assigned, seconds
    # How long the first frame waited for text, seconds: from the stream holding a slot to the core having
    # the text its first frame needs (0 when that text was there first; until the end if it never came)
    text_wait: float = 0.0
    cancel_latency: float | None = None  # cancel() -> engine dropped the request, seconds
    finish_reason: FinishReason | None = None
    codes: list[list[int]] = field(default_factory=list)  # [frames][16], kept for parity tests

    @property
    def real_time_factor(self) -> float:
        """Audio seconds per wall second (>1 is faster than real time)."""
        return self.audio_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


DEFAULT_CHUNK_SCHEDULE: tuple[int, ...] = (1, 2, 4, 8)
