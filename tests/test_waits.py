"""`waits.bounded` and `waits.cancel_and_wait` (`cancel_all_and_wait`): bounded, and a cancel of the caller is never lost, in both of
`bounded`'s ways (`asyncio.timeout` on 3.11+, a task under `asyncio.wait` on 3.10, run here on this Python)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from qwen3tts_agent import waits
from qwen3tts_agent.waits import bounded, cancel_all_and_wait, cancel_and_wait


async def ignore_cancels_until(release: asyncio.Event) -> None:
    """A task that swallows every cancel until `release` is set."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue


@pytest.fixture(params=["asyncio.timeout", "task"])
def wait_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "task":
        monkeypatch.setattr(waits, "_timeout", None)
    return str(request.param)


async def test_a_cancel_landing_as_the_operation_completes_is_not_lost(wait_kind: str) -> None:
    """bpo-42130's interleaving: the caller is cancelled in the step where its operation completes, before
    the caller resumes. `asyncio.wait_for` on 3.10/3.11 returns the result and the caller runs on; here the
    caller ends cancelled, and the result is either returned (then the cancel lands at the caller's next
    await) or handed to `discard`, never dropped."""
    opened = asyncio.Event()
    returned: list[str] = []
    discarded: list[str] = []

    async def operation() -> str:
        await opened.wait()
        caller.cancel()  # lands now: the operation returns in this same step
        return "result"

    async def call() -> None:
        returned.append(await bounded(operation(), 10, discard=discarded.append))
        await asyncio.sleep(10)  # a caller whose cancel was swallowed waits here

    caller = asyncio.create_task(call())
    await asyncio.sleep(0)
    opened.set()
    done, _ = await asyncio.wait({caller}, timeout=2)
    assert caller in done and caller.cancelled()
    assert returned + discarded == ["result"]


async def test_a_slot_granted_as_the_caller_is_cancelled_goes_back(wait_kind: str) -> None:
    """A semaphore's last slot is freed and the waiting caller cancelled in the same step: the caller ends
    cancelled and the slot is free again (the semaphore's own cancel handling, or `discard` on 3.10)."""
    slots = asyncio.Semaphore(1)
    await slots.acquire()
    caller = asyncio.create_task(bounded(slots.acquire(), 10, discard=lambda _: slots.release()))
    await asyncio.sleep(0.01)  # waiting for the slot
    slots.release()
    caller.cancel()
    done, _ = await asyncio.wait({caller}, timeout=2)
    assert caller in done and caller.cancelled()
    await asyncio.sleep(0)  # `discard` runs as a done callback
    assert not slots.locked()


async def test_the_bound_cancels_the_operation_and_raises_timeout_error(wait_kind: str) -> None:
    stopped = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            stopped.set()

    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await bounded(forever(), 0.05)
    assert asyncio.get_running_loop().time() - started < 1.0
    assert stopped.is_set()  # cleaned up before `bounded` returned, as in the caller's own task
    assert await bounded(asyncio.sleep(0, "value"), 1.0) == "value"


async def test_cancel_and_wait_gives_up_on_a_task_that_ignores_its_cancel(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    polite = asyncio.create_task(asyncio.sleep(60))
    assert await cancel_and_wait(polite, 1.0, "polite") and polite.cancelled()

    task = asyncio.create_task(ignore_cancels_until(release))
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="qwen3tts_agent.waits"):
        started = asyncio.get_running_loop().time()
        assert not await cancel_and_wait(task, 0.1, "the stubborn task")
    assert 0.1 <= asyncio.get_running_loop().time() - started < 1.0
    assert "the stubborn task did not end within 0.1s of its cancel" in caplog.text
    release.set()
    await asyncio.wait({task}, timeout=1)
    assert task.done()


async def test_cancel_and_wait_passes_the_callers_own_cancel_on() -> None:
    release = asyncio.Event()

    task = asyncio.create_task(ignore_cancels_until(release))
    owner = asyncio.create_task(cancel_and_wait(task, 30, "the stubborn task"))
    await asyncio.sleep(0.01)
    owner.cancel()
    done, _ = await asyncio.wait({owner}, timeout=1)
    assert owner in done and owner.cancelled()
    release.set()
    await asyncio.wait({task}, timeout=1)


async def test_cancel_all_and_wait_cancels_every_task_before_a_cancel_of_the_caller_can_stop_it() -> None:
    """A caller cancelled while it waits (a LiveKit stream's teardown, cancelled again by the agent) propagates the
    cancel, and no task it was stopping is left uncancelled: every one was cancelled before the wait."""
    release = asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await release.wait()  # its clean-up outlasts the caller's patience

    tasks = [asyncio.create_task(slow_to_end()), asyncio.create_task(asyncio.sleep(60))]
    await asyncio.sleep(0)
    owner = asyncio.create_task(cancel_all_and_wait(tasks, 30, "two tasks"))
    await asyncio.sleep(0.01)
    owner.cancel()
    done, _ = await asyncio.wait({owner}, timeout=1)
    assert owner in done and owner.cancelled()
    assert tasks[1].cancelled() and not tasks[0].done()  # both cancelled; the first still cleaning up
    release.set()
    await asyncio.wait(tasks, timeout=1)
    assert all(task.cancelled() for task in tasks)


async def test_cancel_all_and_wait_says_how_many_tasks_were_left_running(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    tasks = [asyncio.create_task(ignore_cancels_until(release)), asyncio.create_task(asyncio.sleep(60))]
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="qwen3tts_agent.waits"):
        assert not await cancel_all_and_wait(tasks, 0.1, "a stream's tasks")
    assert "a stream's tasks did not end within 0.1s of its cancel (1 of 2 tasks)" in caplog.text
    assert tasks[1].cancelled()
    assert await cancel_all_and_wait([], 0.1, "nothing")
    release.set()
    await asyncio.wait({tasks[0]}, timeout=1)

