"""Which waiting chunks the codec lane decodes next, and when (`CodecQueue`; no tensors).

A graphed codec call has a fixed cost, the launch sequence of a few hundred small kernels, that a few chunks'
arithmetic barely adds to (docs/performance.md has the figures). Decoding each chunk the moment it is cut
would therefore spend the device on one-row calls, beside the frame steps. So the chunks of the codec lane
(every chunk but a stream's first, which has a lane of its own) wait on the host while their streams have
audio to spare, and go in batches:

- a chunk is *due* once its listener would run out of audio within `launch_slack_s`, once its stream has
  no audio out yet (no deadline to plan by), or once it has waited `hold_s`; a length's chunks are all due
  once every live stream has one waiting (nobody is left to wait for) or they make a good call
  (`good_batch`, at most `max_batch`): past some tens of chunks a call costs little more per frame than the
  largest, so waiting for more gains little, while a lane that stands idle as chunks wait out their hold
  falls behind under heavy load (docs/performance.md, "the codec hold at 80 req/s");
- a due chunk goes with every other waiting chunk of its length (a codec graph takes one length per call),
  most urgent first, up to `max_batch`. A stream's chunks go in order, so only each stream's earliest
  waiting chunk is eligible.

With `hold_s` = 0 every chunk is due at once: the lane decodes as soon as it has room, and a call batches
only what waited for room meanwhile (the behaviour before this queue).

A graphed call decodes a fixed batch (`batch_sizes`, its graphs' buckets), padding the rest: 11 chunks run the
16-row graph, whose cost grows with its rows. So while the lane is busy with an earlier call, a call takes the
most of its length's chunks that fill a bucket exactly (8 of 11) and leaves the least urgent rest to the next
call, which joins them with what comes meanwhile, unless one of them is due by its deadline (then the call pads
up as before). With the lane idle nothing is left behind: the chunks would only wait for nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence

from .requests import ChunkPlan, urgency


class CodecQueue:
    """Chunks waiting for the codec lane, oldest first; `next_batch` says which go now."""

    def __init__(
        self, *, max_batch: int, hold_s: float, launch_slack_s: float, good_batch: int | None = None,
        batch_sizes: Sequence[int] = (),
    ) -> None:
        """`good_batch`: waiting chunks of one length that go without waiting for more (default `max_batch`).
        `batch_sizes`: the batches a call decodes without padding (empty: any; module docstring)."""
        if max_batch < 1 or hold_s < 0 or launch_slack_s < 0 or (good_batch is not None and good_batch < 1):
            raise ValueError("max_batch and good_batch must be positive, hold_s and launch_slack_s not negative")
        if any(size < 1 for size in batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        self.max_batch = max_batch
        self.batch_sizes = sorted(set(batch_sizes))
        self.good_batch = min(max_batch, good_batch or max_batch)
        self.hold_s = hold_s
        self.launch_slack_s = launch_slack_s
        self._waiting: list[ChunkPlan] = []
        # While nothing was added, taken or ended: no chunk falls due before this time (the core asks every
        # turn of its loop, so a queue of hundreds must answer a wait in constant time).
        self._quiet_until = 0.0
        self._quiet_streams = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[ChunkPlan]:
        return iter(self._waiting)

    def add(self, plans: Iterable[ChunkPlan]) -> None:
        self._waiting.extend(plans)
        self._quiet_until = 0.0

    def drop(self, request_id: str) -> None:
        """Forget a request's waiting chunks (it ended)."""
        self._waiting = [plan for plan in self._waiting if plan.request.request_id != request_id]

    def clear(self) -> None:
        self._waiting.clear()

    def _falls_due(self, plan: ChunkPlan) -> float:
        """When a waiting chunk with a deadline falls due by the clock alone."""
        deadline = plan.request.deadline()
        hold_end = plan.planned_at + self.hold_s
        return hold_end if deadline is None else min(hold_end, deadline - self.launch_slack_s)

    def due(self, plan: ChunkPlan, now: float) -> bool:
        """Whether a waiting chunk should be decoded now rather than wait for others to batch with."""
        return now - plan.planned_at >= self.hold_s or self._pressed(plan, now)

    def _pressed(self, plan: ChunkPlan, now: float) -> bool:
        """Whether a chunk's listener runs out within the launch slack, or its stream has no audio out yet (no
        deadline to plan by): it goes in the next call, whatever it could batch with."""
        deadline = plan.request.deadline()
        return deadline is None or deadline - now < self.launch_slack_s

    def next_batch(self, now: float, streams: int, lane_busy: bool = False) -> list[ChunkPlan]:
        """Take the chunks to decode in one call now (all of one length), or none while every chunk may wait.
        `streams`: how many live streams may still cut chunks for this lane. `lane_busy`: an earlier call is
        still decoding, so chunks past a whole batch may wait for the next call (module docstring)."""
        if now < self._quiet_until and streams >= self._quiet_streams:
            return []  # fewer streams could complete a group of a length: so the check below runs again
        eligible: dict[str, ChunkPlan] = {}  # each stream's earliest waiting chunk
        for plan in self._waiting:
            eligible.setdefault(plan.request.request_id, plan)
        by_length: dict[int, list[ChunkPlan]] = {}
        for plan in eligible.values():
            by_length.setdefault(plan.n_frames, []).append(plan)
        full = min(self.good_batch, max(1, streams))
        due = [plan for plan in eligible.values() if self.due(plan, now)]
        due += [group[0] for group in by_length.values() if len(group) >= full]
        if not due:
            self._quiet_until = min(self._falls_due(plan) for plan in eligible.values())
            self._quiet_streams = streams
            return []
        self._quiet_until = 0.0
        lead = min(due, key=lambda plan: urgency(plan, now))
        group = sorted(by_length[lead.n_frames], key=lambda plan: urgency(plan, now))[: self.max_batch]
        if lane_busy:
            group = self._whole_batch(group, now)
        chosen = {id(plan) for plan in group}
        self._waiting = [plan for plan in self._waiting if id(plan) not in chosen]
        return group

    def _whole_batch(self, group: list[ChunkPlan], now: float) -> list[ChunkPlan]:
        """The most urgent chunks of `group` (most urgent first) that fill a batch size exactly, if the others
        may wait for the next call: none is due by its deadline (or has none yet). Else the whole group."""
        fits = bisect.bisect_right(self.batch_sizes, len(group))
        if not fits or self.batch_sizes[fits - 1] == len(group):
            return group
        size = self.batch_sizes[fits - 1]
        return group if any(self._pressed(plan, now) for plan in group[size:]) else group[:size]
