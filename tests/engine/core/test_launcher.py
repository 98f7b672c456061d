"""`StepLauncher` with steps that stay in flight, as a GPU's do: new streams' first frames take a place in flight
only while no older stream's next chunk needs the batched step.

A CPU runs each step before `queue` returns, so two steps are never in flight there and the case cannot arise
in an engine on this machine; the device's parts are stood in for here (steps that stay queued until read, no
audio in flight), and the scheduler, the pacer and the launcher are the engine's own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from qwen3tts_agent.engine.core.config import CoreStats
from qwen3tts_agent.engine.core.late_trace import LateChunkTrace
from qwen3tts_agent.engine.core.launcher import GAP_LOOP, GAP_READ, StepLauncher
from qwen3tts_agent.engine.runner.steps import QueuedStep
from qwen3tts_agent.engine.scheduler import RequestState, Scheduler, StepPacer
from tests.engine.scheduler.test_scheduler import _under_load, make_request, make_scheduler, start


class NeverDone:
    """A step's end event on a device that is still running it."""

    def query(self) -> bool:
        return False


class StepsInFlight:
    """`FrameSteps` without a device: every step queued stays in flight (none completes during the test)."""

    asynchronous = True  # a GPU's steps: they run after `queue` returns

    def __init__(self) -> None:
        self.queued: list[QueuedStep] = []

    def queue(
        self, seq: int, rows: list[Any], slots: list[int], kv_len: int, sampling: Any, *, batched: bool = True
    ) -> QueuedStep:
        step = QueuedStep(seq, rows, slots, max(slots) + 1, torch.zeros(0), None, NeverDone(), batched)  # type: ignore[arg-type]
        self.queued.append(step)
        return step

    def completed(self) -> Iterator[QueuedStep]:
        return iter(())


class NoAudioInFlight:
    """The audio pipeline's answers to the launcher when no chunk is decoding."""

    def urgent(self, now: float, within_s: float) -> bool:
        return False

    def first_audio_in_flight(self) -> bool:
        return False

    def wait_for_first_audio(self, timeout_s: float, older_than_s: float) -> bool:
        return False


class NoRunner:
    def move_slot(self, src: int, dst: int, positions: int, text_tokens: int) -> None:
        pass


@pytest.mark.parametrize("pressed", [False, True], ids=["older_streams_with_slack", "an_older_chunk_due"])
def test_a_new_streams_first_frame_waits_for_the_batched_step_only_when_an_older_chunk_needs_it(pressed: bool) -> None:
    """Two new streams arrive one after the other while two older ones play. The first's frame goes in a step of
    its own; the second's goes right behind it (both places in flight taken) while the older streams have slack.
    Once an older stream's next chunk needs a frame now, the second's first frame waits and the batched step
    takes that place (before, a burst's first-frame steps kept both places for 174 ms: chunks left late)."""
    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2)
    _, older = _under_load(scheduler)
    steps = StepsInFlight()
    launcher = StepLauncher(
        scheduler, NoRunner(), steps, StepPacer(step_period_s=0.02), NoAudioInFlight(),  # type: ignore[arg-type]
        CoreStats(), {}, LateChunkTrace(),
    )
    now = time.perf_counter()
    for r in older:  # one 1-frame chunk heard; the next due 0.3 s on (`pressed`) or 10 s on
        r.first_audio, r.delivered_frames = now + (0.22 if pressed else 10.0), 1
    first, second = make_request("first"), make_request("second")
    start(scheduler, first, [5, 6], now=now)
    assert first.slot == 0
    launcher.launch()
    assert [(s.batched, s.rows) for s in steps.queued] == [(False, [first])]
    release = scheduler.pace_release(scheduler.runnable(), time.perf_counter(), 0.02)
    assert release > time.perf_counter()  # the older streams' chunks could still wait for a batched step
    if pressed:  # until they cannot
        time.sleep(max(0.0, release - time.perf_counter()) + 0.001)
    start(scheduler, second, [5, 6], now=time.perf_counter())
    assert second.slot == 1 and scheduler.first_frame_rows(time.perf_counter(), 0.02) == [second]
    launcher.launch()
    assert len(steps.queued) == 2  # both places in flight are taken
    last = steps.queued[-1]
    if pressed:
        assert last.batched and set(older) <= set(last.rows) and second in last.rows
    else:
        assert not last.batched and last.rows == [second]


