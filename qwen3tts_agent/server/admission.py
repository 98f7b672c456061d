"""Admission control: a fixed number of synthesis slots and a bounded, time-limited queue in front of them."""

from __future__ import annotations

import asyncio
import time

from .protocol import ApiError


class Admission:
    """Caps concurrent engine streams; past `capacity` at most `max_queued` callers wait, each `timeout_s` at most.

    Overload thus turns into a prompt "busy" error instead of unbounded queues (memory) or unbounded waits.
    """

    def __init__(self, capacity: int, *, max_queued: int, timeout_s: float) -> None:
        self.capacity = capacity
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(capacity)
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    async def acquire(self) -> float:
        """Take a slot; returns the seconds waited. Raises ApiError("busy") when the queue is full or too slow."""
        if self._slots.locked() and self._waiting >= self.max_queued:
            raise ApiError(
                "busy",
                f"server busy: {self.capacity} streams active and {self._waiting} waiting; retry shortly",
            )
        started = time.perf_counter()
        self._waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
            raise ApiError(
                "busy", f"server busy: no synthesis slot became free within {self.timeout_s:g}s; retry shortly"
            ) from None
        finally:
            self._waiting -= 1
        return time.perf_counter() - started

    def release(self) -> None:
        self._slots.release()
