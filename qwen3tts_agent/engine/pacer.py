"""When the engine core queues its next frame step (`StepPacer`)."""

from __future__ import annotations


class StepPacer:
    """When to queue the next frame step on the device.

    Queued too early, a step shuts out every request that arrives while the step ahead of it runs: a new
    stream's first frame then waits for two steps. Queued too late, the device idles between steps. The
    pacer queues the next step when the one in flight is expected to end within `margin_s`, from a moving
    average of the device time of past steps of the same batch bucket; until a bucket has been measured, and
    whenever nothing is in flight, it queues at once. At most `max_in_flight` steps are queued.
    """

    def __init__(self, *, margin_s: float = 0.0008, max_in_flight: int = 2) -> None:
        self.margin_s = margin_s
        self.max_in_flight = max_in_flight
        self._durations: dict[int, float] = {}  # batch bucket -> moving average of device seconds
        self._in_flight: list[tuple[int, float]] = []  # (bucket, queued at), oldest first

    def may_launch(self, now: float) -> bool:
        if not self._in_flight:
            return True
        if len(self._in_flight) >= self.max_in_flight:
            return False
        end = self.expected_end()
        return end is None or now >= end - self.margin_s

    def may_queue(self) -> bool:
        """Whether another step may be queued behind those in flight, whenever they end (a new stream's first
        frame goes right behind the step in flight, `Scheduler.first_frame_rows`)."""
        return len(self._in_flight) < self.max_in_flight

    def expected_end(self) -> float | None:
        """When the last queued step should finish; None if a queued bucket was never measured."""
        end = float("-inf")
        for bucket, queued_at in self._in_flight:
            duration = self._durations.get(bucket)
            if duration is None:
                return None
            end = max(end, queued_at) + duration
        return end

    def launched(self, bucket: int, now: float) -> None:
        self._in_flight.append((bucket, now))

    def completed(self, device_seconds: float | None) -> None:
        """The oldest queued step finished, after `device_seconds` on the device (None: not measured)."""
        bucket, _ = self._in_flight.pop(0)
        if device_seconds is not None:
            average = self._durations.get(bucket)
            self._durations[bucket] = device_seconds if average is None else 0.8 * average + 0.2 * device_seconds

    def clear(self) -> None:
        self._in_flight.clear()