class DeviceEvent:
    """A CUDA event's answers for a step the device ran at `at` (seconds)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: DeviceEvent) -> float:
        return (end.at - self.at) * 1000


class StepsThatEnd(StepsInFlight):
    """Steps that end when the test says, each after `DEVICE_S` on the device. `asynchronous` False: the launcher
    takes them for a CPU's (run within `queue`), and looks at launching the next only when asked."""

    DEVICE_S = 0.004

    def __init__(self, slots: int, *, asynchronous: bool = True) -> None:
        super().__init__()
        self.slots = slots
        self.asynchronous = asynchronous
        self.ended: list[QueuedStep] = []
        self.calls: list[str] = []  # "step" for each step queued (and the audio stand-in's calls beside)

    def queue(
        self, seq: int, rows: list[Any], slots: list[int], kv_len: int, sampling: Any, *, batched: bool = True
    ) -> QueuedStep:
        host = torch.zeros(self.slots, 17, dtype=torch.int64)  # 16 codes, no end flag, per slot
        step = QueuedStep(seq, rows, slots, self.slots, host, DeviceEvent(0.0), DeviceEvent(self.DEVICE_S), batched)  # type: ignore[arg-type]
        self.queued.append(step)
        self.calls.append("step")
        return step

    def end_all(self) -> None:
        self.ended, self.queued = self.ended + self.queued, []

    def completed(self) -> Iterator[QueuedStep]:
        ended, self.ended = self.ended, []
        return iter(ended)


