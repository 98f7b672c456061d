"""When the next frame step goes, and what a completed one means (`StepLauncher`).

The core's loop asks it once a turn to launch and to collect. Launching decides whether a step goes now: a
step of the first-frame slots alone for new streams under load; a batched step of every runnable stream
when the pacer says the device is about to need one, which under load also waits for the step clock's
tick, while a new stream's first frame runs and its first chunk decodes (at any load on a GPU), while new
streams step in the first-frame slots (by a wider margin), and while urgent codec work has the device, each
unless a stream's next chunk would then be late. Collecting reads the steps that have completed back into
the scheduler, starts decoding the chunks that are due and, on a GPU, looks at once whether the next step may go.

It holds no request state of its own (that is the `Scheduler`'s) and no device work (that is `FrameSteps`'s
and the `AudioPipeline`'s): only the facts that last from one turn to the next, until when a held step may
wait and whether it waited for a new stream's audio.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from ..audio import AudioPipeline
from ..runner import FrameSteps, ModelRunner
from ..scheduler import RequestState, Scheduler, StepPacer, step_timing
from ..types import SamplingParams
from .config import CoreStats
from .late_trace import LateChunkTrace

# Audio due within this long counts as urgent: a step whose streams are all well ahead of their playback waits
# for it (see `step_timing.steps_can_wait`), so the codec lane gets the device before listeners starve.
URGENT_AUDIO_S = 0.06
# On a CPU, a step waits this many (recent batched) steps' time at most for a first chunk being decoded.
FIRST_AUDIO_WAIT_STEPS = 0.5
# What holds a batched step back while rows could step (`CoreStats.step_gap_by_hold`): a place in flight (the
# pacer: a step of new streams' first frames, or one expected to end later than the next should start), the step
# clock, a new stream's first frame and first chunk, new streams stepping in the first-frame slots, urgent codec
# work; the time from a step's read to the first look after it (on a GPU the rest of `collect`: the frame's
# bookkeeping over every row, the early chunks' codec calls, the other steps read with it); and the time the core's
# loop spent at its other work before it looked again.
GAP_HOLDS = ("in_flight", "clock", "first_audio", "first_frames", "codec")
GAP_READ = "read"
GAP_LOOP = "loop"


class StepLauncher:
    """Queues the frame steps now due and reads the completed ones; called on the core's thread only."""

    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, steps: FrameSteps, pacer: StepPacer, audio: AudioPipeline,
        stats: CoreStats, sampling: Mapping[str, SamplingParams], trace: LateChunkTrace, *,
        first_audio_alone: bool = False,
    ) -> None:
        """`sampling`: each live request's sampling parameters, by request id (the core keeps it). `trace`: where
        each step queued and read back is noted, for the late chunks' log lines.
        `first_audio_alone`: a step waits while a new stream's first frame runs and its first chunk decodes at
        any load, not only when paced (`CoreConfig.first_audio_alone`)."""
        self.scheduler = scheduler
        self.runner = runner
        self.steps = steps
        self.pacer = pacer
        self.audio = audio
        self.stats = stats
        self._sampling = sampling
        self._trace = trace
        self._first_audio_alone = first_audio_alone
        self._release: float | None = None  # until when a held step may wait (Scheduler.pace_release)
        self._early_release: float | None = None  # ... and while new streams step alone (Scheduler.early_release)
        self._waited_for_audio = False  # the next batched step has waited for a new stream's first frame or chunk
        self._batched_queued_at: dict[int, float] = {}  # the batched steps in flight: when each was queued, by seq
        self._last_batched_read: float | None = None  # when the last batched step was read with rows left to step
        # the gap since then, by hold (`_charge_gap`): up to when it is charged, the hold of the last look and until
        # when that hold lasts at most (its release, where known)
        self._gap: dict[str, float] = {}
        self._gap_mark = 0.0
        self._gap_hold = GAP_LOOP
        self._gap_hold_until = math.inf

    def launch(self) -> bool:
        """Queue the steps now due: new streams' first frames at once (under load, in first-frame slots), and
        one frame for every runnable request when the pacer says the device is about to need it."""
        first = self._launch_first_frames()
        return self._launch_step() or first

    def collect(self) -> bool:
        """Read every completed step (oldest first) and start decoding the chunks that are due; whether any
        step had completed.

        Where steps run asynchronously (a GPU), a step read back is followed at once by a look at launching the
        next: the step in flight was often all that held it, and the loop's next look comes only after its
        delivery and its prompt work, milliseconds under load, with the device idle meanwhile (docs/performance.md).
        The look comes before the codec lane's calls for the chunks the step completed (`AudioPipeline.enqueue`,
        then `pump`): their host work would only delay the step, whose kernels the lane's then follow on the
        device anyway (it runs below the steps). A new stream's early chunks still start first: a step may wait
        for its first chunk (`first_audio_in_flight`). A CPU ran the step within `launch`; a second one here would
        hold back this turn's delivery."""
        progressed = False
        for step in self.steps.completed():
            gpu_seconds = step.device_seconds()
            self.pacer.completed(gpu_seconds)
            out = step.host.numpy()
            now = time.perf_counter()
            self._trace.read(step.seq, now, gpu_seconds)
            if step.batched:
                self._book_batched_read(step.seq, gpu_seconds, now)
                if gpu_seconds is not None:
                    self.scheduler.load.record_step_time(gpu_seconds, now)
            self.stats.frames_generated += sum(1 for r in step.rows if r.finish_reason is None and r.slot is not None)
            plans = self.scheduler.on_frame(step.rows, step.slots, out[:, :-1], out[:, -1], now)
            self._release = self._early_release = None
            self.scheduler.on_step_done(step.seq)
            if plans:
                self.audio.enqueue(plans)
            progressed = True
        if progressed and self._last_batched_read is not None and not self.scheduler.has_runnable():
            self._end_gap()  # nothing left to step: the time until the next is no gap
        if progressed and self.steps.asynchronous:
            self.launch()  # the step just read may have been all that held the next (see `collect`)
        if progressed:
            self.audio.pump(time.perf_counter(), self.scheduler.audio_streams())
        return progressed

    def _book_batched_read(self, seq: int, device_seconds: float | None, now: float) -> None:
        """A batched step was read back at `now`: its time in flight and on the device (`CoreStats.timed_steps`),
        and, once no other is in flight, the start of a gap until the next is queued."""
        queued_at = self._batched_queued_at.pop(seq, None)
        if device_seconds is not None and queued_at is not None:
            self.stats.timed_steps += 1
            self.stats.step_device_seconds += device_seconds
            self.stats.step_flight_seconds += now - queued_at
        if not self._batched_queued_at:
            self._last_batched_read = self._gap_mark = now
            self._gap, self._gap_hold, self._gap_hold_until = {}, GAP_READ, math.inf

    def _end_gap(self) -> None:
        self._last_batched_read = None
        self._gap = {}

    def _held(self, now: float, hold: str, until: float = math.inf) -> bool:
        """The batched step does not go now, held by `hold` (one of `GAP_HOLDS`) until `until` at most (infinity:
        not known). False."""
        assert hold in GAP_HOLDS
        if self._last_batched_read is not None and not self._batched_queued_at:
            self._charge_gap(now)
            self._gap_hold, self._gap_hold_until = hold, until
        return False

    def _charge_gap(self, now: float) -> None:
        """Charge the gap's time since the last look to that look's hold, up to its release; the rest to the loop."""
        held = max(0.0, min(now, self._gap_hold_until) - self._gap_mark)
        self._gap[self._gap_hold] = self._gap.get(self._gap_hold, 0.0) + held
        self._gap[GAP_LOOP] = self._gap.get(GAP_LOOP, 0.0) + (now - self._gap_mark - held)
        self._gap_mark = now

    def replan(self) -> None:
        """A stream's need changed (a chunk left): a held step's release is worked out afresh. (A chunk leaving
        only moves a release later, so the wait for new streams, worked out over every row, keeps its own until
        the next step is queued or read.)"""
        self._release = None

    def clear(self) -> None:
        """Forget the steps in flight (after a failed step: their requests have failed)."""
        self.steps.clear()
        self.pacer.clear()
        self._release = self._early_release = None
        self._batched_queued_at.clear()
        self._end_gap()

    def _launch_first_frames(self) -> bool:
        """A step of the first-frame slots alone, for new streams whose next frame can run there, right behind
        the step in flight instead of behind it and a whole batched step of their own; the streams that no
        longer need those slots move above them first."""
        if not self.scheduler.first_frame_slots or not self.pacer.may_queue():
            return False
        now = time.perf_counter()
        period = self.pacer.step_period_s
        self._move_settled(now)
        rows = self.scheduler.first_frame_rows(now, period)
        if not rows or self._batched_step_pressed(now, period):
            return False
        self._queue_step(rows, now, batched=False)
        self.stats.first_frame_steps += 1
        return True

    def _batched_step_pressed(self, now: float, period: float) -> bool:
        """Whether a stream's next chunk needs the batched step now (`Scheduler.pace_release` has come): new
        streams' first frames then wait for it rather than take its place in flight. Otherwise a burst of
        arrivals, each first frame a small step right behind the last, keeps every place in flight and the
        batched step off the device until the older streams' chunks leave late (the late-chunk stories of a
        burst on an idle server: benchmarks/results/2026-12-07-h100-burst-first-frames)."""
        return now >= self._pace_release(now, period)

    def _pace_release(self, now: float, period: float, rows: list[RequestState] | None = None) -> float:
        """`Scheduler.pace_release` of `rows` (by default the runnable ones), worked out once until the next step,
        collect or delivery changes a stream's need."""
        if self._release is None:
            self._release = self.scheduler.pace_release(self.scheduler.runnable() if rows is None else rows, now, period)
        return self._release

    def _move_settled(self, now: float) -> None:
        """Move the streams that leave the first-frame slots (`Scheduler.moves`): copies on the steps' stream,
        so the steps queued next find them at their new slots."""
        for request, old, new in self.scheduler.moves(now, self.pacer.step_period_s):
            self.runner.move_slot(old, new, request.position, request.track_len)

    def _launch_step(self) -> bool:
        """Queue one frame for every runnable request, when the pacer says the device is about to need it (and,
        under load, when its step clock says so)."""
        now = time.perf_counter()
        if not self.pacer.may_launch(now):
            return self._held(now, "in_flight", self.pacer.launch_at())
        rows = self.scheduler.runnable()
        if not rows:
            self._end_gap()  # nothing to step (streams waiting for text, or none): no gap
            return False
        if self._awaits_first_audio(now):
            return self._held(now, "first_audio")
        period = self.pacer.step_period_s
        paced = self.scheduler.paced(rows)
        # the clock ticks faster as slots run short (`Scheduler.clock_period`); a held step's release and the
        # first-frame rules still count a step as `period` at most, the time a step may take
        tick = self.pacer.clock_tick(self.scheduler.clock_period(period))
        early = paced and now < tick
        # A paced step (any step that carries no first frame, with `first_audio_alone`) also waits while a new
        # stream's first frame runs and its first chunk decodes: their kernels then have the device to
        # themselves instead of queueing for it behind the step's.
        may_hold = paced or (self._first_audio_alone and all(r.frames_launched for r in rows))
        held = early or (
            may_hold and (step_timing.first_frame_in_flight(rows) or self.audio.first_audio_in_flight())
        )
        if held and now < (release := self._pace_release(now, period, rows)):
            self._waited_for_audio |= not early
            return self._held(now, "clock", min(tick, release)) if early else self._held(now, "first_audio", release)
        if self._early_release is None:  # while new streams step in the first-frame slots, it waits for them
            self._early_release = self.scheduler.early_release(rows, now, period)
        if now < self._early_release:
            self._waited_for_audio = True
            return self._held(now, "first_frames", self._early_release)
        if self.audio.urgent(now, URGENT_AUDIO_S) and step_timing.steps_can_wait(rows, now):
            self.stats.steps_deferred += 1
            return self._held(now, "codec")
        self._move_settled(now)  # out of first-frame slots, right before this step
        self._queue_step(rows, now)
        self.stats.clock_releases += early
        self.stats.first_audio_holds += self._waited_for_audio
        self._waited_for_audio = False
        return True

    def _awaits_first_audio(self, now: float) -> bool:
        """On a CPU whose codec has a thread of its own a step holds this thread for its whole length, and
        delivers nothing meanwhile. A stream's first chunk that has been decoding for half a step (a decode
        beside a step takes about one) is waited for, up to half a step; when it came, the step goes next
        turn, after the chunk has gone out."""
        half_step = FIRST_AUDIO_WAIT_STEPS * self.scheduler.load.step_seconds(now)
        return self.audio.wait_for_first_audio(half_step, older_than_s=half_step)

    def _queue_step(self, rows: list[RequestState], now: float, *, batched: bool = True) -> None:
        self._release = self._early_release = None
        slots: list[int] = []
        for request in rows:
            assert request.slot is not None  # runnable rows always hold a slot
            slots.append(request.slot)
        kv_len = max(r.position for r in rows) + 1
        step = self.steps.queue(
            self.scheduler.on_launched(rows), rows, slots, kv_len, self._sampling_below, batched=batched
        )
        self._trace.queued(step.seq, rows, now, batched=batched)
        if batched:
            self.stats.steps_overlapped += bool(self._batched_queued_at)
            if not self._batched_queued_at and self._last_batched_read is not None:
                self._charge_gap(now)
                self.stats.step_gap_seconds += now - self._last_batched_read
                by_hold = self.stats.step_gap_by_hold
                for hold, seconds in self._gap.items():
                    by_hold[hold] = by_hold.get(hold, 0.0) + seconds
                self._end_gap()
            self._batched_queued_at[step.seq] = now
        if step.done is None and batched:  # no device events: the step ran synchronously, now is its end
            ended = time.perf_counter()
            self.scheduler.load.record_step_time(ended - now, ended)
        self.pacer.launched(step.bucket, now, batched=batched)
        self.stats.steps += 1

    def _sampling_below(self, b: int) -> tuple[bool, bool]:
        """Whether any request in slots [0, b) samples its talker token, and its predictor codes."""
        in_batch = [self._sampling[r.request_id] for r in self.scheduler.running.values() if r.slot is not None and r.slot < b]
        return any(s.do_sample for s in in_batch), any(s.subtalker_do_sample for s in in_batch)
