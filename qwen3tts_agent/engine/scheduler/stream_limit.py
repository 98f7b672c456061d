"""How many streams an engine takes on while its chunks leave late (`StreamLimit`): no tensors, no locks.

Late chunks are evidence that the device carries more streams than it can keep on time. The rule before this one
refused every new stream while the evidence lasted (a second): the streams live then ran out one by one, the
device emptied, and when the evidence faded a second's arrivals came in at once, their early chunks late together,
and the device refused again. Above its capacity such an engine served fewer streams the more were offered (the
measurements: docs/engine.md, "Refusing new streams").

Instead the evidence lowers a limit on the streams holding or waiting for a slot, to `BACKOFF` times those there
when it came (multiplicative decrease), at most once per `CUT_INTERVAL_S` while chunks keep leaving late (one
excess makes several chunks late over a few frames: one cut, not one per chunk). From `HOLD_S` after its last cut
the limit grows back as TCP CUBIC's window does: a cubic in the time since, flat around the streams there at the
cut (the load the device last fell behind at, where it is probed carefully) and steep away from it, up to every
slot, where it is off. A cut near the device's capacity thus regrows slowly past it, and one that a burst set off
with few streams there (a low limit, nothing to do with the device's capacity) climbs back to every slot within
seconds rather than at a fixed rate for many. Admission follows the streams the device keeps on time: a new stream
comes in as one leaves, not in a burst, and the device stays full. The limit is a function of time since its last
cut, so that readers on other threads (admission, stats) compute it without the core's thread ever ticking it.
"""

from __future__ import annotations

# After late chunks, the limit: this fraction of the streams then holding or waiting for a slot ...
BACKOFF = 0.9
# ... cut again, while chunks keep leaving late, at most this often ...
CUT_INTERVAL_S = 0.5
# ... and held for this long after a cut (the chunks of streams admitted just before it are due within it) ...
HOLD_S = 0.5
# ... then regrown along a cubic of the seconds since (CUBIC's `C`), scaled by the slots: streams per second cubed
# per slot. With 224 slots a cut at 26 streams is back at every slot 4.9 s after it, one at 200 in 3.9 s.
CUBIC_SCALE = 0.02


class StreamLimit:
    """A limit on the streams holding or waiting for a slot, cut by late chunks and regrown with time."""

    def __init__(self, max_slots: int) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        self.max_slots = max_slots
        self._growth = CUBIC_SCALE * max_slots  # CUBIC's `C`: streams per second cubed
        self._peak = float(max_slots)  # the streams there at the last cut (CUBIC's W_max)
        self._cut_to = float(max_slots)  # the limit's value at its last cut
        self._plateau_s = 0.0  # CUBIC's `K`: seconds of growth (after `HOLD_S`) from the cut back to the peak
        self._cut_at = float("-inf")  # when that was (never: no limit below the slots)
        self.cuts = 0  # how many times late chunks lowered it (stats)
        self._limited_before = 0.0  # seconds the limit was below the slots before its last cut (stats)

    def limit(self, now: float) -> float:
        """The streams that may hold or wait for a slot at `now` (the slots, unless a recent cut says fewer)."""
        grown_s = now - self._cut_at - HOLD_S
        if grown_s <= 0:
            return min(float(self.max_slots), self._cut_to)
        return min(float(self.max_slots), self._peak + self._growth * (grown_s - self._plateau_s) ** 3)

    def limited_seconds(self, now: float) -> float:
        """Seconds the limit has spent below the slots up to `now`, all cuts together (stats): with `cuts`, how
        much admission one cut cost."""
        return self._limited_before + self._limited_since_cut(now)

    def _limited_since_cut(self, now: float) -> float:
        """The last cut's seconds below the slots, up to `now` (`limit`'s growth, solved for every slot)."""
        if self.cuts == 0 or self._cut_to >= self.max_slots:  # never cut, or one slot "cut" to one
            return 0.0
        regrowth_s = self._plateau_s + ((self.max_slots - self._peak) / self._growth) ** (1 / 3)
        regrown_at = self._cut_at + HOLD_S + regrowth_s
        return max(0.0, min(now, regrown_at) - self._cut_at)  # 0 for a `now` read before the cut (another thread)

    def on_late(self, streams: int, now: float) -> bool:
        """Chunks left late with `streams` holding or waiting for a slot: cut the limit to `BACKOFF` of those
        (or of the limit, where that is lower), unless it was cut within `CUT_INTERVAL_S`. Whether it was cut.
        It never goes below one stream."""
        if now - self._cut_at < CUT_INTERVAL_S:
            return False
        self._limited_before += self._limited_since_cut(now)  # the last cut's time below the slots, up to this one
        self._peak = max(1.0, min(float(streams), self.limit(now)))
        self._cut_to = max(1.0, BACKOFF * self._peak)
        self._plateau_s = ((self._peak - self._cut_to) / self._growth) ** (1 / 3)
        self._cut_at = now
        self.cuts += 1
        return True

    def refuses(self, streams: int, now: float) -> bool:
        """Whether a new stream would take the engine past the limit, with `streams` there already. Back at
        every slot the limit is off: requests may then wait for a slot (`Scheduler.slot_wait` bounds that)."""
        limit = self.limit(now)
        return limit < self.max_slots and streams + 1 > limit
