"""`Engine`: the streaming engine with its core on a thread of this process (notebooks, tests, Pipecat bots).

The core (`engine/core/core.py`) owns the model and steps every live stream together; this class is its public
side (validation, tokenization, streams: `engine/frontend/frontend.py`) plus the thread that runs it. If the core's
loop dies, every open stream ends with `EngineDeadError`, new streams are refused with
`EngineNotReadyError`, and a fresh core is started after a back-off, unless the device itself is at fault
(then only a new process helps: `qwen3tts-agent serve` runs the core in a process of its own and restarts
that). For serving many clients, see `engine/process/supervisor.py`.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch

from ...backends import resolve_backend
from ...errors import (
    DeviceMemoryError,
    EngineClosedError,
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    UnsupportedFeatureError,
)
from ...models.compat import OfficialModule
from ...reference import warmup_reference
from ..core import CoreConfig, CoreStats, EngineCore
from ..messages import CoreRequest
from ..runner import DEFAULT_TOP_K_CAP
from ..types import DEFAULT_CHUNK_SCHEDULE, SAMPLE_RATE, SamplingParams, Voice, VoicePrompt
from .frontend import EngineFrontend, EngineStats, ModelInfo
from .text import TextTokenizer
from .voices import AudioInput, VoiceEncoder

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.5, 30.0)  # first wait before restarting a dead core, and the longest (doubling)
AUTO_STREAMS_CPU = 16
AUTO_STREAMS_MAX = 256
AUTO_MEMORY_FRACTION = 0.8  # of the device memory free after loading, for the slots' caches and state
# Slots for new streams' first frames under load (`first_frame_step_load`): a step of the lowest eight reads the
# same weights as a lone stream's (the decode GEMV takes up to 64 rows at once), and a new stream stays there for
# a few of its frames (Scheduler.settled), so eight leave room for several streams starting at once.
FIRST_FRAME_SLOTS = 8
# From how many streams stepping at once batched steps keep to the step clock (`step_period_s`): one stream,
# or a few, run as fast as the device goes.
STEP_CLOCK_LOAD = 8
# From how many streams stepping at once first-frame slots are used: where the step clock starts, since a new
# stream's first frame in a batched step would send that step, and every stream in it, off before its tick.
FIRST_FRAME_STEP_LOAD = STEP_CLOCK_LOAD
# From how many streams stepping at once new streams' first frames also wait for the step clock, and take no
# first-frame slot (`clock_first_frame_load`): a device this full makes more frames a second in the clock's
# fuller steps than in steps set off by every arrival (engine/scheduler/scheduler.py; docs/performance.md has the runs).
GPU_CLOCK_FIRST_FRAME_LOAD = 96
# The step clock's period on a GPU (`step_period_s`): streams at about 4x real time under load, which gives the
# chunk schedule's early chunks room to spare (a 2-frame second chunk due 80 ms after the first: docs/gpu.md).
GPU_STEP_PERIOD_S = 0.02


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def slot_bytes(model: OfficialModule, max_seq_len: int) -> int:
    """Device memory one stream slot takes: talker and predictor KV caches, the projected text track, the codec's
    state and its graph scratch rows."""
    cfg = model.config.talker_config
    pcfg = cfg.code_predictor_config
    itemsize = next(model.talker.parameters()).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p_head_dim = getattr(pcfg, "head_dim", None) or pcfg.hidden_size // pcfg.num_attention_heads
    talker_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (max_seq_len + 1) * head_dim
    predictor_kv = 2 * pcfg.num_hidden_layers * pcfg.num_key_value_heads * 16 * p_head_dim
    text_track = max_seq_len * cfg.hidden_size
    # a stream's two codec slots (a new stream takes one whose last decode is done), and a third's worth for the codec
    # graphs' scratch rows (a few dozen whatever the streams: `audio.pipeline.CODEC_LANE_MAX_BATCH`) and work space
    codec_state = 3 * 8 * 2**20 // itemsize
    return int(itemsize * (talker_kv + predictor_kv + text_track + codec_state))


def slot_memory(device: torch.device, device_share: float) -> tuple[int, str]:
    """The memory this engine's slots may take on `device` (`memory_for_slots`), and how that was decided."""
    free, total = torch.cuda.mem_get_info(device)
    return memory_for_slots(free, total, torch.cuda.memory_reserved(device), device_share)


