"""How loaded the device is now, from what the core reports (no tensors): batched steps' times and late chunks.

Two decisions rest on it. New streams are refused (the engine's `busy`) while the batched steps of the last
`STEP_WINDOW_S` took, on average, too large a share of a frame's playing time (`slow_steps`); and while several
chunks left after their listeners needed them within the last `LATE_WINDOW_S` (`late_chunks`), the scheduler
lowers the number of streams it takes on (`stream_limit.StreamLimit`): admitted streams keep their audio flowing
rather than every stream starving a little. And for `FIRST_FRAME_PAUSE_S` after a chunk left late, new streams
take no first-frame slot (`first_frames_paused`; `engine/scheduler/scheduler.py` says why).

What counts as late for these decisions may leave a tolerance (`shed_lateness_s`): a chunk that left a few ms after
its deadline is still counted (`stats`, the metrics) but, below the tolerance, is no evidence. A listener with any
buffer of its own does not hear it, and near the device's capacity a few such chunks a second otherwise refuse
streams that would have played without a gap (docs/performance.md, "capacity 70 req/s").

Refusal is a statement about load now, so every piece of evidence fades with time, not with steps: a single
long step (a first Triton compile for new shapes, a graph capture, a stall) counts for `STEP_WINDOW_S` after
it ended and then not at all, whether or not steps ran since. (A moving average over steps never forgot one:
with nothing stepping, an engine refused every stream from then on.) An engine with no stream live admits
whatever this evidence says (`Scheduler.overloaded`).

The core's thread records; callers' threads read (admission, stats): a lock keeps the two apart.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from .requests import FRAME_SECONDS

# Refuse new streams while the recent batched steps took longer, on average, than a frame's duration divided by
# this...
MIN_STEP_RATE_OVER_REAL_TIME = 1.5
# ... the steps that ended within this many seconds (none: no evidence, the device is not slow) ...
STEP_WINDOW_S = 1.0
# Late chunks are evidence of load while at least LATE_CHUNKS_TO_SHED left later than their deadlines within
# LATE_WINDOW_S (the scheduler then takes on fewer streams).
LATE_WINDOW_S = 1.0
LATE_CHUNKS_TO_SHED = 3
# For this long after a chunk left late, new streams take no first-frame slot.
FIRST_FRAME_PAUSE_S = 2.0
# The refusal reasons the evidence gives (`Scheduler.refusal_reason`; counted in the server's metrics).
SLOW_STEPS = "slow_steps"
LATE_CHUNKS = "late_chunks"


# Late chunks are also counted by their place in their stream (`LoadStats.late_by_index`): with the default chunk
# schedule the second and third chunks have little audio ahead of them, later ones seconds of it, so the split
# tells a device too slow for new streams' early chunks from a codec lane that falls behind.
LATE_INDEX_KEYS = ("1", "2", "3", "4+")


# ... and by why: "frames" when its frames were not all made (the chunk not cut) before it was due, the step pace's
# share; "decode" when it was cut in time but its audio left late, the codec lane's (hold, queue, call, delivery).
LATE_CAUSES = ("frames", "decode")


def late_cause(due: float, cut_at: float) -> str:
    """A late chunk's `LATE_CAUSES` key: "frames" when it was cut (its frames all made) at or after it was due."""
    return "frames" if cut_at >= due else "decode"


class LateChunk(NamedTuple):
    """A chunk that left after its listener needed it (`Scheduler.on_delivered`; the core logs its story:
    `engine/core/late_trace.py`). Times are `time.perf_counter()`."""

    request_id: str
    chunk_index: int  # its place in its stream (1: the second chunk)
    frames: int
    first_audio: float
    due: float
    cut_at: float  # when its frames were all made and it went to the codec lane
    left_at: float

    @property
    def cause(self) -> str:
        return late_cause(self.due, self.cut_at)


def late_index_key(chunk_index: int) -> str:
    """The `late_by_index` key of a stream's chunk `chunk_index` (0 is its first, which has no deadline)."""
    return LATE_INDEX_KEYS[max(1, min(chunk_index, len(LATE_INDEX_KEYS))) - 1]


