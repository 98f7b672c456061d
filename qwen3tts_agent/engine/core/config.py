"""What an engine core is built with (`CoreConfig`) and what it counts (`CoreStats`).

A module of their own so that the parts that read them (the core's step launcher, the engine facade that
sums the counters of a core and of the ones that died before it) do not depend on the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..runner import DEFAULT_TOP_K_CAP
from ..types import DEFAULT_CHUNK_SCHEDULE


@dataclass(frozen=True)
class CoreConfig:
    """Sizes and switches of one engine core (see `Engine` for what each means to a caller)."""

    max_streams: int = 16
    max_seq_len: int = 2048
    backend: str = "torch"  # a resolved backend (`qwen3tts_agent.backends`): "torch", "int8", "int4" or "fp32"
    chunk_schedule: tuple[int, ...] = DEFAULT_CHUNK_SCHEDULE
    keep_codes: bool = False
    use_cuda_graphs: bool = True
    overlap_codec: bool = True
    fused_kernels: bool = True
    top_k_cap: int = DEFAULT_TOP_K_CAP
    poll_interval_s: float = 0.0002  # the loop's wait on its message queue while the device works
    adapt_chunks: bool = True  # decode early for streams whose next chunk is nearly due (Scheduler)
    prefix_cache: bool = True  # keep voice prefixes' KV and copy them into new streams (engine/runner/prefixes.py)
    staged_prefill: bool = False  # with the prefix store, one-token text parts as the Triton decode step (Prefills)
    speculative_first_frame: bool = True  # a streamed text's first frame on its tentative second token (Scheduler)
    codec_hold_s: float = 0.0  # how long a later chunk may wait to batch with other streams' (engine/scheduler/codec_queue.py)
    first_frame_slots: int = 0  # new streams' first frames in a step of their own under load (Scheduler); 0: off
    first_frame_load: int = 0  # ... from this many streams stepping
    step_period_s: float = 0.0  # under load, batched steps at most this often (StepPacer's clock); 0: off
    pace_load: int = 0  # ... from this many streams stepping (Scheduler.paced)
    clock_first_frame_load: int = 0  # ... and new streams' first frames too from this many (Scheduler); 0: never
    first_audio_alone: bool = False  # at any load, a step waits while a new stream's first frame and chunk run
    shed_lateness_s: float = 0.0  # how late a chunk must leave to count as evidence of load (DeviceLoad)


@dataclass
class CoreStats:
    """The core's running counters since it started (`Engine.stats` adds those of cores that died before)."""

    frames_generated: int = 0
    streams_started: int = 0
    cancels: int = 0
    errors: int = 0
    steps: int = 0  # batched frame steps launched (frames_generated / steps is the mean batch)
    first_frame_steps: int = 0  # ... of them, steps of the first-frame slots alone (new streams' early frames, Scheduler)
    steps_deferred: int = 0  # turns in which a step waited for urgent audio decodes
    clock_releases: int = 0  # paced steps that went before the clock's tick, for a stream's next chunk
    first_audio_holds: int = 0  # steps that waited for a new stream's first frame and first chunk
    speculations: int = 0  # first frames run on a tentative text token (their audio held until it is final)
    speculation_misses: int = 0  # ... whose token turned out different: the request started over
    codec_decodes: int = 0  # batched codec calls, both lanes (codec_chunks / codec_decodes is the mean batch)
    codec_chunks: int = 0  # chunks they decoded
    early_codec_decodes: int = 0  # ... of the calls, those on the early lane (new streams' first two chunks)
    # Where a batched step's time goes (`StepLauncher`): the steps whose device time events measured, that time,
    # and their time from queued to read back (beyond the device's, a step waited behind other lanes' work or for
    # the loop to read it); and the time no batched step was queued while one had been read and rows could step
    # (the step clock's and the holds' waits, and the loop's turn before it queued the next)
    timed_steps: int = 0
    step_device_seconds: float = 0.0
    step_flight_seconds: float = 0.0
    step_gap_seconds: float = 0.0
    # ... that gap by what held the step back (`launcher.GAP_HOLDS`), from a step's read back to the first look
    # after it under "read", the rest under "loop": the core's loop at its other work before it looked again
    step_gap_by_hold: dict[str, float] = field(default_factory=dict)
    # batched steps queued while another was in flight: no gap before them, the device never idle between the two
    steps_overlapped: int = 0

    def plus(self, other: CoreStats) -> CoreStats:
        """Every counter of this core's and `other`'s together (a core's and those of the cores before it)."""
        summed = CoreStats()
        for f in fields(CoreStats):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                setattr(summed, f.name, {k: mine.get(k, 0.0) + theirs.get(k, 0.0) for k in mine.keys() | theirs.keys()})
            else:
                setattr(summed, f.name, mine + theirs)
        return summed