def memory_for_slots(free: int, total: int, taken: int, device_share: float) -> tuple[int, str]:
    """Bytes the slots may take, and how that was decided (for messages): what is `free`, or, with a
    `device_share` below 1 (engines sharing a GPU, e.g. Ray replicas of `num_gpus=0.5`), at most that share of
    the device's `total` less what this process has `taken` already (its weights), so engines that start at the
    same time do not each count the whole free memory as theirs."""
    gib = 2**30
    if device_share >= 1.0:
        return free, f"{free / gib:.1f} GiB free"
    share = int(device_share * total) - taken
    return max(0, min(free, share)), (
        f"{device_share:g} of {total / gib:.1f} GiB less {taken / gib:.1f} GiB taken; {free / gib:.1f} GiB free"
    )


def auto_max_streams(model: OfficialModule, max_seq_len: int, device_share: float = 1.0) -> int:
    """Stream slots for this device: 16 on the CPU; on a GPU as many as fit in `AUTO_MEMORY_FRACTION` of the
    memory the slots may take (`slot_memory`), in multiples of 16, at most 256. Slots are allocated up front, so
    this is checked once at start-up."""
    device = next(model.talker.parameters()).device
    if device.type != "cuda":
        return AUTO_STREAMS_CPU
    per_slot = slot_bytes(model, max_seq_len)
    memory, source = slot_memory(device, device_share)
    fit = int(memory * AUTO_MEMORY_FRACTION // per_slot)
    slots = min(AUTO_STREAMS_MAX, fit // 16 * 16 if fit >= 16 else fit)
    if slots < 1:
        raise ValueError(f"not enough device memory for one stream slot ({per_slot / 2**20:.0f} MiB; {source})")
    logger.info("max_streams auto: %d slots (%.0f MiB each; %s)", slots, per_slot / 2**20, source)
    return slots


def check_slots_fit(model: OfficialModule, max_streams: int, max_seq_len: int, device_share: float) -> None:
    """Refuse `max_streams` slots that do not fit this engine's device (`slots_fit`); nothing on a CPU."""
    device = next(model.talker.parameters()).device
    if device.type != "cuda":
        return
    slots_fit(max_streams, slot_bytes(model, max_seq_len), *slot_memory(device, device_share))


def slots_fit(max_streams: int, per_slot: int, memory: int, source: str) -> None:
    """Refuse, with the figures, `max_streams` slots of `per_slot` bytes that do not fit in `AUTO_MEMORY_FRACTION`
    of the `memory` this engine may take (the rest is for its graphs and work space, as with "auto"; `source`
    says how `memory` was decided): an out-of-memory error in the middle of the start-up says nothing of why or
    what would fit."""
    budget = memory * AUTO_MEMORY_FRACTION
    if max_streams * per_slot > budget:
        raise ValueError(
            f"{max_streams} stream slots need {max_streams * per_slot / 2**30:.1f} GiB ({per_slot / 2**20:.0f} MiB "
            f"each), more than {AUTO_MEMORY_FRACTION:.0%} of the {memory / 2**30:.1f} GiB this engine may take "
            f"({source}): use at most {int(budget // per_slot)} slots, fewer positions a stream (max_seq_len), "
            "or max_streams 'auto'"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the device running out of memory: PyTorch's `OutOfMemoryError` from its allocator, or the
    CUDA error a graph capture raises instead (an `AcceleratorError`, a plain `RuntimeError` before torch 2.8)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "CUDA error: out of memory" in str(error)
    )


def graphs_out_of_memory(max_streams: int, max_seq_len: int, per_slot: int, *, auto: bool = False) -> DeviceMemoryError:
    """The error for a device that ran out of memory capturing the graphs of `max_streams` slots of `per_slot`
    bytes. `slots_fit` leaves a fifth of the memory for the graphs and their work space, which grow with the slots
    too: 512 slots of 0.6B at 768 positions passed it on an H100 and ran out mid-capture with CUDA's bare "out
    of memory" (benchmarks/results/2026-12-07-h100-capacity-burst-fixed), which says nothing of what would fit.
    `auto`: max_streams "auto" chose the slots, so it is not advice."""
    chosen = " (max_streams 'auto' chose them from the memory free at start)" if auto else ""
    return DeviceMemoryError(
        f"the device ran out of memory capturing the CUDA graphs for {max_streams} stream slots of {max_seq_len} "
        f"positions{chosen} (the slots take {max_streams * per_slot / 2**30:.1f} GiB, {per_slot / 2**20:.0f} MiB "
        "each, and the graphs' work space grows with them): use fewer slots (max_streams) or fewer positions a "
        "stream (max_seq_len)" + ("" if auto else ", or max_streams 'auto'")
    )


class Engine(EngineFrontend):
    """Qwen3-TTS streaming engine. Create with `Engine.load`; see docs/engine.md for the API."""

    def __init__(
        self,
        official: object,
        *,
        max_streams: int | str = 16,
        max_queue: int = 64,
        max_seq_len: int = 2048,
        max_text_chars: int = 4000,
        chunk_schedule: Sequence[int] = DEFAULT_CHUNK_SCHEDULE,
        keep_codes: bool = False,
        use_cuda_graphs: bool = True,
        overlap_codec: bool = True,
        fused_kernels: bool = True,
        top_k_cap: int = DEFAULT_TOP_K_CAP,
        shed_when_behind: bool | None = None,
        adapt_chunks: bool | None = None,
        backend: str = "auto",
        prefix_cache: bool = True,
        staged_prefill: bool | None = None,
        speculative_first_frame: bool = True,
        codec_hold_s: float = 0.0,
        first_frame_step_load: int | None = None,
        step_period_s: float | None = None,
        clock_first_frame_load: int | None = None,
        first_audio_alone: bool | None = None,
        shed_lateness_s: float = 0.0,
        device_share: float = 1.0,
    ) -> None:
        """`max_streams`: stream slots (rows of the batched step), or "auto" for what the device holds
        (`auto_max_streams`). `device_share`: the share of the GPU's memory this engine may take, below 1 where
        engines share a GPU (Ray replicas of `num_gpus` 0.5, say): "auto" slots then fit that share, and explicit
        ones that cannot are refused at once with the figures. `shed_when_behind`: refuse new streams (EngineOverloadedError) while the engine runs behind real
        time, so admitted streams keep their audio flowing; default on a GPU, off on the CPU. Only while a
        stream is live, and by the last second's steps and late chunks alone (`Scheduler.overloaded`).
        `adapt_chunks`: a stream whose next chunk is nearly due gets its frames decoded at once instead of
        in the next chunk of its schedule (see `engine/scheduler/scheduler.py`); default on a GPU, off on the CPU,
        where an engine near real time would otherwise cut most chunks short.
        `backend`: what runs the model maths: "auto" (the int8 CPU backend on a CPU, PyTorch with the Triton
        kernels on a GPU), "torch", "int8", "int4" or "fp32" (`qwen3tts_agent.backends`, docs/cpu-backend.md).
        `overlap_codec`: decode audio beside the frame steps: on a GPU on CUDA streams of their own (with an
        early lane for each stream's first two chunks), on a CPU on a thread of its own with a quarter of
        the cores, the frame steps taking the rest (`engine/audio/pipeline.py`). The codes are the same either way,
        the audio too (on a CPU to float rounding: PyTorch's kernels on fewer threads).
        `prefix_cache`: keep the keys and values of each voice's prompt head (`engine/runner/prefixes.py`) so that a
        stream of a voice seen before prefills only its text-dependent part; the audio is the same either
        way (the "torch" backend; the CPU backends prefill every head). `staged_prefill`: with the prefix
        cache and the Triton kernels, a one-token text part runs as the talker's Triton decode step in a
        staging cache instead of a padded prompt graph; the codes are the same either way (docs/engine.md).
        None: on a GPU.
        `speculative_first_frame`: a stream whose text arrives in pieces runs its first frame on the second
        text token as the text stands, holding the audio until that token is final (and starting over in the
        rare case it changes), so the first frame does not wait for the third token; the audio that leaves is
        that of the final text either way (`engine/scheduler/scheduler.py`).
        `codec_hold_s`: how long a stream's later chunk may wait to be decoded in one codec call with other
        streams' chunks, while its listener has audio to spare (`engine/scheduler/codec_queue.py`); default 0:
        each goes as soon as the codec lane has room, and a call batches what waited for room meanwhile. A hold
        makes fewer, larger calls, but on a loaded GPU the lane idles through it and held chunks leave late, which
        refuses new streams (docs/performance.md, "no codec hold by default").
        `first_frame_step_load`: from this many streams stepping at once, a new stream's first frame runs in
        a step of a few low slots of its own, right behind the step in flight, instead of waiting for that
        step and then a whole batched one, except for a while after a chunk left late (a full device), when new
        streams step in the batched steps (`engine/scheduler/scheduler.py`); the audio is the same either way. 0: never;
        None: `FIRST_FRAME_STEP_LOAD` on a GPU with the "torch" backend and over that many slots, else never.
        `step_period_s`: from `STEP_CLOCK_LOAD` streams stepping at once, a batched step starts at most this
        often, unless a stream's next chunk would be late or a new stream's first frame is in it, so streams
        run at about 80 ms / `step_period_s` times real time and the device keeps room between steps for new
        streams' prompts, first frames and first chunks (`engine/scheduler/pacer.py`); such a step also waits while a
        new stream's first frame runs and its first chunk decodes (unless a stream's next chunk would then
        be late). The audio is the same either way. 0: steps go back to back; None: `GPU_STEP_PERIOD_S` on a
        GPU with the "torch" backend, else 0.
        `clock_first_frame_load`: from this many streams stepping at once, a new stream's first frame waits for
        the step clock's tick too, and takes no first-frame slot: on a device that full, steps set off by every
        arrival (each of every stream) would make fewer frames a second than the clock's fuller ones. 0: never;
        None: `GPU_CLOCK_FIRST_FRAME_LOAD` wherever there is a step clock.
        `first_audio_alone`: below the step clock's load too, a frame step waits while a new stream's first
        frame runs and its first chunk decodes, unless a stream's next chunk would then be late: the first
        chunk's few hundred small codec kernels then have the device to themselves instead of sharing it
        with the next frames' (a lone stream's next frames are far ahead of its listener anyway). The audio
        is the same either way. None: on a GPU with the "torch" backend (on a CPU the codec has cores of
        its own).
        `shed_lateness_s`: how late a chunk must leave for it to count towards refusing new streams and pausing
        first-frame slots (`engine/scheduler/device_load.py`); 0: any lateness does. Late chunks are counted in
        `stats` either way."""
        self._official = official
        model = official.model  # type: ignore[attr-defined]
        self.model = model
        self.device = next(model.talker.parameters()).device
        self.dtype = next(model.talker.parameters()).dtype
        self.backend = resolve_backend(backend, self.device)
        if not 0.0 < device_share <= 1.0:
            raise ValueError(f"device_share must be in (0, 1], got {device_share!r}")
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive number of positions, got {max_seq_len!r}")
        self._auto_streams = max_streams == "auto"  # for the advice of an out-of-memory error (`_capture_graphs`)
        if max_streams == "auto":
            max_streams = auto_max_streams(model, max_seq_len, device_share)
        elif not isinstance(max_streams, int) or max_streams < 1:
            raise ValueError(f"max_streams must be a positive number or 'auto', got {max_streams!r}")
        else:
            check_slots_fit(model, max_streams, max_seq_len, device_share)
        self._config = CoreConfig(
            max_streams=max_streams, max_seq_len=max_seq_len, backend=self.backend, chunk_schedule=tuple(chunk_schedule),
            keep_codes=keep_codes, use_cuda_graphs=use_cuda_graphs, overlap_codec=overlap_codec,
            fused_kernels=fused_kernels, top_k_cap=top_k_cap,
            adapt_chunks=self.device.type == "cuda" if adapt_chunks is None else adapt_chunks,
            prefix_cache=prefix_cache, speculative_first_frame=speculative_first_frame,
            staged_prefill=self.device.type == "cuda" if staged_prefill is None else staged_prefill,
            codec_hold_s=codec_hold_s,
            **self._first_frame_step(first_frame_step_load, max_streams),
            step_period_s=self._step_period(step_period_s), pace_load=STEP_CLOCK_LOAD,
            clock_first_frame_load=self._clock_first_frame_load(clock_first_frame_load),
            first_audio_alone=(
                self.device.type == "cuda" and self.backend == "torch" if first_audio_alone is None else first_audio_alone
            ),
            shed_lateness_s=shed_lateness_s,
        )
        tokenizer = TextTokenizer(official.processor.tokenizer)  # type: ignore[attr-defined]
        info = ModelInfo.from_official(
            model, sample_rate=SAMPLE_RATE, max_streams=max_streams, max_seq_len=max_seq_len, top_k_cap=top_k_cap,
            chunk_schedule=tuple(chunk_schedule), device=str(self.device), adapt_chunks=self._config.adapt_chunks,
        )
        super().__init__(info, tokenizer, max_queue=max_queue, max_text_chars=max_text_chars)
        self.shed_when_behind = self.device.type == "cuda" if shed_when_behind is None else shed_when_behind
        self._voices = VoiceEncoder(official) if self.model_type == "base" else None
        self._role_ids = tokenizer.role_ids()
        self._accepting = False
        self._restarts = 0
        self._stats_base = CoreStats()
        self._graphs_wanted = False
        self._core_lock = threading.Lock()
        self.core = EngineCore(model, self._role_ids, self._config, self)
        self._thread = self._start(self.core)

    def _first_frame_step(self, load: int | None, max_streams: int) -> dict[str, int]:
        """The core's first-frame settings for `Engine(first_frame_step_load=...)`."""
        if load is None:
            usable = self.device.type == "cuda" and self.backend == "torch" and max_streams > FIRST_FRAME_STEP_LOAD
            load = FIRST_FRAME_STEP_LOAD if usable else 0
        if load < 0:
            raise ValueError(f"first_frame_step_load must not be negative, got {load}")
        if not load:
            return {}
        if self.backend != "torch" or max_streams <= FIRST_FRAME_SLOTS:
            raise ValueError(f"a first-frame step needs the torch backend and more than {FIRST_FRAME_SLOTS} slots")
        return {"first_frame_slots": FIRST_FRAME_SLOTS, "first_frame_load": load}

    def _clock_first_frame_load(self, load: int | None) -> int:
        """`Engine(clock_first_frame_load=...)` for the core (it matters only with a step clock)."""
        if load is None:
            return GPU_CLOCK_FIRST_FRAME_LOAD
        if load < 0:
            raise ValueError(f"clock_first_frame_load must not be negative, got {load}")
        return load

    def _step_period(self, period_s: float | None) -> float:
        """The step clock's period for `Engine(step_period_s=...)`."""
        if period_s is None:
            return GPU_STEP_PERIOD_S if self.device.type == "cuda" and self.backend == "torch" else 0.0
        if period_s < 0:
            raise ValueError(f"step_period_s must not be negative, got {period_s}")
        return period_s

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
        **engine_kwargs: object,
    ) -> Engine:
        """Load a checkpoint (hub id, local folder or `synthetic:<size>[-<type>]`) and start the engine.

        Blocking: from async code use `await asyncio.to_thread(Engine.load, ...)`.
        """
        from ...models.loading import load_official_model

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        assert isinstance(dtype, torch.dtype)
        official = load_official_model(model, device=device, dtype=dtype, cache_dir=cache_dir, progress=progress)
        return cls(official, **engine_kwargs)  # type: ignore[arg-type]

    # ----------------------------------------------------------------- voices
    def create_voice(
        self, ref_audio: AudioInput, ref_text: str | None = None, *, x_vector_only: bool = False,
        max_ref_seconds: float | None = None,
    ) -> VoicePrompt:
        """Encode a reference voice once (cached by content). Blocking; thread-safe.

        `max_ref_seconds` (in-context clones): keep only the reference's first whole sentences that fit in
        this many seconds, audio and transcript alike (`voices.trim_reference`), since the first frame of an
        in-context clone waits for about one text token per reference frame. The voice is then exactly the
        one the official package makes of that shorter reference; `VoicePrompt.ref_text` says what was kept.
        """
        if self._voices is None:
            raise UnsupportedFeatureError(f"voice cloning needs a Base model; this one is {self.model_type}")
        return self._voices.create(ref_audio, ref_text, x_vector_only=x_vector_only, max_ref_seconds=max_ref_seconds)


    # ----------------------------------------------------------------- the core
    def _send(self, message: CoreRequest) -> None:
        self.core.submit(message)

    def _check_available(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if not self._accepting:
            raise EngineNotReadyError("the engine is restarting after a failure; retry shortly")
        reason = self.refusal_reason()
        if reason is not None:
            raise EngineOverloadedError(f"busy: the engine is running behind real time ({reason}); retry shortly", reason)

    def refusal_reason(self) -> str | None:
        """Why new streams are refused now because the engine runs behind (`shed_when_behind`,
        `Scheduler.refusal_reason`), or None; cheap enough to ask often (the core process's server watches
        it for changes)."""
        core = self.core
        if not self.shed_when_behind or core is None:
            return None
        return core.scheduler.refusal_reason(time.perf_counter())

    @property
    def healthy(self) -> bool:
        """Whether the core is running and takes new streams."""
        return self._accepting and not self._closed

    def _start(self, core: EngineCore) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(core,), name="qwen3tts-engine", daemon=True)
        self._accepting = True
        thread.start()
        return thread

    def _run(self, core: EngineCore) -> None:
        started = time.monotonic()
        try:
            core.run()
        except BaseException as exc:  # noqa: BLE001 - the core died: streams end, a new core follows
            self._on_core_death(core, exc, time.monotonic() - started)

    def _on_core_death(self, core: EngineCore, exc: BaseException, lived_s: float) -> None:
        with self._lock:
            self._accepting = False
        self._fail_open_streams(EngineDeadError(f"the engine core stopped: {type(exc).__name__}: {exc}"))
        cause = exc.__cause__ or exc
        device_fault = isinstance(cause, RuntimeError) and "CUDA error" in str(cause)
        if self._closed or device_fault:
            if device_fault:
                logger.error("the device failed; this process must restart to use it again")
            return
        backoff = RESTART_BACKOFF_S[0] if lived_s > 60 else min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2 ** self._restarts)
        threading.Thread(target=self._restart, args=(core, backoff), name="qwen3tts-engine-restart", daemon=True).start()

    def _restart(self, dead: EngineCore, backoff: float) -> None:
        logger.warning("restarting the engine core in %.1f s", backoff)
        time.sleep(backoff)
        with self._core_lock:
            if self._closed:
                return
            self._stats_base = self._stats_base.plus(dead.stats)
            self.core = None  # type: ignore[assignment]
            del dead
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            core = EngineCore(self.model, self._role_ids, self._config, self)
            self.core = core
            self._restarts += 1
            self._thread = self._start(core)
            if self._graphs_wanted:
                self._capture_graphs(core, progress=False)
        logger.warning("engine core restarted (%d restarts so far)", self._restarts)

    # ----------------------------------------------------------------- status and lifecycle
    def stats(self) -> EngineStats:
        core = self.core
        if core is None:  # between a dead core and its successor
            return EngineStats(0, self.open_stream_count(), self.max_streams, 0, 0, 0, 0, 0, healthy=False,
                               restarts=self._restarts)
        scheduler = core.scheduler
        running = len(scheduler.running)
        refusal = self.refusal_reason()
        counted = self._stats_base.plus(core.stats)  # this core's and dead ones'
        # the limit admission applies: an engine that does not shed (the CPU's default) takes on every slot,
        # whatever its late chunks would have cut
        limit = scheduler.stream_limit if self.shed_when_behind else None
        now_s = time.perf_counter()
        return EngineStats(
            active_streams=running,
            queued_streams=max(0, self.open_stream_count() - running),
            max_streams=self.max_streams,
            **{f.name: getattr(counted, f.name) for f in fields(CoreStats)},
            late_chunks=scheduler.load.stats.late_chunks,
            underrun_seconds=scheduler.load.stats.underrun_seconds,
            late_by_index=dict(scheduler.load.stats.late_by_index),
            late_by_cause=dict(scheduler.load.stats.late_by_cause),
            overloaded=refusal is not None,
            refusal_reason=refusal,
            stream_limit=int(limit.limit(now_s)) if limit is not None else self.max_streams,
            stream_limit_cuts=limit.cuts if limit is not None else 0,
            stream_limit_seconds=limit.limited_seconds(now_s) if limit is not None else 0.0,
            healthy=self.healthy,
            restarts=self._restarts,
            device_memory_bytes=torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0,
            core_rss_bytes=resident_bytes(),
            kernel_paths=dict(core.runner.kernel_paths),
            loop_seconds=dict(core.loop_seconds),
        )

    def warmup(self, progress: bool = True) -> None:
        """Capture the CUDA graphs and run one short utterance end to end, so no caller pays first-call costs."""
        core = self.core
        if not core.graphs_captured:
            self._graphs_wanted = True
            self._capture_graphs(core, progress)
        started = time.perf_counter()
        voice = Voice()
        if self.model_type == "base":
            voice = Voice(prompt=self.create_voice(warmup_reference(), "Warm up."))
        elif self.model_type == "custom_voice":
            voice = Voice(speaker=self.speakers[0])
        encoded = time.perf_counter()
        frames = sum(self.chunk_schedule) + self.chunk_schedule[-1]  # every chunk size of the schedule once
        self.synthesize_blocking("Warm up.", voice=voice, sampling=SamplingParams(max_frames=frames, ignore_eos=True))
        logger.info("warm-up utterance: voice %.1f s, %d frames %.1f s", encoded - started, frames,
                    time.perf_counter() - encoded)

    def _capture_graphs(self, core: EngineCore, progress: bool) -> None:
        """Capture the core's CUDA graphs; should the device run out of memory for them, say what would fit."""
        try:
            core.call(lambda: core.capture_graphs(progress)).result()
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            config = self._config
            raise graphs_out_of_memory(
                config.max_streams, config.max_seq_len, slot_bytes(self.model, config.max_seq_len), auto=self._auto_streams
            ) from error

    def close(self) -> None:
        """Stop the core; open streams end with EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        with self._core_lock:
            self.core.stop()
            self._thread.join(timeout=30)
        self._fail_open_streams(EngineClosedError("engine is closed"))
