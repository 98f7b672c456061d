"""The engine: one thread owns the model and steps every live stream together, frame by frame.

Callers talk to it only through commands (open, text, close, cancel) that the thread applies between
frames, and through `SpeechStream`s that it fills with audio chunks. So a cancel takes effect at the next
frame boundary, a new stream joins the running batch at the next frame, and no asyncio loop ever waits on
the model.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..backends import create_codec, create_runner, resolve_backend
from ..errors import (
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    InvalidTextError,
    Qwen3TTSAgentError,
    UnknownVoiceError,
    UnsupportedFeatureError,
    UnsupportedLanguageError,
)
from .cuda_graphs import GraphedCodecDecode, GraphedFrameStep, GraphedPrefill, power_of_two_buckets
from .host import upload
from .prompt import PromptBody, PromptBuilder, PromptSpec
from .runner import PrefillRow
from .sampling import DEFAULT_TOP_K_CAP
from .stream import SpeechStream
from .text import IncrementalText, TextTokenizer
from .types import (
    DEFAULT_CHUNK_SCHEDULE,
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    AudioChunk,
    ChunkTimings,
    SamplingParams,
    StreamResult,
    TextLayout,
    Voice,
    VoicePrompt,
)
from .voices import AudioInput, VoiceEncoder, load_voice, save_voice

logger = logging.getLogger(__name__)

# Prompts prefilled together in one batched forward: a batch costs the running streams about one frame.
MAX_PREFILL_ROWS = 16
# Primed codec states kept per cloned voice (a few MB each), so a voice's reference codes are decoded once.
CODEC_STATE_CACHE = 64
# First chunks decoded together on the first-chunk lane (more in one frame take the regular queue).
FIRST_CHUNK_ROWS = 16


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
    # cumulative seconds the engine thread spent per part of its loop (LOOP_PHASES): where a step's time goes
    loop_seconds: dict[str, float] = field(default_factory=dict)


# The engine loop's parts. "gpu_wait" (reading a step's results) is inside "collect" and "codec_wait"
# (reading decoded audio) inside "deliver"; "collect" also starts the due decodes.
LOOP_PHASES = ("admit_and_prefill", "launch", "collect", "gpu_wait", "deliver", "codec_wait")


@dataclass
class _Request:
    """Engine-thread state of one stream."""

    stream: SpeechStream
    spec: PromptSpec
    sampling: SamplingParams
    schedule: tuple[int, ...]
    text: IncrementalText
    text_ids: list[int] = field(default_factory=list)  # final target tokens so far
    closed: bool = False
    slot: int | None = None
    head: torch.Tensor | None = None  # prompt head embeddings not yet prefilled
    body_done: bool = False
    consumed: int = 0  # target tokens already placed in the prompt body or the text track
    track_len: int = 0  # text-track tokens handed to the runner
    eos_fed: bool = False
    position: int = 0  # talker cache length, mirrored on the host to size attention without a sync
    frames: int = 0  # frames received
    frames_launched: int = 0  # frames queued on the device (may run one step ahead)
    chunk_index: int = 0
    pending: list[np.ndarray] = field(default_factory=list)  # codes [16] not yet decoded
    pending_start: int = 0
    codec_ready: torch.cuda.Event | None = None  # the slot's codec set-up, for the first-chunk lane to wait on
    codes: list[list[int]] = field(default_factory=list)
    prefill_done: float = 0.0
    first_frame: float = 0.0
    finish_reason: str = ""

    def next_chunk_frames(self) -> int:
        return self.schedule[min(self.chunk_index, len(self.schedule) - 1)]


@dataclass
class _HostBuffers:
    """Host copies of one step's outputs (pinned on CUDA so the copies run asynchronously)."""

    active: torch.Tensor
    out: torch.Tensor  # the runner's frame_out: 16 codes, then the EOS flag


@dataclass
class _Launched:
    rows: list[_Request]
    host: _HostBuffers
    event: torch.cuda.Event | None


@dataclass
class _Decoding:
    chunks: list[tuple[_Request, int, int, bool]]  # request, frame_start, frame_end, is_last
    pcm: torch.Tensor  # [len(chunks), samples] on the host
    event: torch.cuda.Event | None


