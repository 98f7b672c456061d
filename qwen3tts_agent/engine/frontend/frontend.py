"""The engine's public side: validation, tokenization, streams. Shared by the in-process `Engine` and the
`EngineClient` of an engine-core process.

Everything a caller can get wrong is checked here, synchronously, with typed errors, before a request
reaches the core; text is tokenized here, in the caller's thread, at O(delta) per piece
(`IncrementalText`), so the core's step loop never spends time on it. What differs between the two
front ends is only how messages reach the core and how outputs come back (`_send`, `_deliver_output`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ... import errors
from ...errors import (
    EngineNotReadyError,
    EngineOverloadedError,
    InvalidRequestError,
    InvalidTextError,
    Qwen3TTSAgentError,
    UnknownVoiceError,
    UnsupportedFeatureError,
    UnsupportedLanguageError,
)
from ..messages import (
    AbortRequest,
    AddRequest,
    AppendText,
    ChunkOutput,
    CloseInput,
    CoreRequest,
    ErrorInfo,
    FinishOutput,
    PromptSpec,
)
from ..types import AudioChunk, FinishReason, SamplingParams, StreamResult, TextLayout, Voice, VoicePrompt
from .stream import SpeechStream
from .text import IncrementalText, TextTokenizer, validate_text
from .voices import AudioInput, load_voice, save_voice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the front end knows of the model and the core's limits (sent by an engine-core process)."""

    model_type: str  # "base" | "custom_voice" | "voice_design"
    model_size: str  # "0b6" | "1b7"
    language_ids: dict[str, int]
    speaker_ids: dict[str, int]
    speaker_dialects: dict[str, str | bool]
    sample_rate: int
    max_streams: int
    max_seq_len: int
    top_k_cap: int
    chunk_schedule: tuple[int, ...]
    device: str = "cpu"
    adapt_chunks: bool = False  # a chunk may be cut short when its listener would otherwise run out (`cut_chunk`)
    kernel_paths: dict[str, str] = field(default_factory=dict)

    @property
    def languages(self) -> list[str]:
        return ["auto"] + sorted(k for k in self.language_ids if "dialect" not in k)

    @property
    def speakers(self) -> list[str]:
        return sorted(self.speaker_ids) if self.model_type == "custom_voice" else []

    @property
    def supports_instruct(self) -> bool:
        return self.model_type == "voice_design" or (self.model_type == "custom_voice" and self.model_size != "0b6")

    @classmethod
    def from_official(cls, model: object, **limits: object) -> ModelInfo:
        cfg = model.config  # type: ignore[attr-defined]
        talker = cfg.talker_config
        return cls(
            model_type=cfg.tts_model_type,
            model_size=cfg.tts_model_size,
            language_ids={k.lower(): int(v) for k, v in talker.codec_language_id.items()},
            speaker_ids={k.lower(): int(v) for k, v in (talker.spk_id or {}).items()},
            speaker_dialects={k.lower(): v for k, v in (talker.spk_is_dialect or {}).items()},
            **limits,  # type: ignore[arg-type]
        )


