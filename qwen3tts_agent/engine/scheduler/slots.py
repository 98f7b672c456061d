"""The engine's stream slots (`SlotPool`): which rows of the batched step are free, and when a released one is.

A released slot may still be a live row of a step in flight, so it is reused only once that step has
completed: a new request's set-up (on the prompts' lane) then never races the old request's frame. The
pool counts the steps queued and completed to know (no tensors; `engine/scheduler/scheduler.py` drives it).
"""

from __future__ import annotations

import heapq


class SlotPool:
    """Free slots, lowest first, and released ones waiting for the last step that may hold them."""

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots))
        heapq.heapify(self._free)
        self._quarantine: list[tuple[int, int]] = []  # (last step that may hold it, slot)
        self.launched_steps = 0  # frame steps queued on the device
        self.completed_steps = 0  # ... and the last of them known to have completed

    def __bool__(self) -> bool:
        """Whether a slot is free now."""
        return bool(self._free)

    def take_lowest(self) -> int:
        return heapq.heappop(self._free)

    def lowest_free_from(self, low: int) -> int | None:
        """The lowest free slot at or above `low`, taken; None if there is none."""
        above = [slot for slot in self._free if slot >= low]
        if not above:
            return None
        slot = min(above)
        self._free.remove(slot)
        heapq.heapify(self._free)
        return slot

    def free_below(self, high: int) -> int:
        """How many free slots lie below `high`."""
        return sum(1 for slot in self._free if slot < high)

    def give_back(self, slot: int) -> None:
        """A slot nothing on the device can hold any more: free at once."""
        heapq.heappush(self._free, slot)

    def release(self, slot: int, last_step: int) -> None:
        """A slot whose request was a row of step `last_step` at the latest: free once that step has completed."""
        if last_step <= self.completed_steps:
            heapq.heappush(self._free, slot)
        else:
            self._quarantine.append((last_step, slot))

    def on_launched(self) -> int:
        """A step was queued; returns its sequence number."""
        self.launched_steps += 1
        return self.launched_steps

    def on_completed(self, seq: int) -> None:
        """Step `seq` (and every step before it) has completed: the slots it held are free."""
        self.completed_steps = max(self.completed_steps, seq)
        keep = []
        for last, slot in self._quarantine:
            if last <= self.completed_steps:
                heapq.heappush(self._free, slot)
            else:
                keep.append((last, slot))
        self._quarantine = keep
