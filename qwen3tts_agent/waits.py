"""Bounded waits that never swallow a cancel, on every Python the package supports (>= 3.10).

`asyncio.wait_for` on Python 3.10 and 3.11 returns the result instead of raising when a cancel of the waiting
task lands just as the awaited operation completes (CPython bpo-42130, fixed in 3.12). The task then runs on
as if it had never been cancelled, and whoever cancelled it and waits for it can wait forever: a WebSocket
session that a client closed the instant its `done` arrived stayed counted for good (issue 42).

`bounded` is `asyncio.timeout` where it exists (3.11+): the operation runs in the caller's task, so every
cancel reaches it and it cleans up as it would for any cancel. Python 3.10 has no way to tell a timeout's own
cancel from a caller's that lands at the same time, so there the operation runs as a task of its own under
`asyncio.wait`, which re-raises the caller's cancel; the operation is then cancelled, and a result it produced
anyway goes to `discard` (an acquired lock is released, not leaked). `cancel_and_wait` stops a task and waits
for it with a bound, so a task that ignores its cancel cannot hold up its owner (`cancel_all_and_wait`: several).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# asyncio.timeout (3.11+); None on 3.10, where `bounded` runs the operation as a task of its own
_timeout: Callable[[float], AbstractAsyncContextManager[None]] | None = getattr(asyncio, "timeout", None)

# How long `bounded` on 3.10 lets an operation it cancelled clean up before it returns anyway (the cleanup
# `asyncio.timeout` would run in the caller's task).
CANCEL_GRACE_S = 1.0


async def bounded(aw: Awaitable[T], timeout_s: float, *, discard: Callable[[T], object] | None = None) -> T:
    """`await aw` for at most `timeout_s`, then cancel it and raise the builtin `TimeoutError`.

    A cancel of the caller always propagates: it never becomes a result or a `TimeoutError`. `discard` takes a
    result that was produced but will not be returned (the caller was cancelled or timed out as it arrived),
    to undo it: e.g. `discard=lambda _: lock.release()` around `lock.acquire()`. Only Python 3.10 needs it;
    with `asyncio.timeout` an operation that completed is never cancelled afterwards.
    """
    if _timeout is not None:
        async with _timeout(timeout_s):
            return await aw
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:  # the caller's: stop the operation, then let the cancel go on
        await _abandon(task, discard)
        raise
    if task not in done:
        await _abandon(task, discard)
        raise TimeoutError(f"not done within {timeout_s:g}s")
    return task.result()


async def _abandon(task: asyncio.Future[T], discard: Callable[[T], object] | None) -> None:
    """Cancel an operation whose outcome nobody will take; a result it produces anyway goes to `discard`."""
    task.cancel()
    task.add_done_callback(partial(_settle, discard))
    await asyncio.wait({task}, timeout=CANCEL_GRACE_S)


def _settle(discard: Callable[[T], object] | None, task: asyncio.Future[T]) -> None:
    if task.cancelled():
        return
    error = task.exception()  # retrieved either way: nobody else will
    if error is not None:
        logger.debug("an abandoned operation failed: %r", error)
    elif discard is not None:
        discard(task.result())


async def cancel_and_wait(task: asyncio.Future[Any], timeout_s: float, what: str) -> bool:
    """Cancel `task` and wait up to `timeout_s` for it to end; True if it did, else a warning and False.

    The wait is `asyncio.wait`, which never swallows a cancel of the caller, and a task that swallows its own
    cancel (or cleans up forever) is left behind after `timeout_s` instead of holding its owner. An error the
    task ended with is logged here, as nobody else will look at it.
    """
    return await cancel_all_and_wait([task], timeout_s, what)


async def cancel_all_and_wait(tasks: Collection[asyncio.Future[Any]], timeout_s: float, what: str) -> bool:
    """`cancel_and_wait` for several tasks at once: every one is cancelled before the wait, so a cancel of the
    caller during it (which propagates) leaves none of them running uncancelled."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return True
    done, pending = await asyncio.wait(set(tasks), timeout=timeout_s)
    if pending:
        some = f" ({len(pending)} of {len(tasks)} tasks)" if len(tasks) > 1 else ""
        logger.warning("%s did not end within %gs of its cancel%s; left running", what, timeout_s, some)
    for task in done:
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("%s failed", what, exc_info=error)
    return not pending
