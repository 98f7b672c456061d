"""Frame steps on the device: queued one behind another and read back once done (`FrameSteps`).

The core decides which rows step and when (its scheduler and pacer). This queues a step for those rows on
the device, as the CUDA graph of their batch and KV-length buckets (or the eager step where there are no
graphs), copies its codes and end flags to pinned host memory right behind it, and hands back the steps that
have completed, oldest first, with their device time from CUDA events. It never waits for the device: a
step is read once its event has fired. The active-row flags go up through pinned memory, and only when the
set of rows changes (a copy from pageable memory would wait for every step in flight).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..scheduler import RequestState
from .cuda_graphs import GraphedFrameStep
from .runner import ModelRunner

# Host buffers for the active flags and the results: one being read, and up to two steps queued.
HOST_BUFFERS = 3


@dataclass
class QueuedStep:
    seq: int  # the scheduler's sequence number of the step
    rows: list[RequestState]
    slots: list[int]  # each row's slot in this step (a row may move to another before the step is read)
    bucket: int  # the batch the device ran: rows [0, bucket)
    host: torch.Tensor  # pinned copy of the runner's frame_out: 16 codes, then the EOS flag, per slot
    started: torch.cuda.Event | None
    done: torch.cuda.Event | None  # None: the step ran synchronously (no device events)
    batched: bool = True  # every runnable row, not the first-frame slots alone

    def device_seconds(self) -> float | None:
        if self.started is None or self.done is None:
            return None
        return self.started.elapsed_time(self.done) / 1000


class FrameSteps:
    """The frame steps queued on the device, oldest first."""

    def __init__(self, runner: ModelRunner, graphs: GraphedFrameStep | None, device: torch.device, max_slots: int) -> None:
        self.runner = runner
        self.graphs = graphs
        # a GPU's steps run after `queue` returns, read back once their end event fires; a CPU's run within it
        self.asynchronous = device.type == "cuda"
        width = runner.num_groups + 1
        pin = self.asynchronous
        self._host_out = [torch.zeros(max_slots, width, dtype=torch.int64, pin_memory=pin) for _ in range(HOST_BUFFERS)]
        self._host_active = [torch.zeros(max_slots, dtype=torch.bool, pin_memory=pin) for _ in range(HOST_BUFFERS)]
        self._active_slots: list[int] | None = None  # the slots `runner.active` holds, so unchanged ones aren't re-sent
        self._index = 0
        self._queued: collections.deque[QueuedStep] = collections.deque()

    def __len__(self) -> int:
        return len(self._queued)

    def queue(
        self, seq: int, rows: list[RequestState], slots: list[int], kv_len: int,
        sampling: Callable[[int], tuple[bool, bool]], *, batched: bool = True,
    ) -> QueuedStep:
        """Queue one frame for `rows` at `slots`: rows [0, highest slot] of the slot tables step, the others
        inactive. `sampling(b)` says whether any row below `b` samples its talker and its predictor codes (the
        eager step's shortcut for greedy decoding; the graphs sample per row). `batched`: a step of every
        runnable row, not the first-frame slots alone."""
        runner = self.runner
        ordered = sorted(slots)
        b = ordered[-1] + 1
        index = self._index
        self._index = (index + 1) % HOST_BUFFERS
        if ordered != self._active_slots:
            active = self._host_active[index].numpy()  # the pinned buffer itself: one write, not an op per row
            active[:] = False
            active[ordered] = True
            runner.active.copy_(self._host_active[index], non_blocking=True)
            self._active_slots = ordered
        started = done = None
        if self.asynchronous:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        if self.graphs is not None and self.graphs.captured:
            b, kv_len = self.graphs.bucket(b, kv_len)
            self.graphs(b, kv_len)
        else:
            talker, predictor = sampling(b)
            runner.frame_step(b, kv_len, talker_sampling=talker, predictor_sampling=predictor)
        host = self._host_out[index]
        host[:b].copy_(runner.frame_out[:b], non_blocking=True)
        if started is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        step = QueuedStep(seq, rows, slots, b, host, started, done, batched)
        self._queued.append(step)
        return step

    def completed(self) -> Iterator[QueuedStep]:
        """The steps that have completed on the device, oldest first, each taken off the queue."""
        while self._queued and (self._queued[0].done is None or self._queued[0].done.query()):
            yield self._queued.popleft()

    def clear(self) -> None:
        """Forget the steps queued (after a failed step: their requests have failed)."""
        self._queued.clear()
