"""A turn's prompt work (`PromptLane`): new streams into slots, their prompts prefilled, newly final text fed.

The core (`engine/core/core.py`) runs this each turn before it queues frame steps. On a GPU the work goes on a
CUDA stream of its own, above the steps' priority (`engine/runner/lanes.py`), so a new stream's prompt runs beside
the step in flight rather than behind it; the steps' stream then waits for it, so a slot's text length is
never written out of order. Streams leaving first-frame slots for an arrival (`Scheduler.make_room`) are
copied first: on the steps' stream behind any step that may still write the old slot, else on this lane.
One request's failure (a prompt that cannot be built, text too long) fails that request only; a failed
prefill fails its batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from ...errors import InvalidTextError
from ..audio import AudioPipeline
from ..messages import PromptSpec
from ..runner import ModelRunner, PrefillRow, Prefills
from ..scheduler import PrefillPlan, RequestState, Scheduler, StepPacer
from ..types import FinishReason, SamplingParams
from .config import CoreStats

logger = logging.getLogger(__name__)


class PromptLane:
    """Admission, slot set-up, prompt prefill and text feeds of the core's live requests."""

    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, prefills: Prefills, audio: AudioPipeline, pacer: StepPacer,
        stats: CoreStats, specs: dict[str, PromptSpec], sampling: dict[str, SamplingParams], *,
        stream: torch.cuda.Stream | None, guarded: Callable[..., Any],
        end: Callable[[RequestState, FinishReason, BaseException | None], None],
    ) -> None:
        """`specs`, `sampling`: each live request's prompt and sampling, by request id (the core keeps them).
        `stream`: the lane's CUDA stream (None on a CPU). `guarded(request, fn, *args)`: run one request's
        piece of work, its failure failing that request; `end(request, reason, error)`: end a request."""
        self.scheduler = scheduler
        self.runner = runner
        self.prefills = prefills
        self.audio = audio
        self.pacer = pacer
        self.stats = stats
        self._specs = specs
        self._sampling = sampling
        self._stream = stream
        self._guarded = guarded
        self._end = end
        self._trailing: dict[str, list[int]] = {}  # a prompt body's text-track tokens, fed after its prefill

    def forget(self, request_id: str) -> None:
        """A request ended or starts over: drop the text its prefill left to feed."""
        self._trailing.pop(request_id, None)

    def run(self) -> bool:
        """Admit waiting requests and prefill the prompt pieces now ready; feed newly final text. Whether any
        of that happened."""
        now = time.perf_counter()
        moved = self.scheduler.make_room(now, self.pacer.step_period_s)
        behind_steps = [move for move in moved if move.after_steps]
        for move in behind_steps:  # behind the steps that may still write the old slot, on their stream
            self.runner.move_slot(move.old, move.new, move.request.position, move.request.track_len)
        copied = None
        if behind_steps and self._stream is not None:
            copied = torch.cuda.Event()
            copied.record()
        admitted = self.scheduler.admit(now)
        plans = [] if admitted else self.scheduler.prefill_plans()
        if moved or admitted or plans:
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                if copied is not None:  # a new request may take a slot copied on the steps' stream
                    torch.cuda.current_stream().wait_event(copied)
                for move in moved:  # the others at once, before the set-ups
                    if not move.after_steps:
                        self.runner.move_slot(move.old, move.new, move.request.position, move.request.track_len)
                for request in admitted:
                    self._guarded(request, self._set_up, request)
                if admitted:  # after the set-up: a head copied from the prefix store needs no prefill
                    plans = self.scheduler.prefill_plans()
                rows = []
                for plan in plans:
                    if self.scheduler.is_live(plan.request):
                        row = self._guarded(plan.request, self._prompt_row, plan)
                        if row is not None:
                            rows.append((plan, row))
                if rows:
                    self._prefill(rows)
                # a new request's codec slot is set up (on the codec's own lane or thread) once its prompt has
                # gone: its first decode is a frame away, and the prompt's launch is what its first audio waits for
                for request in admitted:
                    if self.scheduler.is_live(request):
                        self._guarded(request, self.audio.start, request.request_id, self._specs[request.request_id])
                if self._stream is not None:
                    done = torch.cuda.Event()
                    done.record()
            if self._stream is not None:
                # Everything later on the steps' stream (text for running streams, the next step with the new
                # rows) follows this prompt work: a slot's text length is then never written out of order.
                torch.cuda.current_stream().wait_event(done)
        feeds = self.scheduler.text_feeds()
        for request, ids in feeds:  # running streams' text: on the steps' stream, ordered with their frames
            if request.speculated is not None and request.track_len == 0:
                self.stats.speculations += 1
            self._guarded(request, self._feed, request, ids)
        return bool(admitted or plans or feeds)

    def _set_up(self, request: RequestState) -> None:
        slot = request.slot
        assert slot is not None
        spec = self._specs[request.request_id]
        self.runner.reset_slot(slot, asdict(self._sampling[request.request_id]))
        length = self.prefills.copy_head(spec, slot)
        if length is not None:  # the voice's head was prefilled before: its keys and values were copied
            self.scheduler.on_prefilled(PrefillPlan(request, head=True, body_ids=None), length, time.perf_counter())

    def _prompt_row(self, plan: PrefillPlan) -> PrefillRow:
        request = plan.request
        assert request.slot is not None
        row, trailing = self.prefills.row(
            self._specs[request.request_id], request.slot, request.position, head=plan.head,
            body_ids=plan.body_ids, closed=request.closed,
        )
        self._trailing[request.request_id] = trailing
        return row

    def _prefill(self, rows: list[tuple[PrefillPlan, PrefillRow]]) -> None:
        try:
            self.prefills.run([row for _, row in rows])
        except Exception as exc:  # noqa: BLE001 - a failed prefill (e.g. out of memory) fails its batch only
            logger.exception("prefill of %d prompts failed", len(rows))
            for plan, _ in rows:
                self._end(plan.request, FinishReason.ERROR, exc)
            return
        now = time.perf_counter()
        for plan, row in rows:
            request = plan.request
            if plan.head:
                self.prefills.keep_head(self._specs[request.request_id], row.slot)
            self.scheduler.on_prefilled(plan, row.embeds.shape[0], now)
            trailing = self._trailing.pop(request.request_id, [])
            if plan.body_ids is not None:
                self._guarded(request, self._feed, request, trailing)

    def _feed(self, request: RequestState, ids: list[int]) -> None:
        if not self.scheduler.track_room(request, ids):
            raise InvalidTextError(f"text longer than {self.scheduler.max_text_tokens} tokens")
        if ids:
            assert request.slot is not None
            self.runner.append_text(request.slot, request.track_len, ids)
        self.scheduler.on_fed(request, ids)