class Engine:
    """Qwen3-TTS streaming engine. Create with `Engine.load`; see API in the package README."""

    def __init__(
        self,
        official: object,
        *,
        max_streams: int = 16,
        max_queue: int = 64,
        max_seq_len: int = 2048,
        max_text_chars: int = 4000,
        chunk_schedule: Sequence[int] = DEFAULT_CHUNK_SCHEDULE,
        keep_codes: bool = False,
        use_cuda_graphs: bool = True,
        overlap_codec: bool = True,
        fused_kernels: bool = True,
        top_k_cap: int = DEFAULT_TOP_K_CAP,
        backend: str = "auto",
    ) -> None:
        """`backend`: "auto" (the int8 CPU backend on a CPU, PyTorch on a GPU), "torch", "int8" or "fp32"
        (see `qwen3tts_agent.backends`)."""
        self._official = official
        model = official.model  # type: ignore[attr-defined]
        self.model = model
        cfg = model.config
        self.model_type: str = cfg.tts_model_type
        self.model_size: str = cfg.tts_model_size
        self.device = next(model.talker.parameters()).device
        self.dtype = next(model.talker.parameters()).dtype
        self.sample_rate = SAMPLE_RATE
        talker_cfg = cfg.talker_config
        self._language_ids: dict[str, int] = {k.lower(): int(v) for k, v in talker_cfg.codec_language_id.items()}
        self.languages = ["auto"] + sorted(k for k in self._language_ids if "dialect" not in k)
        self._speaker_ids: dict[str, int] = {k.lower(): int(v) for k, v in (talker_cfg.spk_id or {}).items()}
        self._speaker_dialect: dict[str, str | bool] = {
            k.lower(): v for k, v in (talker_cfg.spk_is_dialect or {}).items()
        }
        self.speakers = sorted(self._speaker_ids) if self.model_type == "custom_voice" else []
        self.max_streams = max_streams
        self.max_queue = max_queue
        self.max_text_chars = max_text_chars
        self.chunk_schedule = tuple(chunk_schedule)
        self._keep_codes = keep_codes

        self.tokenizer = TextTokenizer(official.processor.tokenizer)  # type: ignore[attr-defined]
        self._prompts = PromptBuilder(model, self.tokenizer.role_ids())
        self.backend = resolve_backend(backend, self.device)
        # one text-track token per frame at most, so a track never outgrows the cache
        self._runner = create_runner(
            model, self.backend, max_slots=max_streams, max_seq_len=max_seq_len, max_text_tokens=max_seq_len,
            top_k_cap=top_k_cap, fused_kernels=fused_kernels,
        )
        decoder = model.speech_tokenizer.model.decoder
        graphed = self.device.type == "cuda" and use_cuda_graphs
        # Audio decoding on its own CUDA stream runs beside the frame steps instead of between them; the
        # steps get the higher priority, so a large decode fills the GPU's gaps rather than delaying a frame.
        # First chunks take a lane of their own at the steps' priority: a stream's first audio never queues
        # behind the longer chunks of the streams already playing.
        self._step_stream: torch.cuda.Stream | None = None
        self._codec_stream: torch.cuda.Stream | None = None
        self._first_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda" and overlap_codec:
            _, highest = torch.cuda.Stream.priority_range()
            self._step_stream = torch.cuda.Stream(self.device, priority=highest)
            self._codec_stream = torch.cuda.Stream(self.device)
            if graphed:
                self._first_stream = torch.cuda.Stream(self.device, priority=highest)
        first_rows = min(FIRST_CHUNK_ROWS, max_streams) if self._first_stream is not None else 0
        # with graphs, the slots above max_streams are scratch rows that pad a call up to its graph's batch
        codec_slots = 2 * max_streams + first_rows if graphed else max_streams
        self._codec = create_codec(decoder, self.backend, max_streams=codec_slots)
        self._codec_states: collections.OrderedDict[str, list[torch.Tensor]] = collections.OrderedDict()
        self._first_lane_done: torch.cuda.Event | None = None  # the last first-chunk decode
        self._voices = VoiceEncoder(official) if self.model_type == "base" else None

        self._commands: queue.SimpleQueue[tuple[str, object, object]] = queue.SimpleQueue()
        self._waiting: list[_Request] = []  # admitted, no slot yet
        self._running: dict[int, _Request] = {}  # slot -> request
        self._by_stream: dict[int, _Request] = {}
        self._free_slots = list(range(max_streams))
        heapq.heapify(self._free_slots)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._open_count = 0  # streams opened and not finished (admission control)
        self._stats = dict(frames_generated=0, streams_started=0, cancels=0, errors=0, steps=0)
        self._loop_seconds = dict.fromkeys(LOOP_PHASES, 0.0)
        self._closed = False
        self._launched: _Launched | None = None
        self._decoding: collections.deque[_Decoding] = collections.deque()
        self._first_decoding: collections.deque[_Decoding] = collections.deque()  # the first-chunk lane's
        self._finishing: list[_Request] = []  # ended, last chunk still decoding
        pin = self.device.type == "cuda"
        self._host_buffers = [
            _HostBuffers(
                active=torch.zeros(max_streams, dtype=torch.bool, pin_memory=pin),
                out=torch.zeros(max_streams, self._runner.num_groups + 1, dtype=torch.int64, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._step_parity = 0
        self._active_slots: list[int] | None = None  # the slots `runner.active` holds, so unchanged ones aren't re-sent
        # on a GPU the host reads a step's results while the next step runs; on the CPU there is nothing to overlap
        self._pipelined = pin
        self._graphs: GraphedFrameStep | None = None
        self._prefill_graphs: GraphedPrefill | None = None
        self._codec_graphs: GraphedCodecDecode | None = None
        self._first_codec_graphs: GraphedCodecDecode | None = None
        if graphed:
            kv_buckets = power_of_two_buckets(max_seq_len, start=min(128, max_seq_len))
            self._graphs = GraphedFrameStep(self._runner, power_of_two_buckets(max_streams), kv_buckets)
            self._prefill_graphs = GraphedPrefill(
                self._runner,
                power_of_two_buckets(min(MAX_PREFILL_ROWS, max_streams)),
                [t for t in (32, 64, 128, 256) if t <= max_seq_len] or [max_seq_len],
                [k for k in kv_buckets if k <= 512] or kv_buckets[:1],
                max_tokens=2048,
            )
            self._codec_graphs = GraphedCodecDecode(
                self._codec, max_streams, power_of_two_buckets(max_streams), set(self.chunk_schedule) | {1, 2, 4, 8}
            )
            if first_rows:
                self._first_codec_graphs = GraphedCodecDecode(
                    self._codec, 2 * max_streams, power_of_two_buckets(first_rows), {self.chunk_schedule[0]}
                )
        self._thread = threading.Thread(target=self._loop, name="qwen3tts-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- construction
    @classmethod
    def load(
        cls,
        model: str = "Qwen/Qwen3-TTS-12Hz-0.6B-Base",
        *,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        cache_dir: Path | None = None,
        progress: bool = True,
        backend: str = "auto",
        **engine_kwargs: object,
    ) -> Engine:
        """Load a checkpoint (hub id, local folder or `synthetic:<size>[-<type>]`) and start the engine thread.

        Blocking: from async code use `await asyncio.to_thread(Engine.load, ...)`.
        """
        from ..models.loading import load_official_model

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        official = load_official_model(model, device=device, dtype=dtype, cache_dir=cache_dir, progress=progress)
        return cls(official, backend=backend, **engine_kwargs)  # type: ignore[arg-type]

    @property
    def supports_instruct(self) -> bool:
        return self.model_type == "voice_design" or (self.model_type == "custom_voice" and self.model_size != "0b6")

    # ----------------------------------------------------------------- voices
    def create_voice(self, ref_audio: AudioInput, ref_text: str | None = None, *, x_vector_only: bool = False) -> VoicePrompt:
        """Encode a reference voice once (cached by content). Blocking; thread-safe."""
        if self._voices is None:
            raise UnsupportedFeatureError(f"voice cloning needs a Base model; this one is {self.model_type}")
        return self._voices.create(ref_audio, ref_text, x_vector_only=x_vector_only)

    async def acreate_voice(self, ref_audio: AudioInput, ref_text: str | None = None, *, x_vector_only: bool = False) -> VoicePrompt:
        import asyncio

        return await asyncio.to_thread(self.create_voice, ref_audio, ref_text, x_vector_only=x_vector_only)

    save_voice = staticmethod(save_voice)
    load_voice = staticmethod(load_voice)

    # ----------------------------------------------------------------- streams
    def _prompt_spec(self, voice: Voice, language: str, layout: TextLayout) -> PromptSpec:
        lang = (language or "auto").lower()
        if lang != "auto" and lang not in self._language_ids:
            raise UnsupportedLanguageError(f"unknown language {language!r}; supported: {', '.join(self.languages)}")
        language_id = None if lang == "auto" else self._language_ids[lang]
        speaker_id = None
        if self.model_type == "base":
            if voice.prompt is None:
                raise UnknownVoiceError("a Base model speaks with a cloned voice: pass Voice(prompt=engine.create_voice(...))")
            if voice.speaker or voice.instruct:
                raise UnsupportedFeatureError("Base models take neither named speakers nor instructions")
        elif self.model_type == "custom_voice":
            if voice.prompt is not None:
                raise UnsupportedFeatureError("voice cloning needs a Base model")
            name = (voice.speaker or "").lower()
            if name not in self._speaker_ids:
                raise UnknownVoiceError(f"unknown speaker {voice.speaker!r}; supported: {', '.join(self.speakers)}")
            speaker_id = self._speaker_ids[name]
            dialect = self._speaker_dialect.get(name, False)
            if lang in ("chinese", "auto") and dialect:
                language_id = self._language_ids[str(dialect)]
            if voice.instruct and not self.supports_instruct:
                raise UnsupportedFeatureError("instructions need the 1.7B CustomVoice model")
        else:  # voice_design
            if voice.prompt is not None or voice.speaker:
                raise UnsupportedFeatureError("VoiceDesign models take an instruction, not a speaker or cloned voice")
        instruct_ids = tuple(self.tokenizer.instruct_ids(voice.instruct)) if voice.instruct else ()
        clone = voice.prompt
        ref_ids = tuple(self.tokenizer.ref_ids(clone.ref_text)) if clone is not None and clone.ref_codes is not None else ()
        return PromptSpec(language_id, speaker_id, clone, instruct_ids, ref_ids, TextLayout(layout))

    def validate_sampling(self, sampling: SamplingParams) -> None:
        """Raise InvalidRequestError unless this engine can decode with `sampling` (top_k within its cap, ...)."""
        cap = self._runner.top_k_cap
        if sampling.max_frames < 1:
            raise InvalidRequestError("max_frames must be at least 1")
        for name, on in (("", sampling.do_sample), ("subtalker_", sampling.subtalker_do_sample)):
            top_k, top_p, temperature = (getattr(sampling, name + k) for k in ("top_k", "top_p", "temperature"))
            if on and not 1 <= top_k <= cap:
                raise InvalidRequestError(f"{name}top_k must be in 1..{cap} (this engine's top_k_cap)")
            if on and not (0.0 < top_p <= 1.0 and temperature > 0.0):
                raise InvalidRequestError(f"{name}top_p must be in (0, 1] and {name}temperature > 0")
        if sampling.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty must be > 0")

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
        if self._closed:
            raise EngineClosedError("engine is closed")
        sampling = sampling or SamplingParams()
        self.validate_sampling(sampling)
        schedule = tuple(chunk_schedule or self.chunk_schedule)
        if not schedule or any(not isinstance(n, int) or n < 1 for n in schedule):
            raise InvalidRequestError(f"chunk schedule must be positive frame counts, got {schedule}")
        if text is not None:
            if not isinstance(text, str) or not text.strip():
                raise InvalidTextError("text is empty")
            if len(text) > self.max_text_chars:
                raise InvalidTextError(f"text longer than {self.max_text_chars} characters")
        spec = self._prompt_spec(voice or Voice(), language, TextLayout(text_layout))
        with self._lock:
            if self._open_count >= self.max_streams + self.max_queue:
                raise EngineOverloadedError(
                    f"busy: {self._open_count} streams open (limit {self.max_streams} running + {self.max_queue} queued)"
                )
            self._open_count += 1
        stream = SpeechStream(self, f"s{next(self._ids)}", self.max_text_chars)
        if sampling.seed is None:
            sampling = SamplingParams(**{**asdict(sampling), "seed": int.from_bytes(np.random.bytes(6), "little")})
        request = _Request(stream, spec, sampling, schedule, IncrementalText(self.tokenizer))
        self._command(("open", request, None))
        if text is not None:
            stream.push_text(text)
            stream.close_input()
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

    def stats(self) -> EngineStats:
        with self._lock:
            open_count = self._open_count
        running = len(self._running)
        return EngineStats(
            active_streams=running,
            queued_streams=max(0, open_count - running),
            max_streams=self.max_streams,
            loop_seconds=dict(self._loop_seconds),
            **self._stats,
        )

    def warmup(self, progress: bool = True) -> None:
        """Capture the CUDA graphs and run one short utterance end to end, so no caller pays first-call costs."""
        if self._graphs is not None and not self._graphs.captured:
            captured: Future[None] = Future()
            self._command(("capture", captured, progress))
            captured.result()
        voice = Voice()
        if self.model_type == "base":
            t = np.arange(SAMPLE_RATE * 2) / SAMPLE_RATE
            ref = (0.3 * np.sin(2 * np.pi * 150 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
            voice = Voice(prompt=self.create_voice((ref, SAMPLE_RATE), "Warm up."))
        elif self.model_type == "custom_voice":
            voice = Voice(speaker=self.speakers[0])
        frames = sum(self.chunk_schedule) + self.chunk_schedule[-1]  # every chunk size of the schedule once
        self.synthesize_blocking("Warm up.", voice=voice, sampling=SamplingParams(max_frames=frames, ignore_eos=True))

    def close(self) -> None:
        """Stop the engine thread; open streams end with EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._command(("shutdown", None, None))
        self._thread.join(timeout=30)

    # ----------------------------------------------------------------- engine thread
    def _command(self, command: tuple[str, object, object]) -> None:
        self._commands.put(command)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._step_stream is not None:
            torch.cuda.synchronize(self.device)  # the state tensors were made on the loading thread's stream
            torch.cuda.set_stream(self._step_stream)
        while True:
            idle = not self._runnable() and not self._waiting_for_slot() and self._launched is None
            try:
                if idle and (self._decoding or self._first_decoding):
                    command = self._commands.get(timeout=0.001)
                else:
                    command = self._commands.get(block=idle)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "shutdown":
                    self._shutdown()
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            try:
                started = time.perf_counter()
                self._admit()
                self._advance_prompts()
                started = self._timed("admit_and_prefill", started)
                previous, self._launched = self._launched, None
                # Normally the next step is queued before reading the previous one, so the GPU never idles.
                # When the codec shares the steps' stream, a stream still waiting for its first audio gets its
                # chunk decoded ahead of that step instead.
                urgent = (
                    self._codec_stream is None and previous is not None and any(r.frames == 0 for r in previous.rows)
                )
                if urgent:
                    self._collect(previous)
                    started = self._timed("collect", started)
                    self._deliver_decoded(wait=True)
                    started = self._timed("deliver", started)
                if self._runnable():
                    self._launched = self._launch_step()
                    started = self._timed("launch", started)
                if previous is not None and not urgent:
                    self._collect(previous)
                if self._launched is not None and not self._pipelined:
                    self._collect(self._launched)
                    self._launched = None
                started = self._timed("collect", started)
                self._deliver_decoded(wait=self._launched is None and not self._runnable())
                self._timed("deliver", started)
            except Exception as exc:  # noqa: BLE001 - the engine must outlive any one bad step
                logger.exception("engine step failed; failing the streams in it")
                self._launched = None
                self._decoding.clear()
                self._first_decoding.clear()
                for request in list(self._running.values()) + self._finishing:
                    self._finish(request, "error", exc)
                self._finishing.clear()

    def _timed(self, phase: str, since: float) -> float:
        """Add the time since `since` to a loop phase; returns now."""
        now = time.perf_counter()
        self._loop_seconds[phase] += now - since
        return now

    def _wait(self, event: torch.cuda.Event, phase: str) -> None:
        started = time.perf_counter()
        event.synchronize()
        self._timed(phase, started)

    def _waiting_for_slot(self) -> bool:
        return bool(self._waiting) and bool(self._free_slots)

    def _apply(self, command: tuple[str, object, object]) -> None:
        kind, target, payload = command
        if kind == "capture":  # on this thread: nothing else may touch the device during a capture
            assert isinstance(target, Future)
            try:
                for graphs in (self._graphs, self._prefill_graphs):
                    if graphs is not None:
                        graphs.capture(progress=bool(payload))
                if self._codec_graphs is not None:
                    with self._codec_context():
                        self._codec_graphs.capture(progress=bool(payload))
                if self._first_codec_graphs is not None:
                    with self._codec_context(first_chunks=True):
                        self._first_codec_graphs.capture(progress=bool(payload))
            except Exception as exc:  # noqa: BLE001 - the caller of warmup() gets it
                target.set_exception(exc)
            else:
                target.set_result(None)
            return
        if kind == "open":
            request = target
            assert isinstance(request, _Request)
            self._by_stream[id(request.stream)] = request
            self._waiting.append(request)
            self._stats["streams_started"] += 1
            return
        request = self._by_stream.get(id(target))
        if request is None:
            return
        if kind == "text":
            request.text_ids += request.text.push(str(payload))
        elif kind == "close":
            request.text_ids += request.text.close()
            request.closed = True
        elif kind == "cancel":
            self._stats["cancels"] += 1
            self._finish(request, "cancelled")

    def _admit(self) -> None:
        """Give waiting requests slots (a batch per frame); their prompts run in the next batched prefill."""
        admitted = 0
        while self._waiting and self._free_slots and admitted < MAX_PREFILL_ROWS:
            admitted += 1
            request = self._waiting.pop(0)
            slot = heapq.heappop(self._free_slots)
            request.slot = slot
            request.stream.result.queue_wait = time.perf_counter() - request.stream.submitted
            self._running[slot] = request
            try:
                self._runner.reset_slot(slot, asdict(request.sampling))
                request.codec_ready = self._start_codec(slot, request.spec)
                head = self._prompts.head(request.spec)
                if head.shape[0] >= self._runner.max_seq_len:
                    raise InvalidRequestError(f"the instruction does not fit max_seq_len={self._runner.max_seq_len}")
                request.head = head
            except Exception as exc:  # noqa: BLE001
                self._finish(request, "error", exc)

    @contextlib.contextmanager
    def _codec_context(self, first_chunks: bool = False) -> Iterator[None]:
        """Codec work runs on the codec stream (when there is one), in order, or on the first-chunk lane.

        Work on the codec stream first waits for the lane's last decode, so a stream's later chunks and its
        slot's next set-up follow its first chunk; the lane waits for each slot's set-up itself (`_decode`).
        """
        if self._codec_stream is None:
            yield
            return
        if first_chunks:
            assert self._first_stream is not None
            stream = self._first_stream
        else:
            stream = self._codec_stream
            if self._first_lane_done is not None:
                stream.wait_event(self._first_lane_done)
        with torch.cuda.stream(stream):
            yield

    def _start_codec(self, slot: int, spec: PromptSpec) -> torch.cuda.Event | None:
        """Reset the slot's codec state; a cloned voice continues from its reference codes, decoded once.

        Returns an event after the set-up when first chunks have their own lane (which must wait for it).
        """
        with self._codec_context():
            clone = spec.clone
            if not spec.icl or clone is None:
                self._codec.reset(slot)
            elif (state := self._codec_states.get(clone.voice_id)) is not None:
                self._codec_states.move_to_end(clone.voice_id)
                self._codec.restore(slot, state)
            else:
                self._codec.reset(slot)
                ref_codes = upload(clone.ref_codes, torch.int64, self.device)  # type: ignore[arg-type]
                if self._codec_graphs is not None and self._codec_graphs.captured:
                    self._codec_graphs.prime(slot, ref_codes)
                else:
                    self._codec.prime(slot, ref_codes)
                self._codec_states[clone.voice_id] = self._codec.snapshot(slot)
                if len(self._codec_states) > CODEC_STATE_CACHE:
                    self._codec_states.popitem(last=False)
            if self._first_stream is None:
                return None
            ready = torch.cuda.Event()
            ready.record()
            return ready

    def _advance_prompts(self) -> None:
        """Feed newly final text to running streams and prefill, in one batch, the prompt pieces now ready."""
        pieces: list[tuple[_Request, PrefillRow, PromptBody | None]] = []
        for request in list(self._running.values()):
            try:
                if request.body_done:
                    new_ids = request.text_ids[request.consumed :]
                    request.consumed = len(request.text_ids)
                    eos = [self._prompts.tts_eos_id] if request.closed and not request.eos_fed else []
                    self._feed_track(request, new_ids + eos)
                    continue
                if len(pieces) >= MAX_PREFILL_ROWS:
                    continue
                body = None
                if self._prompts.body_ready(request.spec, len(request.text_ids), request.closed):
                    if request.closed and not request.text_ids:
                        raise InvalidTextError("text is empty")
                    body = self._prompts.body(request.spec, request.text_ids, request.closed)
                elif request.head is None:
                    continue  # head done, body waits for text
                parts = [p for p in (request.head, body.embeds if body else None) if p is not None]
                embeds = torch.cat(parts) if len(parts) > 1 else parts[0]
                needed = request.position + embeds.shape[0]
                if needed >= self._runner.max_seq_len:
                    raise InvalidTextError(
                        f"the prompt needs {needed} positions; this engine holds {self._runner.max_seq_len} "
                        "(shorten the text or raise max_seq_len)"
                    )
                pieces.append((request, PrefillRow(request.slot, request.position, embeds, body is not None), body))  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001
                self._finish(request, "error", exc)
        if pieces:
            self._prefill(pieces)

    def _prefill(self, pieces: list[tuple[_Request, PrefillRow, PromptBody | None]]) -> None:
        rows = [row for _, row, _ in pieces]
        graphs = self._prefill_graphs
        if graphs is None or not graphs.captured or not graphs(rows):
            self._runner.prefill(rows)
        now = time.perf_counter()
        for request, row, body in pieces:
            request.head = None
            request.position += row.embeds.shape[0]
            if body is None:
                continue
            request.body_done = True
            request.prefill_done = now
            request.consumed = len(request.text_ids)
            try:
                self._feed_track(request, body.trailing_ids)
            except Exception as exc:  # noqa: BLE001
                self._finish(request, "error", exc)

    def _feed_track(self, request: _Request, ids: list[int]) -> None:
        if request.closed:
            request.eos_fed = True
        if ids:
            if request.track_len + len(ids) > self._runner.max_text_tokens:
                raise InvalidTextError(f"text longer than {self._runner.max_text_tokens} tokens")
            self._runner.append_text(request.slot, request.track_len, ids)  # type: ignore[arg-type]
            request.track_len += len(ids)

    def _runnable(self) -> list[_Request]:
        """Streams that can take one more frame now: prompt done, frame budget and cache room left, text known."""
        return [
            r for r in self._running.values()
            if r.body_done and not r.finish_reason and r.frames_launched < r.sampling.max_frames
            and r.position < self._runner.max_seq_len and (r.eos_fed or r.frames_launched < r.track_len)
        ]

    def _launch_step(self) -> _Launched:
        """Queue one frame for every runnable stream; its results are read one loop later."""
        rows = self._runnable()
        runner = self._runner
        b = max(r.slot for r in rows) + 1  # type: ignore[type-var]
        kv_len = max(r.position for r in rows) + 1
        host = self._host_buffers[self._step_parity]
        self._step_parity ^= 1
        slots = sorted(r.slot for r in rows)  # type: ignore[type-var]
        if slots != self._active_slots:
            active = host.active.numpy()  # the pinned buffer itself: one numpy write, not a tensor op per row
            active[:] = False
            active[slots] = True
            runner.active.copy_(host.active, non_blocking=True)
            self._active_slots = slots
        if self._graphs is not None and self._graphs.captured:
            b, kv_len = self._graphs.bucket(b, kv_len)
            self._graphs(b, kv_len)
        else:
            in_batch = [r for r in self._running.values() if r.slot < b]  # type: ignore[operator]
            runner.frame_step(
                b,
                kv_len,
                talker_sampling=any(r.sampling.do_sample for r in in_batch),
                predictor_sampling=any(r.sampling.subtalker_do_sample for r in in_batch),
            )
        host.out[:b].copy_(runner.frame_out[:b], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for r in rows:
            r.position += 1
            r.frames_launched += 1
        self._stats["steps"] += 1
        return _Launched(rows, host, event)

    def _collect(self, launched: _Launched) -> None:
        """Read a finished step's codes and EOS flags, and start decoding the chunks that are due."""
        if launched.event is not None:
            self._wait(launched.event, "gpu_wait")
        out = launched.host.out.numpy()
        codes, finished = out[:, :-1], out[:, -1]
        now = time.perf_counter()
        due: dict[int, list[_Request]] = {}
        for r in launched.rows:
            if r.finish_reason:  # ended (EOS, cancel) while this step was in flight: drop its frame
                continue
            slot = r.slot
            assert slot is not None
            self._stats["frames_generated"] += 1
            if r.frames == 0:
                r.first_frame = now
            r.pending.append(codes[slot].copy())
            if self._keep_codes:
                r.codes.append(codes[slot].tolist())
            r.frames += 1
            if finished[slot]:
                r.finish_reason = "eos"
            elif r.frames >= r.sampling.max_frames or (
                r.position >= self._runner.max_seq_len and r.frames == r.frames_launched
            ):
                r.finish_reason = "max_frames"  # the frame budget, or the KV cache, is used up
            if r.finish_reason or len(r.pending) >= r.next_chunk_frames():
                due.setdefault(len(r.pending), []).append(r)
        lane = self._first_codec_graphs
        for n_frames, group in sorted(due.items()):  # first chunks (1 frame) ahead of long ones
            first = [r for r in group if r.chunk_index == 0]
            if first and lane is not None and lane.captured and lane.can_decode(len(first), n_frames):
                group = [r for r in group if r.chunk_index != 0]
                self._decode(first, n_frames, first_lane=True)
            if group:
                self._decode(group, n_frames)
        for r in launched.rows:
            if r.finish_reason and r.slot is not None:
                self._release(r)
                self._finishing.append(r)

    def _decode(self, group: list[_Request], n_frames: int, first_lane: bool = False) -> None:
        """Decode the due chunks of a group (same chunk length) in one batched call; read back asynchronously.

        `first_lane`: the group holds first chunks only and goes to the first-chunk lane.
        """
        slots = [r.slot for r in group]
        with self._codec_context(first_chunks=first_lane):
            if first_lane:
                for r in group:
                    if r.codec_ready is not None:
                        torch.cuda.current_stream().wait_event(r.codec_ready)
            codes = upload(np.stack([np.stack(r.pending) for r in group]), torch.int64, self.device)
            graphs = self._first_codec_graphs if first_lane else self._codec_graphs
            if graphs is not None and graphs.captured and graphs.can_decode(len(slots), n_frames):
                pcm = graphs.decode(slots, codes)  # type: ignore[arg-type]
            else:
                pcm = self._codec.decode(slots, codes)  # type: ignore[arg-type]
            host = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            host.copy_(pcm, non_blocking=True)
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            if first_lane:
                self._first_lane_done = event
        chunks = []
        for r in group:
            chunks.append((r, r.pending_start, r.pending_start + n_frames, bool(r.finish_reason)))
            r.pending = []
            r.pending_start += n_frames
            r.chunk_index += 1
        (self._first_decoding if first_lane else self._decoding).append(_Decoding(chunks, host, event))

    def _deliver_decoded(self, wait: bool) -> None:
        """Hand finished decodes to their streams, oldest first; block on the oldest if `wait` or if it holds
        a stream's first audio (nothing is worth more than that chunk's milliseconds).

        The first-chunk lane is emptied first, so every stream's first chunk reaches it before its second.
        """
        for pending in (self._first_decoding, self._decoding):
            self._deliver_from(pending, wait)

    def _deliver_from(self, pending: collections.deque[_Decoding], wait: bool) -> None:
        while pending:
            decoding = pending[0]
            if decoding.event is not None and not decoding.event.query():
                if not (wait or any(start == 0 for _, start, _, _ in decoding.chunks)):
                    return
                self._wait(decoding.event, "codec_wait")
            pending.popleft()
            ready = time.perf_counter()
            pcm = decoding.pcm.numpy()
            for (r, start, end, is_last), audio in zip(decoding.chunks, pcm, strict=True):
                if r.stream.done:  # ended meanwhile (cancel, error): nothing more for it
                    continue
                chunk = AudioChunk(
                    pcm=audio.copy(), frame_start=start, frame_end=end, is_last=is_last,
                    timings=ChunkTimings(r.stream.submitted, r.prefill_done, r.first_frame, ready),
                )
                result = r.stream.result
                if result.first_audio_latency is None:
                    result.first_audio_latency = ready - r.stream.submitted
                result.frames = end
                result.audio_seconds = end * SAMPLES_PER_FRAME / SAMPLE_RATE
                r.stream._deliver(chunk)
                if is_last:
                    self._finishing.remove(r)
                    self._close(r, r.finish_reason)

    def _release(self, request: _Request) -> None:
        """Give the request's slot back (new requests may take it at once: device work stays ordered)."""
        if request.slot is not None:
            self._running.pop(request.slot, None)
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None
        elif request in self._waiting:
            self._waiting.remove(request)

    def _finish(self, request: _Request, reason: str, error: BaseException | None = None) -> None:
        """End a request now (cancel, error): release it and close its stream without waiting for audio."""
        request.finish_reason = reason
        self._release(request)
        if request in self._finishing:
            self._finishing.remove(request)
        self._close(request, reason, error)

    def _close(self, request: _Request, reason: str, error: BaseException | None = None) -> None:
        self._by_stream.pop(id(request.stream), None)
        if request.stream.done:
            return
        result = request.stream.result
        result.finish_reason = reason
        result.wall_seconds = time.perf_counter() - request.stream.submitted
        result.codes = request.codes
        if error is not None:
            self._stats["errors"] += 1
            if not isinstance(error, Qwen3TTSAgentError):
                logger.error("stream %s failed: %r", request.stream.id, error)
        with self._lock:
            self._open_count -= 1
        request.stream._finish(error)

    def _shutdown(self) -> None:
        for request in list(self._running.values()) + list(self._waiting) + list(self._finishing):
            self._finish(request, "error", EngineClosedError("engine is closed"))
