"""Admission control: a fixed number of synthesis slots and a bounded, time-limited queue in front of them."""

from __future__ import annotations

import asyncio
import time

from ..waits import bounded
from .protocol import ApiError
from .workers import Count, LocalCount


class Admission:
    """Caps concurrent engine streams; past `capacity` at most `max_queued` callers wait, each `timeout_s` at most.

    Overload thus turns into a prompt "busy" error instead of unbounded queues (memory) or unbounded waits.
    The slots are this process's; `queue` counts the callers waiting, and under `serve --workers N` it is
    shared by every API worker, so `max_queued` bounds the whole server's queue.
    """

    def __init__(self, capacity: int, *, max_queued: int, timeout_s: float, queue: Count | None = None) -> None:
        self.capacity = capacity
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(capacity)
        self._queue = queue if queue is not None else LocalCount()

    @property
    def waiting(self) -> int:
        return self._queue.total

    async def acquire(self) -> float:
        """Take a slot; returns the seconds waited. Raises ApiError("busy") when the queue is full or too slow."""
        if not self._queue.try_add(self.max_queued if self._slots.locked() else None):
            raise ApiError(
                "busy",
                f"server busy: {self.capacity} streams active and {self.max_queued} waiting; retry shortly",
                reason="queue_full",
            )
        started = time.perf_counter()
        try:
            # not asyncio.wait_for: on Python 3.10/3.11 it can hand the slot to a caller that was cancelled, who then
            # runs on as if not; `bounded` raises the cancel, and a slot granted as it lands goes back
            await bounded(self._slots.acquire(), self.timeout_s, discard=lambda _: self._slots.release())
        except TimeoutError:
            raise ApiError(
                "busy", f"server busy: no synthesis slot became free within {self.timeout_s:g}s; retry shortly",
                reason="queue_timeout",
            ) from None
        finally:
            self._queue.remove()
        return time.perf_counter() - started

    def release(self) -> None:
        self._slots.release()