@dataclass
class EngineStats:
    active_streams: int
    queued_streams: int
    max_streams: int
    frames_generated: int
    streams_started: int
    cancels: int
    errors: int
    steps: int  # batched frame steps launched (frames_generated / steps is the mean batch)
    first_frame_steps: int = 0  # ... of them, steps of new streams' early frames alone (`Engine(first_frame_step_load=)`)
    steps_deferred: int = 0  # turns in which a step waited for urgent audio decodes (deadline-aware pacing)
    clock_releases: int = 0  # steps that went before the step clock's tick for a stream's deadline (`step_period_s`)
    first_audio_holds: int = 0  # steps that waited for a new stream's first frame and chunk (`step_period_s`, `first_audio_alone`)
    speculations: int = 0  # first frames run on a tentative text token (`Engine(speculative_first_frame=...)`)
    speculation_misses: int = 0  # ... whose token turned out different, so the stream started over
    codec_decodes: int = 0  # batched codec calls (codec_chunks / codec_decodes is the mean batch)
    codec_chunks: int = 0  # audio chunks those calls decoded
    early_codec_decodes: int = 0  # ... of the calls, those on a GPU's early lane (new streams' first two chunks)
    timed_steps: int = 0  # batched steps whose device time events measured (a GPU's), and of them ...
    step_device_seconds: float = 0.0  # ... that device time, summed
    step_flight_seconds: float = 0.0  # ... their time from queued to read back: beyond the device's, a step waited
    # behind other lanes' work or for the core's loop to read it
    step_gap_seconds: float = 0.0  # time no batched step was queued while rows could step (the step clock's and
    # the holds' waits, and the loop's turn before it queued the next)
    step_gap_by_hold: dict[str, float] = field(default_factory=dict)  # ... by what held the step back
    # (`engine/core/launcher.py` GAP_HOLDS), "read" from a step's read back to the first look after it, "loop"
    # for the loop's other work before it looked again
    steps_overlapped: int = 0  # batched steps queued while another was in flight (no gap before them)
    late_chunks: int = 0  # chunks that left the core after a client playing from the first chunk needed them
    underrun_seconds: float = 0.0  # how late, summed
    # ... late_chunks by the chunk's place in its stream: "1" (the second chunk), "2", "3", "4+"
    late_by_index: dict[str, int] = field(default_factory=dict)
    # ... and by why: "frames" (its frames were made after it was due: the step pace) or "decode" (made in time,
    # decoded or delivered late: the codec lane)
    late_by_cause: dict[str, int] = field(default_factory=dict)
    overloaded: bool = False  # new streams are refused now: slow steps, the late-chunk limit or a slot wait
    refusal_reason: str | None = None  # ... by which rule: "slow_steps", "late_chunks" or "slot_wait"
    # streams taken on while chunks leave late (max_streams: no limit, as always without `shed_when_behind`;
    # 0: no core to ask)
    stream_limit: int = 0
    stream_limit_cuts: int = 0  # times late chunks lowered it (0 without `shed_when_behind`)
    stream_limit_seconds: float = 0.0  # ... and how long, all cuts together, it stayed below `max_streams`
    healthy: bool = True  # the core is running (False while it restarts or after it died)
    restarts: int = 0  # cores started again after one died: in this process, and (`serve`) core processes before it
    device_memory_bytes: int = 0  # allocated on the core's GPU (0 on the CPU): flat over a long run
    core_rss_bytes: int = 0  # resident memory of the process that runs the core
    kernel_paths: dict[str, str] = field(default_factory=dict)  # which decoder stacks run as Triton kernels
    # cumulative seconds the core's loop spent per part of its turn: where a step's time goes
    loop_seconds: dict[str, float] = field(default_factory=dict)


