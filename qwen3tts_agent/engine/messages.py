"""Typed messages between the engine's public side and its core: requests in, audio and endings out.

The same messages cross a thread boundary (the in-process engine) or a process boundary (the engine-core
process, `engine/process/supervisor.py`), so the core never sees a `SpeechStream`, a socket or an event loop: it
knows a request by its id and answers with outputs addressed to that id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .types import ChunkTimings, FinishReason, SamplingParams, TextLayout, VoicePrompt

# --------------------------------------------------------------------------- requests (to the core)


@dataclass(frozen=True)
class PromptSpec:
    """What a request's prompt depends on, apart from the target text."""

    language_id: int | None  # codec language token; None for "auto"
    speaker_id: int | None = None  # CustomVoice named speaker token
    clone: VoicePrompt | None = None  # Base: x-vector (and reference codes in ICL mode)
    instruct_ids: tuple[int, ...] = ()
    ref_text_ids: tuple[int, ...] = ()  # ICL reference transcript tokens
    layout: TextLayout = TextLayout.INTERLEAVED
    icl_early_start: bool = False  # `Voice.icl_early_start`: not the official prompt (see `PromptBuilder.body`)

    @property
    def icl(self) -> bool:
        return self.clone is not None and self.clone.ref_codes is not None


@dataclass(frozen=True)
class AddRequest:
    """Start an utterance. Its text arrives as token ids in `AppendText`/`CloseInput` (tokenized by the caller)."""

    request_id: str
    spec: PromptSpec
    sampling: SamplingParams
    chunk_schedule: tuple[int, ...]
    submitted: float  # time.perf_counter() at the caller (CLOCK_MONOTONIC: comparable across processes)


@dataclass(frozen=True)
class AppendText:
    """Text-track tokens that are final (no later text can change them), and the tokens after them as the
    text stands now (`tentative`: more text may change them; sent while the first frame may need them)."""

    request_id: str
    token_ids: tuple[int, ...]
    tentative: tuple[int, ...] = ()


@dataclass(frozen=True)
class CloseInput:
    """No more text: the remaining tokens of the whole text's tokenization, then the text's end."""

    request_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class AbortRequest:
    """Stop now (cancel, client gone): no further output except the request's `FinishOutput`."""

    request_id: str


CoreRequest = AddRequest | AppendText | CloseInput | AbortRequest


# --------------------------------------------------------------------------- outputs (from the core)


@dataclass(frozen=True)
class ChunkOutput:
    """A piece of a request's audio: 24 kHz mono float32 PCM for codec frames [frame_start, frame_end)."""

    request_id: str
    pcm: np.ndarray
    frame_start: int
    frame_end: int
    is_last: bool
    timings: ChunkTimings


@dataclass(frozen=True)
class ErrorInfo:
    """A failure in a form that crosses a process boundary: the error class's name and its message.

    `kind` names one of `qwen3tts_agent.errors`' classes (or another exception's type name, which the
    caller maps to a generic engine error).
    """

    kind: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        return cls(type(exc).__name__, str(exc) or type(exc).__name__)


@dataclass(frozen=True)
class FinishOutput:
    """A request ended. Always the last output of a request (also after an abort)."""

    request_id: str
    reason: FinishReason
    error: ErrorInfo | None = None
    frames: int = 0
    queue_wait: float = 0.0
    text_wait: float = 0.0  # seconds its first frame waited for text (e.g. an in-context clone's prompt)
    codes: list[list[int]] = field(default_factory=list)  # [frames][16], when the core keeps codes
    # the original exception, in-process only (a process boundary carries `error`): callers see what was raised
    exception: BaseException | None = field(default=None, compare=False, repr=False)


class OutputSink(Protocol):
    """Where the core's outputs go; called on the core's thread, so implementations must not block."""

    def chunk(self, output: ChunkOutput) -> None: ...

    def finish(self, output: FinishOutput) -> None: ...