@dataclass
class LoadStats:
    late_chunks: int = 0
    underrun_seconds: float = 0.0
    late_by_index: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LATE_INDEX_KEYS, 0))
    late_by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LATE_CAUSES, 0))


class DeviceLoad:
    """The batched steps' recent times and the chunks that left late, each kept for a while after it happened."""

    def __init__(self, shed_lateness_s: float = 0.0) -> None:
        """`shed_lateness_s`: how late a chunk must leave to count as evidence (refusals, first-frame pauses);
        0: any lateness does. Every late chunk is counted in `stats` either way."""
        if shed_lateness_s < 0:
            raise ValueError(f"shed_lateness_s must not be negative, got {shed_lateness_s}")
        self.shed_lateness_s = shed_lateness_s
        self.stats = LoadStats()
        self._lock = threading.Lock()
        self._steps: collections.deque[tuple[float, float]] = collections.deque()  # (ended at, seconds), oldest first
        self._step_total = 0.0  # the seconds in `_steps`
        self._late_at: collections.deque[float] = collections.deque()  # recent late deliveries
        self._last_late = -math.inf  # when a chunk last left late

    def record_step_time(self, seconds: float, now: float) -> None:
        """A batched step that ended at `now` took `seconds` on the device: steps near a frame's duration leave
        streams no headroom (`slow_steps`), and a pressed stream's frames come one batched step each
        (`Scheduler.pace_release`). The core leaves out the first-frame slots' steps: a few rows, far quicker
        than a batched step beside them, they would make both figures too low under load."""
        with self._lock:
            self._steps.append((now, seconds))
            self._step_total += seconds
            self._forget_steps(now)

    def step_seconds(self, now: float) -> float:
        """The mean time of the batched steps that ended within `STEP_WINDOW_S` before `now`; 0.0 if none did
        (nothing recent to go by)."""
        with self._lock:
            self._forget_steps(now)
            return self._step_total / len(self._steps) if self._steps else 0.0

    def _forget_steps(self, now: float) -> None:
        while self._steps and now - self._steps[0][0] > STEP_WINDOW_S:
            self._step_total -= self._steps.popleft()[1]
        if not self._steps:
            self._step_total = 0.0  # no rounding left over from the subtractions

    def on_delivered(self, deadline: float, now: float, chunk_index: int, cut_at: float) -> bool:
        """A stream's chunk `chunk_index` (1 or more: the first has no deadline), due at `deadline` and cut (its
        frames all made) at `cut_at`, left the core at `now`: book it if it left late, and keep it as evidence if
        it left more than `shed_lateness_s` late. Whether it is evidence."""
        if now <= deadline:
            return False
        with self._lock:
            self.stats.late_chunks += 1
            self.stats.late_by_index[late_index_key(chunk_index)] += 1
            self.stats.late_by_cause[late_cause(deadline, cut_at)] += 1
            self.stats.underrun_seconds += now - deadline
            if now - deadline <= self.shed_lateness_s:
                return False
            self._last_late = now
            self._late_at.append(now)
            return True

    def slow_steps(self, now: float) -> bool:
        """Whether the batched steps of the last `STEP_WINDOW_S` took too large a share of a frame's time."""
        return self.step_seconds(now) > FRAME_SECONDS / MIN_STEP_RATE_OVER_REAL_TIME

    def late_chunks(self, now: float) -> bool:
        """Whether `LATE_CHUNKS_TO_SHED` chunks or more left late (past the tolerance) within `LATE_WINDOW_S`."""
        with self._lock:
            while self._late_at and now - self._late_at[0] > LATE_WINDOW_S:
                self._late_at.popleft()
            return len(self._late_at) >= LATE_CHUNKS_TO_SHED

    def first_frames_paused(self, now: float) -> bool:
        """Whether new streams skip the first-frame slots: a chunk left late (past the tolerance) less than
        FIRST_FRAME_PAUSE_S ago."""
        return now - self._last_late < FIRST_FRAME_PAUSE_S
