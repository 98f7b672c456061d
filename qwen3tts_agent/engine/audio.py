"""The audio pipeline: codes to PCM with the exact streaming codec, beside the frame steps.

Decoding runs on CUDA streams of its own (when there is a GPU), so a large decode fills the gaps between
frame steps instead of delaying them: the codec lane runs at a lower priority than the steps. First chunks
take a lane of their own at the steps' priority (with graphs and scratch slots of its own), so a stream's
first audio never queues behind the long chunks of streams already playing. Work on the codec lane waits
for the first lane's last decode, so a stream's later chunks (and its slot's next set-up) follow its first.

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

from .codec import StreamingCodecDecoder
from .cuda_graphs import GraphedCodecDecode, power_of_two_buckets
from .host import upload
from .prompt import PromptSpec
from .scheduler import ChunkPlan

# Primed codec states kept per cloned voice (a few MB each), so a voice's reference codes are decoded once.
CODEC_STATE_CACHE = 64
# First chunks decoded together on the first-chunk lane (more in one frame take the codec lane).
FIRST_CHUNK_ROWS = 16


@dataclass
class _Decoding:
    plans: list[ChunkPlan]
    pcm: torch.Tensor  # [len(plans), samples] on the host
    event: torch.cuda.Event | None

    @property
    def holds_first_audio(self) -> bool:
        return any(plan.is_first for plan in self.plans)


class AudioPipeline:
    """Streaming codec slots (one per engine slot, plus graph scratch slots) and the lanes that decode them."""

    def __init__(
        self,
        decoder: torch.nn.Module,
        *,
        device: torch.device,
        max_streams: int,
        chunk_schedule: Sequence[int],
        graphed: bool,
        overlap: bool,
    ) -> None:
        self.device = device
        self._codec_stream: torch.cuda.Stream | None = None
        self._first_stream: torch.cuda.Stream | None = None
        if device.type == "cuda" and overlap:
            self._codec_stream = torch.cuda.Stream(device)
            if graphed:
                _, highest = torch.cuda.Stream.priority_range()
                self._first_stream = torch.cuda.Stream(device, priority=highest)
        first_rows = min(FIRST_CHUNK_ROWS, max_streams) if self._first_stream is not None else 0
        # with graphs, the slots above max_streams are scratch rows that pad a call up to its graph's batch
        codec_slots = 2 * max_streams + first_rows if graphed else max_streams
        self.codec = StreamingCodecDecoder(decoder, max_streams=codec_slots)
        self._states: collections.OrderedDict[str, list[torch.Tensor]] = collections.OrderedDict()
        self._first_lane_done: torch.cuda.Event | None = None  # the last first-chunk decode
        self._decoding: collections.deque[_Decoding] = collections.deque()
        self._first_decoding: collections.deque[_Decoding] = collections.deque()
        self._graphs: GraphedCodecDecode | None = None
        self._first_graphs: GraphedCodecDecode | None = None
        if graphed:
            schedule = set(chunk_schedule)
            self._graphs = GraphedCodecDecode(
                self.codec, max_streams, power_of_two_buckets(max_streams), schedule | {1, 2, 4, 8}
            )
            if first_rows:
                self._first_graphs = GraphedCodecDecode(
                    self.codec, 2 * max_streams, power_of_two_buckets(first_rows), {min(schedule)}
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
        return bool(self._decoding or self._first_decoding)

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

    def start(self, slot: int, spec: PromptSpec) -> torch.cuda.Event | None:
        """Reset a slot's codec state; a cloned voice continues from its reference codes, decoded once.

        Returns an event after the set-up when first chunks have their own lane (which must wait for it).
        """
        with self._lane():
            clone = spec.clone
            if not spec.icl or clone is None:
                self.codec.reset(slot)
            elif (state := self._states.get(clone.voice_id)) is not None:
                self._states.move_to_end(clone.voice_id)
                self.codec.restore(slot, state)
            else:
                self.codec.reset(slot)
                ref_codes = upload(clone.ref_codes, torch.int64, self.device)  # type: ignore[arg-type]
                if self._graphs is not None and self._graphs.captured:
                    self._graphs.prime(slot, ref_codes)
                else:
                    self.codec.prime(slot, ref_codes)
                self._states[clone.voice_id] = self.codec.snapshot(slot)
                if len(self._states) > CODEC_STATE_CACHE:
                    self._states.popitem(last=False)
            if self._first_stream is None:
                return None
            ready = torch.cuda.Event()
            ready.record()
            return ready

    def decode(self, plans: Sequence[ChunkPlan], ready: dict[int, torch.cuda.Event | None]) -> None:
        """Decode chunks in batched calls, one per chunk length, in the order given (most urgent first).

        First chunks go to the first-chunk lane when its graphs fit them (waiting for their slot's set-up,
        `ready[slot]`); everything else to the codec lane.
        """
        groups: dict[tuple[int, bool], list[ChunkPlan]] = {}
        lane = self._first_graphs
        for plan in plans:
            first = plan.is_first and lane is not None and lane.captured
            groups.setdefault((plan.n_frames, first), []).append(plan)
        for (n_frames, first), group in groups.items():
            if first and not lane.can_decode(len(group), n_frames):  # type: ignore[union-attr]
                first = False
            self._decode(group, n_frames, first, ready)

    def _decode(
        self, group: list[ChunkPlan], n_frames: int, first_lane: bool, ready: dict[int, torch.cuda.Event | None]
    ) -> None:
        slots = [plan.slot for plan in group]
        with self._lane(first_chunks=first_lane):
            if first_lane:
                for slot in slots:
                    event = ready.get(slot)
                    if event is not None:
                        torch.cuda.current_stream().wait_event(event)
            codes = upload(np.stack([plan.codes for plan in group]), torch.int64, self.device)
            graphs = self._first_graphs if first_lane else self._graphs
            if graphs is not None and graphs.captured and graphs.can_decode(len(slots), n_frames):
                pcm = graphs.decode(slots, codes)
            else:
                pcm = self.codec.decode(slots, codes)
            host = torch.empty(pcm.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            host.copy_(pcm, non_blocking=True)
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            if first_lane:
                self._first_lane_done = event
        (self._first_decoding if first_lane else self._decoding).append(_Decoding(group, host, event))

    def finished(self, wait: bool) -> Iterator[tuple[ChunkPlan, np.ndarray]]:
        """Decoded chunks, oldest first per lane, the first-chunk lane emptied first.

        Blocks on the oldest decode only if `wait`; otherwise yields what is ready.
        """
        for pending in (self._first_decoding, self._decoding):
            while pending:
                decoding = pending[0]
                if decoding.event is not None and not decoding.event.query():
                    if not wait:
                        break
                    decoding.event.synchronize()
                pending.popleft()
                pcm = decoding.pcm.numpy()
                yield from zip(decoding.plans, pcm, strict=True)


    def clear(self) -> None:
        """Forget decodes in flight (after a failed step: their requests have failed)."""
        self._decoding.clear()
        self._first_decoding.clear()
