"""When the engine core queues its next frame step (`StepPacer`)."""

from __future__ import annotations

import math


class StepPacer:
    """When to queue the next frame step on the device.

    Queued too early, a step shuts out every request that arrives while the step ahead of it runs: a new
    stream's first frame then waits for two steps. Queued too late, the device idles between steps. The
    pacer queues the next step when the one in flight is expected to end within `margin_s`, from a moving
    average of the device time of past steps of the same batch bucket; until a bucket has been measured, and
    whenever nothing is in flight, it queues at once. At most `max_in_flight` steps are queued.

    The step clock. Steps queued back to back keep the device busy making audio far ahead of every listener,
    and a new stream's prompt, first frame and first chunk then queue behind that work. A paced step (the
    core decides which: `Scheduler.paced`) therefore also waits until `step_period_s` after the last batched
    step was queued, unless a stream's next chunk would then be late (`Scheduler.pace_release`): under load
    every stream runs at about `FRAME_SECONDS / step_period_s` times real time, and the device keeps room
    between steps for new streams (the core also holds a paced step while a new stream's first frame
    runs and its first chunk decodes, `StepLauncher._launch_step`). 0 turns the clock off.
    """

    def __init__(self, *, margin_s: float = 0.0008, max_in_flight: int = 2, step_period_s: float = 0.0) -> None:
        if step_period_s < 0:
            raise ValueError(f"step_period_s must not be negative, got {step_period_s}")
        self.margin_s = margin_s
        self.max_in_flight = max_in_flight
        self.step_period_s = step_period_s
        self._durations: dict[int, float] = {}  # batch bucket -> moving average of device seconds
        self._in_flight: list[tuple[int, float]] = []  # (bucket, queued at), oldest first
        self._last_batched = float("-inf")  # when the last batched step was queued (the clock's last tick)

    def may_launch(self, now: float) -> bool:
        if not self._in_flight:
            return True
        if len(self._in_flight) >= self.max_in_flight:
            return False
        end = self.expected_end()
        return end is None or now >= end - self.margin_s

    def clock_tick(self, period_s: float | None = None) -> float:
        """When the step clock lets a paced step go: `period_s` (by default `step_period_s`; shorter when slots run
        short, `Scheduler.clock_period`) after the last batched step."""
        return self._last_batched + (self.step_period_s if period_s is None else period_s)

    def launch_at(self) -> float:
        """When `may_launch` will let a step go, as far as is known now: infinity while every place in flight is
        taken or a queued bucket was never measured (it waits for a step to end)."""
        if not self._in_flight:
            return -math.inf
        end = self.expected_end()
        if len(self._in_flight) >= self.max_in_flight or end is None:
            return math.inf
        return end - self.margin_s

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

    def launched(self, bucket: int, now: float, *, batched: bool = True) -> None:
        """A step was queued; `batched`: a step of every runnable stream (a tick of the clock), not a step of
        new streams' first frames alone."""
        self._in_flight.append((bucket, now))
        if batched:
            self._last_batched = now

    def completed(self, device_seconds: float | None) -> None:
        """The oldest queued step finished, after `device_seconds` on the device (None: not measured)."""
        bucket, _ = self._in_flight.pop(0)
        if device_seconds is not None:
            average = self._durations.get(bucket)
            self._durations[bucket] = device_seconds if average is None else 0.8 * average + 0.2 * device_seconds

    def clear(self) -> None:
        self._in_flight.clear()
