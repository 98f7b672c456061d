"""How loaded the device is, from what the core reports (no tensors): batched steps' times and late chunks.

Two decisions rest on it. New streams are refused (`overloaded`, the engine's `busy`) while a batched step
takes too large a share of a frame's playing time, or while several chunks left after their listeners needed
them a moment ago: admitted streams keep their audio flowing rather than every stream starving a little.
And for `FIRST_FRAME_PAUSE_S` after a chunk left late, new streams take no first-frame slot
(`first_frames_paused`; `engine/scheduler/scheduler.py` says why).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from .requests import FRAME_SECONDS

# Refuse new streams while a step takes longer than a frame's duration divided by this...
MIN_STEP_RATE_OVER_REAL_TIME = 1.5
# ... or while at least LATE_CHUNKS_TO_SHED chunks left later than their deadlines within LATE_WINDOW_S.
LATE_WINDOW_S = 1.0
LATE_CHUNKS_TO_SHED = 3
# For this long after a chunk left late, new streams take no first-frame slot.
FIRST_FRAME_PAUSE_S = 2.0


@dataclass
class LoadStats:
    late_chunks: int = 0
    underrun_seconds: float = 0.0
    step_seconds: float = 0.0  # moving average of a batched step's time on the device


class DeviceLoad:
    """The batched steps' recent time and the chunks that left late."""

    def __init__(self) -> None:
        self.stats = LoadStats()
        self._late_at: collections.deque[float] = collections.deque()  # recent late deliveries
        self._last_late = -math.inf  # when a chunk last left late

    def record_step_time(self, seconds: float) -> None:
        """How long a batched step took on the device: steps near a frame's duration leave streams no headroom
        (`overloaded`), and a pressed stream's frames come one batched step each (`Scheduler.pace_release`).
        The core leaves out the first-frame slots' steps: a few rows, far quicker than a batched step beside
        them, they would make both figures too low under load."""
        ema = self.stats.step_seconds
        self.stats.step_seconds = seconds if ema == 0.0 else 0.9 * ema + 0.1 * seconds

    def on_delivered(self, deadline: float, now: float) -> None:
        """A chunk due at `deadline` left the core at `now`: book it if it left late."""
        if now > deadline:
            self._last_late = now
            self.stats.late_chunks += 1
            self.stats.underrun_seconds += now - deadline
            self._late_at.append(now)

    def overloaded(self, now: float) -> bool:
        """Whether new streams should be refused: steps are slow, or several chunks left late a moment ago."""
        while self._late_at and now - self._late_at[0] > LATE_WINDOW_S:
            self._late_at.popleft()
        slow = self.stats.step_seconds > FRAME_SECONDS / MIN_STEP_RATE_OVER_REAL_TIME
        return slow or len(self._late_at) >= LATE_CHUNKS_TO_SHED

    def first_frames_paused(self, now: float) -> bool:
        """Whether new streams skip the first-frame slots: a chunk left late less than FIRST_FRAME_PAUSE_S ago."""
        return now - self._last_late < FIRST_FRAME_PAUSE_S