class AudioCalls(NoAudioInFlight):
    """Decodes nothing; notes the launcher's calls that start decodes in `calls` (the steps' list, beside theirs)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def enqueue(self, plans: Any) -> None:
        self.calls.append("enqueue " + ",".join(f"{p.request.request_id}#{p.index}" for p in plans))

    def pump(self, now: float, streams: int) -> bool:
        self.calls.append("pump")
        return False


def two_streams_stepping(
    pacer: StepPacer, *, asynchronous: bool = True, pace_load: int = 0
) -> tuple[Scheduler, list[RequestState], StepsThatEnd, CoreStats, StepLauncher]:
    """Two streams whose prompts are done, a launcher over steps that end when the test says, and its counters."""
    scheduler = make_scheduler(max_slots=8, pace_load=pace_load)
    rows = [make_request(f"r{i}", max_frames=1000) for i in range(2)]
    for r in rows:
        start(scheduler, r, [5, 6])
    steps = StepsThatEnd(slots=8, asynchronous=asynchronous)
    stats = CoreStats()
    launcher = StepLauncher(
        scheduler, NoRunner(), steps, pacer, AudioCalls(steps.calls),  # type: ignore[arg-type]
        stats, {}, LateChunkTrace(),
    )
    return scheduler, rows, steps, stats, launcher


def test_a_batched_steps_time_is_split_into_device_in_flight_and_the_gap_before_the_next() -> None:
    """`CoreStats.timed_steps` and the seconds beside it, with steps that end as a GPU's do: a step read back
    30 ms after it was queued spent its 4 ms of device time and 26 more in flight; the next, queued 20 ms after
    that read, follows a 20 ms gap; a step queued while another is in flight follows none. (Looks only when asked:
    the look right after a read is the next test's.)"""
    _, _, steps, stats, launcher = two_streams_stepping(StepPacer(), asynchronous=False)
    assert launcher.launch() and len(steps.queued) == 1
    time.sleep(0.03)
    steps.end_all()
    assert launcher.collect()
    assert stats.timed_steps == 1 and stats.step_device_seconds == pytest.approx(StepsThatEnd.DEVICE_S)
    assert 0.03 <= stats.step_flight_seconds < 1.0
    assert stats.step_gap_seconds == 0.0
    time.sleep(0.02)
    assert launcher.launch()
    assert 0.02 <= stats.step_gap_seconds < 1.0 and stats.steps_overlapped == 0
    gap = stats.step_gap_seconds
    time.sleep(0.005)  # the pacer queues the next once the one in flight is due to end (its 4 ms)
    assert launcher.launch() and len(steps.queued) == 2  # queued behind the one in flight: no gap
    assert stats.steps_overlapped == 1
    steps.end_all()
    launcher.collect()
    assert stats.timed_steps == 3 and stats.step_gap_seconds == gap


def test_the_gap_before_a_batched_step_is_charged_to_what_held_it() -> None:
    """`CoreStats.step_gap_by_hold`: a step read back while its streams run far ahead of their listeners waits for
    the step clock's tick; the rest of the read up to its first look is charged to the read, the wait to the clock
    up to the tick, the looks after it to the loop, and the charges add up to the whole gap."""
    pacer = StepPacer(step_period_s=0.05)
    scheduler, _, steps, stats, launcher = two_streams_stepping(pacer, pace_load=1)
    assert launcher.launch()  # the streams' first frames: not paced
    steps.end_all()
    read = time.perf_counter()
    assert launcher.collect()  # and its look right after the read: held by the clock
    tick = pacer.clock_tick()
    assert scheduler.paced(scheduler.runnable()) and tick > read
    looks = 0
    while not launcher.launch():  # the loop looks again and again until the tick
        looks += 1
        time.sleep(0.002)
    queued = time.perf_counter()
    assert looks >= 5 and set(stats.step_gap_by_hold) <= {GAP_READ, "clock", GAP_LOOP}
    assert sum(stats.step_gap_by_hold.values()) == pytest.approx(stats.step_gap_seconds)
    assert 0 < stats.step_gap_by_hold[GAP_READ] < 0.2 * (tick - read)  # the bookkeeping of one frame of two rows
    assert 0.5 * (tick - read) < stats.step_gap_by_hold["clock"] <= tick - read + 1e-9  # charged up to the tick only
    assert queued >= tick


@pytest.mark.parametrize("asynchronous", [True, False], ids=["gpu_steps", "cpu_steps"])
def test_a_step_read_back_on_a_gpu_is_followed_by_the_next_at_once(asynchronous: bool) -> None:
    """On a GPU, reading a step back is followed by a look at launching the next: its streams can step again, so
    it is queued within `collect`, with no gap, instead of after the loop's delivery and prompt work. A CPU's step
    ran within `launch`; there `collect` queues nothing and the loop's next look queues the step."""
    _, rows, steps, stats, launcher = two_streams_stepping(StepPacer(), asynchronous=asynchronous)
    assert launcher.launch()
    steps.end_all()
    assert launcher.collect()
    if asynchronous:
        assert [step.rows for step in steps.queued] == [rows] and steps.queued[0].batched
        assert stats.steps == 2 and stats.step_gap_seconds < 0.005
    else:
        assert steps.queued == [] and stats.steps == 1
        assert launcher.launch() and len(steps.queued) == 1


@pytest.mark.parametrize("asynchronous", [True, False], ids=["gpu_steps", "cpu_steps"])
def test_a_step_read_back_on_a_gpu_is_queued_before_the_codec_lanes_calls_for_its_chunks(asynchronous: bool) -> None:
    """The chunks a step completed join the codec's queue (a new stream's first two chunks start on the early lane
    there and then), the next step is queued, and only then does the codec lane get its calls (`pump`): their host
    work no longer delays the step. A CPU's step ran within `launch`: `collect` pumps at once."""
    _, _, steps, _, launcher = two_streams_stepping(StepPacer(), asynchronous=asynchronous)
    assert launcher.launch()
    steps.end_all()
    assert launcher.collect()
    chunks = "enqueue r0#0,r1#0"  # each stream's first frame completes its first chunk (the schedule's 1 frame)
    assert steps.calls == (["step", chunks, "step", "pump"] if asynchronous else ["step", chunks, "pump"])
