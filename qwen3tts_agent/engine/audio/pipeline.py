"""The audio pipeline: codes to PCM with the exact streaming codec, beside the frame steps.

Decoding runs on CUDA streams of its own (when there is a GPU), so a large decode fills the gaps between
frame steps instead of delaying them: the codec lane runs at a lower priority than the steps. A stream's
first two chunks (its first audio, and the chunk due one frame's playing time after it) take the *early
lane*, above the steps' priority, with graphs and scratch rows of its own (`engine/runner/lanes.py`): they never
queue behind the long chunks of streams already playing, nor behind a step's kernels. The codec lane waits
for the early lane's last decode, so a stream's later chunks follow its early ones.

Two things keep a new stream clear of the codec lane's queue:
- Codec slots are not engine slots. A request takes a codec slot whose last decode has completed, and
  sets it up (reset, or a cloned voice's primed state) on the early lane; it never waits for decodes of the
  slot's previous owner that may still sit in the codec lane's queue. There are twice as many codec slots
  as engine slots, so a finished one is always at hand.
- The codec lane holds at most `CODEC_LANE_DEPTH` decodes at a time. The rest wait on the host
  (`CodecQueue`, `engine/scheduler/codec_queue.py`) while their streams have audio to spare, so that one call decodes
  many streams' chunks: the most urgent due chunk goes with every waiting chunk of its length (a stream's
  own chunks always in order), or while a call is in flight with as many as fill a graph's batch exactly.

A decode's PCM is copied to pinned host memory and read once its event has fired, so the core polls
rather than waits.

On a CPU the codec runs on a thread of its own (`CodecThread`), with a share of the cores
(`cpu_thread_split`), so that a chunk decodes while the next frame steps run, as the codec lane lets it on a
GPU: the frame step is bound by memory bandwidth, the codec by arithmetic. Every codec call of the pipeline,
slot set-ups included, goes through that thread in order; the core polls their futures as it polls events.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..messages import PromptSpec
from ..runner import LanePriorities, power_of_two_buckets, upload, upload_together
from ..scheduler import ChunkPlan, CodecQueue
from .codec import StreamingCodecDecoder
from .codec_graphs import GraphedCodecDecode

# Primed codec states kept per cloned voice (a few MB each), so a voice's reference codes are decoded once.
CODEC_STATE_CACHE = 64
# A stream's chunks decoded on the early lane: the first, and the next, due 80 ms after the first has left.
EARLY_CHUNKS = 2
# Early chunks decoded together on the early lane (more of one length in one frame take the codec lane).
EARLY_LANE_ROWS = 16
# Decodes queued on the codec lane at once; later ones wait on the host, most urgent first.
CODEC_LANE_DEPTH = 2
# Codec-lane chunks of one length that go at once rather than wait for more to batch with: a graphed call of
# this many costs little more per frame than the largest (docs/performance.md, "the codec hold at 80 req/s").
GOOD_CODEC_BATCH = 32
# The largest graph of the codec lane: at most this many chunks (more due at once go in several calls) of at most
# this many frames (a longer chunk is decoded in graphed pieces, which the streaming decoder makes exact). Past a
# few dozen chunks a call costs little less a frame, while a graph's work space grows with its rows × frames: one
# graph for every slot ran out of memory at start with 16-frame chunks (docs/gpu.md, "The codec beside the steps").
CODEC_LANE_MAX_BATCH = 64
CODEC_GRAPH_MAX_FRAMES = 16
# A waiting codec-lane chunk is decoded at the latest once its listener would run out of audio within this
# long: room for a decode queued behind another on a loaded device, and for the delivery after it.
LAUNCH_SLACK_S = 0.15


# A codec call's completion: a CUDA event (GPU lanes), a future (the CPU's codec thread), or None (done).
Pending = torch.cuda.Event | Future[Any] | None


def _done(pending: Pending) -> bool:
    if pending is None:
        return True
    return pending.done() if isinstance(pending, Future) else pending.query()


def _wait(pending: Pending) -> None:
    if isinstance(pending, Future):
        pending.result()
    elif pending is not None:
        pending.synchronize()


def codec_lane_buckets(max_streams: int) -> list[int]:
    """The batches the codec lane's graphs decode for an engine of `max_streams`: powers of two up to
    `CODEC_LANE_MAX_BATCH` (or the streams, where fewer)."""
    return power_of_two_buckets(min(CODEC_LANE_MAX_BATCH, max_streams))


def codec_lane_frames(chunk_schedule: Sequence[int]) -> tuple[int, ...]:
    """The chunk lengths the codec lane's graphs decode in one replay: the schedule's, and 1, 2, 4 and 8 (so that
    any chunk, a stream's shorter last one too, goes in a few pieces), up to `CODEC_GRAPH_MAX_FRAMES`."""
    return tuple(sorted(size for size in {*chunk_schedule, 1, 2, 4, 8} if size <= CODEC_GRAPH_MAX_FRAMES))


def cpu_thread_split(threads: int) -> tuple[int, int]:
    """(frame-step threads, codec threads) for `threads` CPU cores; (threads, 0) where one core cannot run both.

    A quarter of the cores for the codec, at least one: a frame step, bound by memory bandwidth, loses little
    to fewer cores, and the codec decoding beside it hides most of its own time (docs/cpu-backend.md)."""
    if threads < 2:
        return threads, 0
    codec = max(1, threads // 4)
    return threads - codec, codec


class CodecThread:
    """The CPU codec's own thread: calls run in submission order, each PyTorch op on `threads` cores, without
    autograd (as on the core's loop thread, `EngineCore.run`)."""

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="qwen3tts-codec", initializer=_codec_thread_start, initargs=(threads,)
        )
        self._last: Future[Any] | None = None

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        self._last = self._executor.submit(fn)
        return self._last

    @property
    def idle(self) -> bool:
        """Every call submitted so far has returned (calls run in order: the last one's end says so)."""
        return self._last is None or self._last.done()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _codec_thread_start(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)  # thread-local: set once for every call the thread runs


@dataclass
class _Decoding:
    plans: list[ChunkPlan]
    pcm: torch.Tensor | Future[torch.Tensor]  # [len(plans), samples] on the host (the codec thread's, to come)
    pending: Pending
    submitted: float = 0.0  # perf_counter() when it was handed to the codec's thread

    @property
    def first_chunk_pending(self) -> bool:
        """It decodes a stream's first chunk and is not done yet."""
        return not _done(self.pending) and any(plan.is_first for plan in self.plans)

    def host_pcm(self) -> np.ndarray:
        pcm = self.pcm.result() if isinstance(self.pcm, Future) else self.pcm
        return pcm.numpy()


class AudioPipeline:
    """Codec slots for live requests, and the lanes that decode their chunks."""

    def __init__(
        self,
        decoder: torch.nn.Module,
        *,
        device: torch.device,
        max_streams: int,
        chunk_schedule: Sequence[int],
        graphed: bool,
        overlap: bool,
        make_codec: Callable[..., StreamingCodecDecoder] = StreamingCodecDecoder,
        hold_s: float = 0.0,
        priorities: LanePriorities | None = None,
        on_decode: Callable[[int, bool], None] | None = None,
        codec_threads: int = 0,
    ) -> None:
        """`hold_s`: how long a later chunk may wait on the host for other streams' chunks to batch with
        (`CodecQueue`; 0: decode as soon as the lane has room). `priorities`: the CUDA stream priorities of
        the lanes (the device's default when None). `on_decode(chunks, early)` is called for every codec call
        (`early`: on the early lane).
        `codec_threads` (CPU, with `overlap`): the cores of the codec's own thread (0: no thread, the codec
        runs on the caller's thread with its cores). `make_codec(decoder, max_streams=n)` builds the streaming
        decoder of the engine's backend (the core passes `backends.create_codec`; PyTorch's by default)."""
        self.device = device
        self._on_decode = on_decode
        self._codec_stream: torch.cuda.Stream | None = None
        self._early_stream: torch.cuda.Stream | None = None
        self._thread: CodecThread | None = None
        if device.type == "cuda" and overlap:
            lanes = priorities or LanePriorities.of_device()
            self._codec_stream = torch.cuda.Stream(device, priority=lanes.background)
            if graphed:
                self._early_stream = torch.cuda.Stream(device, priority=lanes.urgent)
        elif device.type == "cpu" and overlap and codec_threads:
            self._thread = CodecThread(codec_threads)
        early_rows = min(EARLY_LANE_ROWS, max_streams) if self._early_stream is not None else 0
        lane_buckets = codec_lane_buckets(max_streams)
        lane_rows = lane_buckets[-1]  # the codec lane's largest graphed call
        # live codec slots [0, 2M); with graphs, scratch rows above them pad a call up to its graph's batch
        live = 2 * max_streams
        self.codec = make_codec(decoder, max_streams=live + (lane_rows + early_rows if graphed else 0))
        self._free_slots = list(range(live))  # codec slots no request owns (their last decode may be pending)
        self._last_use: dict[int, Pending] = {}  # codec slot -> its last decode's completion
        self._slot_of: dict[str, int] = {}  # request id -> its codec slot
        self._ready: dict[str, torch.cuda.Event | None] = {}  # request id -> its slot's set-up (not on a thread)
        # primed states per cloned voice (touched only where the codec runs: the codec thread, if any)
        self._states: collections.OrderedDict[str, list[torch.Tensor]] = collections.OrderedDict()
        self._early_lane_done: torch.cuda.Event | None = None  # the early lane's last decode
        # codec-lane chunks not yet launched; with graphs, a call takes at most the largest graphed batch
        self.queue = CodecQueue(
            max_batch=lane_rows if graphed else 2 * max_streams,
            hold_s=hold_s, launch_slack_s=LAUNCH_SLACK_S, good_batch=GOOD_CODEC_BATCH,
            batch_sizes=lane_buckets if graphed else (),  # the codec graphs' batches
        )
        self._decoding: collections.deque[_Decoding] = collections.deque()
        self._early_decoding: collections.deque[_Decoding] = collections.deque()
        self._graphs: GraphedCodecDecode | None = None
        self._early_graphs: GraphedCodecDecode | None = None
        # chunk lengths one codec call decodes (one graph replay); other lengths run as several pieces
        self.decode_sizes: tuple[int, ...] = ()
        if graphed:
            self.decode_sizes = codec_lane_frames(chunk_schedule)
            self._graphs = GraphedCodecDecode(self.codec, live, lane_buckets, self.decode_sizes)
            if early_rows:
                self._early_graphs = GraphedCodecDecode(
                    self.codec, live + lane_rows, power_of_two_buckets(early_rows), set(chunk_schedule[:EARLY_CHUNKS]),
                    name="early-lane codec",
                )

    def capture(self, progress: bool) -> None:
        """Capture the codec graphs of both lanes (on the thread that owns the device work)."""
        if self._graphs is not None:
            with self._lane():
                self._graphs.capture(progress=progress)
        if self._early_graphs is not None:
            with self._lane(early=True):
                self._early_graphs.capture(progress=progress)

    @property
    def busy(self) -> bool:
        return bool(self._decoding or self._early_decoding or self.queue)

    def codec_thread_idle(self) -> bool:
        """The CPU codec's own thread has nothing to run now (False where there is no such thread)."""
        return self._thread is not None and self._thread.idle

    def close(self) -> None:
        """Stop the codec thread (after its queued calls); the pipeline decodes nothing more."""
        if self._thread is not None:
            self._thread.close()

    @contextlib.contextmanager
    def _lane(self, early: bool = False) -> Iterator[None]:
        """Codec work runs on the codec lane (when there is one), in order, or on the early lane."""
        if self._codec_stream is None:
            yield
            return
        if early:
            assert self._early_stream is not None
            stream = self._early_stream
        else:
            stream = self._codec_stream
            if self._early_lane_done is not None:
                stream.wait_event(self._early_lane_done)
        with torch.cuda.stream(stream):
            yield

    # ----------------------------------------------------------------- codec slots
    def start(self, request_id: str, spec: PromptSpec) -> None:
        """Give a request a codec slot and set it up: reset, or a cloned voice's primed reference codes."""
        slot = self._take_slot()
        self._slot_of[request_id] = slot
        if self._thread is not None:  # its decodes follow it on the same thread
            self._last_use[slot] = self._thread.submit(lambda: self._set_up(slot, spec))
            return
        ready = None
        with self._lane(early=self._early_stream is not None):
            self._set_up(slot, spec)
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
        self._ready[request_id] = ready
        self._last_use[slot] = ready

    def _set_up(self, slot: int, spec: PromptSpec) -> None:
        clone = spec.clone
        if not spec.icl or clone is None:
            self.codec.reset(slot)
        elif (state := self._states.get(clone.voice_id)) is not None:
            self._states.move_to_end(clone.voice_id)
            self.codec.restore(slot, state)
        else:  # a voice's first use: its reference codes run through the codec once (eagerly, no graph)
            self.codec.reset(slot)
            self.codec.prime(slot, upload(clone.ref_codes, torch.int64, self.device))  # type: ignore[arg-type]
            self._states[clone.voice_id] = self.codec.snapshot(slot)
            if len(self._states) > CODEC_STATE_CACHE:
                self._states.popitem(last=False)

    def _take_slot(self) -> int:
        """The lowest free codec slot whose last decode has completed (waiting for one only if none has)."""
        for index, slot in enumerate(self._free_slots):
            if _done(self._last_use.get(slot)):
                return self._free_slots.pop(index)
        if not self._free_slots:
            raise RuntimeError("no free codec slot")  # cannot happen: twice as many as engine slots
        slot = self._free_slots.pop(0)
        _wait(self._last_use.get(slot))
        return slot

    def drop(self, request_id: str) -> None:
        """The request ended: its waiting chunks are dropped and its codec slot goes back to the pool."""
        self.queue.drop(request_id)
        self._ready.pop(request_id, None)
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._free_slots.sort()

    # ----------------------------------------------------------------- decoding
    def enqueue(self, plans: Sequence[ChunkPlan]) -> None:
        """Start decoding due chunks (most urgent first): early chunks on the early lane at once; the others wait
        in the codec lane's queue (counted by `urgent`) until `pump` lets them go. Two calls, so that the core
        reading a step back looks at launching the next between them (`StepLauncher.collect`)."""
        early: dict[int, list[ChunkPlan]] = {}
        later: list[ChunkPlan] = []
        lane = self._early_graphs
        for plan in plans:
            if plan.index < EARLY_CHUNKS and lane is not None and lane.captured and not self._on_codec_lane(plan):
                early.setdefault(plan.n_frames, []).append(plan)
            else:
                later.append(plan)
        for n_frames, group in early.items():
            if lane.can_decode(len(group), n_frames):  # type: ignore[union-attr]
                self._decode(group, n_frames, early=True)
            else:
                later.extend(group)
        self.queue.add(later)

    def _on_codec_lane(self, plan: ChunkPlan) -> bool:
        """Whether an earlier chunk of the plan's stream waits for or runs on the codec lane (the plan must
        follow it there: the early lane would overtake it)."""
        rid = plan.request.request_id
        return any(p.request.request_id == rid for p in self.queue) or any(
            p.request.request_id == rid for decoding in self._decoding for p in decoding.plans
        )

    def pump(self, now: float, streams: int) -> bool:
        """Launch the codec-lane decodes the queue lets go while the lane has room; whether any went.
        `streams`: the live streams that may still cut chunks (`CodecQueue.next_batch`)."""
        launched = False
        while self.queue and self._lane_depth() < CODEC_LANE_DEPTH:
            group = self.queue.next_batch(now, streams, lane_busy=self._lane_depth() > 0)
            if not group:
                break
            self._decode(group, group[0].n_frames, early=False)
            launched = True
        return launched

    def urgent(self, now: float, within_s: float) -> bool:
        """Whether a codec-lane chunk waiting or in flight is due within `within_s` (deadline-aware pacing)."""
        plans = [*self.queue, *(plan for decoding in self._decoding for plan in decoding.plans)]
        for plan in plans:
            deadline = plan.request.deadline()
            if deadline is not None and deadline - now < within_s:
                return True
        return False

    def first_audio_in_flight(self) -> bool:
        """Whether a stream's first chunk is being decoded on the early lane (its decode not yet done): a paced
        step may wait for it, so that the decode has the device to itself (`StepLauncher._launch_step`)."""
        return any(decoding.first_chunk_pending for decoding in self._early_decoding)

    def wait_for_first_audio(self, timeout_s: float, older_than_s: float) -> bool:
        """On the CPU's codec thread: wait up to `timeout_s` for the decodes in flight that hold a stream's first
        chunk and were handed to the thread over `older_than_s` ago (so near their end). Whether there were
        any and they are now done (False at once where there is no codec thread).

        A CPU frame step holds the core's thread for its whole length, and nothing is delivered meanwhile: a
        first chunk whose decode ends just after a step starts would wait for all of it (`StepLauncher`)."""
        if self._thread is None:
            return False
        before = time.perf_counter() - older_than_s
        pending = [
            decoding.pending for decoding in self._decoding
            if isinstance(decoding.pending, Future) and decoding.first_chunk_pending and decoding.submitted < before
        ]
        if not pending:
            return False
        futures.wait(pending, timeout=timeout_s)
        return all(future.done() for future in pending)

    def _lane_depth(self) -> int:
        """Decodes queued on the codec lane (or the CPU's codec thread) and not done (0 on a CPU without the
        thread: decodes there are synchronous)."""
        return sum(1 for d in self._decoding if not _done(d.pending))

    def _decode(self, group: list[ChunkPlan], n_frames: int, early: bool) -> None:
        slots = [self._slot_of[plan.request.request_id] for plan in group]
        codes = np.stack([plan.codes for plan in group])
        decoding = self._decode_on_thread(group, slots, codes) if self._thread is not None else (
            self._decode_on_lane(group, slots, codes, n_frames, early))
        for slot in slots:
            self._last_use[slot] = decoding.pending
        (self._early_decoding if early else self._decoding).append(decoding)
        if self._on_decode is not None:
            self._on_decode(len(group), early)

    def _decode_on_thread(self, group: list[ChunkPlan], slots: list[int], codes: np.ndarray) -> _Decoding:
        """Queue the decode on the CPU's codec thread, behind the slots' set-ups (queued there first)."""
        assert self._thread is not None
        decoded = self._thread.submit(
            lambda: self.codec.decode(slots, upload(codes, torch.int64, self.device)).to(torch.float32, copy=True)
        )
        return _Decoding(group, decoded, decoded, time.perf_counter())

    def _decode_on_lane(
        self, group: list[ChunkPlan], slots: list[int], codes: np.ndarray, n_frames: int, early: bool
    ) -> _Decoding:
        with self._lane(early=early):
            stream = torch.cuda.current_stream() if self.device.type == "cuda" else None
            for plan in group:  # the slot's set-up (on the early lane) comes first
                ready = self._ready.pop(plan.request.request_id, None)
                if ready is not None and stream is not None and not early:
                    stream.wait_event(ready)
            device_slots, device_codes = upload_together([(slots, torch.int64), (codes, torch.int64)], self.device)
            graphs = self._early_graphs if early else self._graphs
            if graphs is not None and graphs.captured and graphs.can_decode(len(slots), n_frames):
                pcm = graphs.decode(device_slots, device_codes)
            else:
                pcm = self.codec.decode(device_slots, device_codes)
            host = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            host.copy_(pcm, non_blocking=True)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record()
            if early:
                self._early_lane_done = event
        return _Decoding(group, host, event)

    def finished(self) -> Iterator[tuple[ChunkPlan, np.ndarray]]:
        """Decoded chunks that are ready, oldest first per lane, the early lane emptied first."""
        for lane in (self._early_decoding, self._decoding):
            while lane:
                decoding = lane[0]
                if not _done(decoding.pending):
                    break
                lane.popleft()
                yield from zip(decoding.plans, decoding.host_pcm(), strict=True)

    def clear(self) -> None:
        """Forget decodes in flight and waiting (after a failed step: their requests have failed)."""
        self._decoding.clear()
        self._early_decoding.clear()
        self.queue.clear()