class EngineFrontend:
    """Validation, tokenization and the stream registry; subclasses connect it to a core."""

    def __init__(self, info: ModelInfo, tokenizer: TextTokenizer, *, max_queue: int, max_text_chars: int) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.model_type = info.model_type
        self.model_size = info.model_size
        self.sample_rate = info.sample_rate
        self.languages = info.languages
        self.speakers = info.speakers
        self.max_streams = info.max_streams
        self.max_queue = max_queue
        self.max_text_chars = max_text_chars
        self.chunk_schedule = info.chunk_schedule
        self.adapt_chunks = info.adapt_chunks
        self.top_k_cap = info.top_k_cap
        self._streams: dict[str, SpeechStream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._id_prefix = "s"
        self._closed = False
        self._accepting = True  # False while the core is down: checked with the registry's lock held

    # ----------------------------------------------------------------- what a subclass provides
    def _send(self, message: CoreRequest) -> None:
        raise NotImplementedError

    def _check_available(self) -> None:
        """Raise EngineClosedError / EngineNotReadyError / EngineOverloadedError if no stream can start now."""
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        """Whether the core is running and takes new streams."""
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def create_voice(
        self, ref_audio: AudioInput, ref_text: str | None = None, *, x_vector_only: bool = False,
        max_ref_seconds: float | None = None,
    ) -> VoicePrompt:
        """Encode a reference voice once (cached by content). Blocking; thread-safe."""
        raise NotImplementedError

    async def acreate_voice(
        self, ref_audio: AudioInput, ref_text: str | None = None, *, x_vector_only: bool = False,
        max_ref_seconds: float | None = None,
    ) -> VoicePrompt:
        return await asyncio.to_thread(
            self.create_voice, ref_audio, ref_text, x_vector_only=x_vector_only, max_ref_seconds=max_ref_seconds
        )

    def warmup(self, progress: bool = True) -> None:
        """Make the first request as fast as the rest (capture graphs, run one utterance)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    save_voice = staticmethod(save_voice)
    load_voice = staticmethod(load_voice)

    # ----------------------------------------------------------------- validation
    @property
    def supports_instruct(self) -> bool:
        return self.info.supports_instruct

    def validate_sampling(self, sampling: SamplingParams) -> None:
        """Raise InvalidRequestError unless this engine can decode with `sampling` (top_k within its cap, ...)."""
        cap = self.top_k_cap
        if sampling.max_frames is not None and sampling.max_frames < 1:
            raise InvalidRequestError("max_frames must be at least 1")
        for name, on in (("", sampling.do_sample), ("subtalker_", sampling.subtalker_do_sample)):
            top_k, top_p, temperature = (getattr(sampling, name + k) for k in ("top_k", "top_p", "temperature"))
            if on and not 1 <= top_k <= cap:
                raise InvalidRequestError(f"{name}top_k must be in 1..{cap} (this engine's top_k_cap)")
            if on and not (0.0 < top_p <= 1.0 and temperature > 0.0):
                raise InvalidRequestError(f"{name}top_p must be in (0, 1] and {name}temperature > 0")
        if sampling.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty must be > 0")

    def prompt_spec(self, voice: Voice, language: str, layout: TextLayout) -> PromptSpec:
        """Check a voice and language against the model and resolve them to prompt tokens."""
        info = self.info
        lang = (language or "auto").lower()
        if lang != "auto" and lang not in info.language_ids:
            raise UnsupportedLanguageError(f"unknown language {language!r}; supported: {', '.join(self.languages)}")
        language_id = None if lang == "auto" else info.language_ids[lang]
        speaker_id = None
        if info.model_type == "base":
            if voice.prompt is None:
                raise UnknownVoiceError("a Base model speaks with a cloned voice: pass Voice(prompt=engine.create_voice(...))")
            if voice.speaker or voice.instruct:
                raise UnsupportedFeatureError("Base models take neither named speakers nor instructions")
        elif info.model_type == "custom_voice":
            if voice.prompt is not None:
                raise UnsupportedFeatureError("voice cloning needs a Base model")
            name = (voice.speaker or "").lower()
            if name not in info.speaker_ids:
                raise UnknownVoiceError(f"unknown speaker {voice.speaker!r}; supported: {', '.join(self.speakers)}")
            speaker_id = info.speaker_ids[name]
            dialect = info.speaker_dialects.get(name, False)
            if lang in ("chinese", "auto") and dialect:
                language_id = info.language_ids[str(dialect)]
            if voice.instruct and not self.supports_instruct:
                raise UnsupportedFeatureError("instructions need the 1.7B CustomVoice model")
        elif voice.prompt is not None or voice.speaker:
            raise UnsupportedFeatureError("VoiceDesign models take an instruction, not a speaker or cloned voice")
        if voice.instruct:
            validate_text(voice.instruct, what="instruct")
        instruct_ids = tuple(self.tokenizer.instruct_ids(voice.instruct)) if voice.instruct else ()
        clone = voice.prompt
        ref_ids: tuple[int, ...] = ()
        if clone is not None and clone.ref_codes is not None:
            ref_ids = tuple(self.tokenizer.ref_ids(validate_text(clone.ref_text or "", what="ref_text")))
        return PromptSpec(
            language_id, speaker_id, clone, instruct_ids, ref_ids, TextLayout(layout), icl_early_start=voice.icl_early_start
        )

    # ----------------------------------------------------------------- streams
    def open_stream(
        self,
        text: str | None = None,
        *,
        voice: Voice | None = None,
        language: str = "auto",
        sampling: SamplingParams | None = None,
        chunk_schedule: Sequence[int] | None = None,
        text_layout: TextLayout | str = TextLayout.INTERLEAVED,
    ) -> SpeechStream:
        """Start an utterance. With `text` the input is complete; otherwise push deltas and close_input().

        Validation happens here, synchronously, with typed errors.
        """
        self._check_available()
        sampling = sampling or SamplingParams()
        self.validate_sampling(sampling)
        schedule = tuple(chunk_schedule or self.chunk_schedule)
        if not schedule or any(not isinstance(n, int) or n < 1 for n in schedule):
            raise InvalidRequestError(f"chunk schedule must be positive frame counts, got {schedule}")
        if text is not None:
            validate_text(text)
            if not text.strip():
                raise InvalidTextError("text is empty")
            if len(text) > self.max_text_chars:
                raise InvalidTextError(f"text longer than {self.max_text_chars} characters")
        spec = self.prompt_spec(voice or Voice(), language, TextLayout(text_layout))
        if sampling.seed is None:
            sampling = replace(sampling, seed=int.from_bytes(np.random.bytes(6), "little"))
        request_id = f"{self._id_prefix}{next(self._ids)}"
        stream = SpeechStream(self, request_id, IncrementalText(self.tokenizer), self.max_text_chars)
        with self._lock:
            if not self._accepting:
                raise EngineNotReadyError("the engine is not running (starting or restarting); retry shortly")
            if len(self._streams) >= self.max_streams + self.max_queue:
                raise EngineOverloadedError(
                    f"busy: {len(self._streams)} streams open (limit {self.max_streams} running + {self.max_queue} queued)",
                    reason="streams",
                )
            self._streams[request_id] = stream
        self._send(AddRequest(request_id, spec, sampling, schedule, stream.submitted))
        if text is not None:
            stream._push_whole(text)
        return stream

    async def synthesize(self, text: str, **kwargs: object) -> AsyncIterator[AudioChunk]:
        """Whole text in, audio chunks out as they are ready. Cancels the stream if the consumer stops early."""
        stream = self.open_stream(text, **kwargs)  # type: ignore[arg-type]
        try:
            async for chunk in stream:
                yield chunk
        finally:
            if not stream.done:
                stream.cancel()

    def synthesize_blocking(self, text: str, **kwargs: object) -> tuple[np.ndarray, StreamResult]:
        """Whole utterance as one float32 array (the simple case of streaming)."""
        stream = self.open_stream(text, **kwargs)  # type: ignore[arg-type]
        pcm = [chunk.pcm for chunk in stream.chunks()]
        return (np.concatenate(pcm) if pcm else np.zeros(0, np.float32)), stream.result

    def open_stream_count(self) -> int:
        with self._lock:
            return len(self._streams)

    # ----------------------------------------------------------------- the streams' side (any thread)
    def _stream_text(self, stream: SpeechStream, ids: list[int], tentative: list[int]) -> None:
        if ids or tentative:
            self._send(AppendText(stream.id, tuple(ids), tuple(tentative)))

    def _stream_close(self, stream: SpeechStream, ids: list[int]) -> None:
        self._send(CloseInput(stream.id, tuple(ids)))

    def _stream_cancel(self, stream: SpeechStream) -> None:
        self._send(AbortRequest(stream.id))

    def _stream_fail(self, stream: SpeechStream, error: Qwen3TTSAgentError) -> None:
        """End a stream here with `error` (e.g. its text turned out empty) and drop its request in the core."""
        with self._lock:
            self._streams.pop(stream.id, None)
        self._send(AbortRequest(stream.id))
        stream.result.wall_seconds = time.perf_counter() - stream.submitted
        stream._finish(error)

    # ----------------------------------------------------------------- outputs (the core's side)
    def chunk(self, output: ChunkOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream._deliver(AudioChunk(output.pcm, output.frame_start, output.frame_end, output.is_last, output.timings))

    def finish(self, output: FinishOutput) -> None:
        with self._lock:
            stream = self._streams.pop(output.request_id, None)
        if stream is None:
            return
        result = stream.result
        result.finish_reason = output.reason
        result.frames = max(result.frames, output.frames)  # also those a cancel left undelivered
        result.codes = output.codes
        result.queue_wait = output.queue_wait
        result.text_wait = output.text_wait
        result.wall_seconds = time.perf_counter() - stream.submitted
        stream._finish(None if output.error is None else error_from_info(output.error, output.exception))

    def _fail_open_streams(self, error: Qwen3TTSAgentError) -> None:
        """The core is gone: end every stream it held (their outputs will never come)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.result.finish_reason = FinishReason.ERROR
            stream.result.wall_seconds = time.perf_counter() - stream.submitted
            stream._finish(error)


def error_from_info(info: ErrorInfo, exception: BaseException | None = None) -> BaseException:
    """The exception a stream raises for a failure the core reported: the original one in-process, else the
    package's error class of that name, else a generic engine error carrying the type name."""
    if exception is not None:
        return exception
    kind = getattr(errors, info.kind, None)
    if isinstance(kind, type) and issubclass(kind, Qwen3TTSAgentError):
        return kind(info.message)
    return errors.EngineError(f"{info.kind}: {info.message}")
