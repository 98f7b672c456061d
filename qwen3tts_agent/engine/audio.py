"""The audio pipeline: codes to PCM with the exact streaming codec, beside the frame steps.

Decoding runs on CUDA streams of its own (when there is a GPU), so a large decode fills the gaps between
frame steps instead of delaying them: the codec lane runs at a lower priority than the steps. First chunks
take a lane of their own at the steps' priority (with graphs and scratch rows of its own), so a stream's
first audio never queues behind the long chunks of streams already playing; the codec lane waits for the
first lane's last decode, so a stream's later chunks follow its first.

Two things keep a new stream clear of the codec lane's queue:
- Codec slots are not engine slots. A request takes a codec slot whose last decode has completed, and
  sets it up (reset, or a cloned voice's primed state) on the first lane; it never waits for decodes of the
  slot's previous owner that may still sit in the codec lane's queue. There are twice as many codec slots
  as engine slots, so a finished one is always at hand.
- The codec lane holds at most `CODEC_LANE_DEPTH` decodes at a time. The rest wait on the host, where
  the next decode is chosen when the lane has room: the chunks whose deadlines come first (a stream's own
  chunks always in order), batched with every waiting chunk of the same length.

A decode's PCM is copied to pinned host memory and read once its event has fired, so the core polls
rather than waits.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..backends import create_codec
from .cuda_graphs import GraphedCodecDecode, power_of_two_buckets
from .host import upload
from .messages import PromptSpec
from .requests import ChunkPlan
from .scheduler import urgency

# Primed codec states kept per cloned voice (a few MB each), so a voice's reference codes are decoded once.
CODEC_STATE_CACHE = 64
# First chunks decoded together on the first-chunk lane (more in one frame take the codec lane).
FIRST_CHUNK_ROWS = 16
# Decodes queued on the codec lane at once; later ones wait on the host, most urgent first.
CODEC_LANE_DEPTH = 2


@dataclass
class _Decoding:
    plans: list[ChunkPlan]
    pcm: torch.Tensor  # [len(plans), samples] on the host
    event: torch.cuda.Event | None


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
        backend: str = "torch",
    ) -> None:
        self.device = device
        self._codec_stream: torch.cuda.Stream | None = None
        self._first_stream: torch.cuda.Stream | None = None
        if device.type == "cuda" and overlap:
            self._codec_stream = torch.cuda.Stream(device)
            if graphed:
                _, highest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a staticmethod, typed as a method
                self._first_stream = torch.cuda.Stream(device, priority=highest)
        first_rows = min(FIRST_CHUNK_ROWS, max_streams) if self._first_stream is not None else 0
        # live codec slots [0, 2M); with graphs, scratch rows above them pad a call up to its graph's batch
        live = 2 * max_streams
        self.codec = create_codec(decoder, backend, max_streams=live + (max_streams + first_rows if graphed else 0))
        self._free_slots = list(range(live))  # codec slots no request owns (their last decode may be pending)
        self._last_use: dict[int, torch.cuda.Event | None] = {}  # codec slot -> its last decode's event
        self._slot_of: dict[str, int] = {}  # request id -> its codec slot
        self._ready: dict[str, torch.cuda.Event | None] = {}  # request id -> its slot's set-up
        self._states: collections.OrderedDict[str, list[torch.Tensor]] = collections.OrderedDict()
        self._first_lane_done: torch.cuda.Event | None = None  # the last first-chunk decode
        self._waiting: list[ChunkPlan] = []  # codec-lane chunks not yet launched
        self._decoding: collections.deque[_Decoding] = collections.deque()
        self._first_decoding: collections.deque[_Decoding] = collections.deque()
        self._graphs: GraphedCodecDecode | None = None
        self._first_graphs: GraphedCodecDecode | None = None
        # chunk lengths one codec call decodes (one graph replay); other lengths run as several pieces
        self.decode_sizes: tuple[int, ...] = ()
        if graphed:
            schedule = set(chunk_schedule)
            self.decode_sizes = tuple(sorted(schedule | {1, 2, 4, 8}))
            self._graphs = GraphedCodecDecode(self.codec, live, power_of_two_buckets(max_streams), self.decode_sizes)
            if first_rows:
                self._first_graphs = GraphedCodecDecode(
                    self.codec, live + max_streams, power_of_two_buckets(first_rows), {min(schedule)}
                )

    def capture(self, progress: bool) -> None:
        """Capture the codec graphs of both lanes (on the thread that owns the device work)."""
        if self._graphs is not None:
            with self._lane():
                self._graphs.capture(progress=progress)
        if self._first_graphs is not None:
            with self._lane(first_chunks=True):
                self._first_graphs.capture(progress=progress)

    @property
    def busy(self) -> bool:
        return bool(self._decoding or self._first_decoding or self._waiting)

    @contextlib.contextmanager
    def _lane(self, first_chunks: bool = False) -> Iterator[None]:
        """Codec work runs on the codec lane (when there is one), in order, or on the first-chunk lane."""
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

    # ----------------------------------------------------------------- codec slots
    def start(self, request_id: str, spec: PromptSpec) -> None:
        """Give a request a codec slot and set it up: reset, or a cloned voice's primed reference codes."""
        slot = self._take_slot()
        self._slot_of[request_id] = slot
        with self._lane(first_chunks=self._first_stream is not None):
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
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self._ready[request_id] = ready
            self._last_use[slot] = ready

    def _take_slot(self) -> int:
        """The lowest free codec slot whose last decode has completed (waiting for one only if none has)."""
        for index, slot in enumerate(self._free_slots):
            event = self._last_use.get(slot)
            if event is None or event.query():
                return self._free_slots.pop(index)
        if not self._free_slots:
            raise RuntimeError("no free codec slot")  # cannot happen: twice as many as engine slots
        slot = self._free_slots.pop(0)
        event = self._last_use.get(slot)
        if event is not None:
            event.synchronize()
        return slot

    def drop(self, request_id: str) -> None:
        """The request ended: its waiting chunks are dropped and its codec slot goes back to the pool."""
        self._waiting = [plan for plan in self._waiting if plan.request.request_id != request_id]
        self._ready.pop(request_id, None)
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._free_slots.sort()

    # ----------------------------------------------------------------- decoding
    def decode(self, plans: Sequence[ChunkPlan], now: float) -> None:
        """Start decoding due chunks (most urgent first): first chunks on the first lane at once, the others
        on the codec lane as it has room."""
        firsts: dict[int, list[ChunkPlan]] = {}
        lane = self._first_graphs
        for plan in plans:
            if plan.is_first and lane is not None and lane.captured:
                firsts.setdefault(plan.n_frames, []).append(plan)
            else:
                self._waiting.append(plan)
        for n_frames, group in firsts.items():
            if lane.can_decode(len(group), n_frames):  # type: ignore[union-attr]
                self._decode(group, n_frames, first_lane=True)
            else:
                self._waiting.extend(group)
        self.pump(now)

    def pump(self, now: float) -> None:
        """Launch waiting codec-lane decodes while the lane has room: the most urgent eligible chunk's length,
        batched with every eligible chunk of that length (a chunk is eligible when no earlier chunk of its
        stream is still waiting)."""
        while self._waiting and self._lane_depth() < CODEC_LANE_DEPTH:
            eligible, seen = [], set()
            for plan in sorted(self._waiting, key=lambda p: urgency(p, now)):
                rid = plan.request.request_id
                if rid not in seen:
                    seen.add(rid)
                    eligible.append(plan)
            n_frames = eligible[0].n_frames
            limit = self._graphs.batch_buckets[-1] if self._graphs is not None else len(eligible)
            group = [plan for plan in eligible if plan.n_frames == n_frames][:limit]
            chosen = {id(plan) for plan in group}
            self._waiting = [plan for plan in self._waiting if id(plan) not in chosen]
            self._decode(group, n_frames, first_lane=False)

    def urgent(self, now: float, within_s: float) -> bool:
        """Whether a codec-lane chunk waiting or in flight is due within `within_s` (deadline-aware pacing)."""
        plans = self._waiting + [plan for decoding in self._decoding for plan in decoding.plans]
        for plan in plans:
            deadline = plan.request.deadline()
            if deadline is not None and deadline - now < within_s:
                return True
        return False

    def _lane_depth(self) -> int:
        """Decodes queued on the codec lane and not done (0 without a GPU: decodes there are synchronous)."""
        return sum(1 for d in self._decoding if d.event is not None and not d.event.query())

    def _decode(self, group: list[ChunkPlan], n_frames: int, first_lane: bool) -> None:
        slots = [self._slot_of[plan.request.request_id] for plan in group]
        with self._lane(first_chunks=first_lane):
            stream = torch.cuda.current_stream() if self.device.type == "cuda" else None
            for plan in group:  # the slot's set-up (on the first lane) comes first
                ready = self._ready.pop(plan.request.request_id, None)
                if ready is not None and stream is not None and not first_lane:
                    stream.wait_event(ready)
            codes = upload(np.stack([plan.codes for plan in group]), torch.int64, self.device)
            graphs = self._first_graphs if first_lane else self._graphs
            if graphs is not None and graphs.captured and graphs.can_decode(len(slots), n_frames):
                pcm = graphs.decode(slots, codes)
            else:
                pcm = self.codec.decode(slots, codes)
            host = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            host.copy_(pcm, non_blocking=True)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record()
            if first_lane:
                self._first_lane_done = event
        for slot in slots:
            self._last_use[slot] = event
        (self._first_decoding if first_lane else self._decoding).append(_Decoding(group, host, event))

    def finished(self) -> Iterator[tuple[ChunkPlan, np.ndarray]]:
        """Decoded chunks that are ready, oldest first per lane, the first-chunk lane emptied first."""
        for pending in (self._first_decoding, self._decoding):
            while pending:
                decoding = pending[0]
                if decoding.event is not None and not decoding.event.query():
                    break
                pending.popleft()
                yield from zip(decoding.plans, decoding.pcm.numpy(), strict=True)

    def clear(self) -> None:
        """Forget decodes in flight and waiting (after a failed step: their requests have failed)."""
        self._decoding.clear()
        self._first_decoding.clear()
        self._waiting.clear()
