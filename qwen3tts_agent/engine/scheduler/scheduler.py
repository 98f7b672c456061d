"""The engine's decisions, without tensors: who takes a slot, what to prefill, who steps, which audio to decode.

The core (`engine/core/core.py`) asks the scheduler what to do, does it on the device, and reports back what
came out (a step's codes and end flags, a prefill's length, a chunk delivered). Everything here is plain
Python over host-side request state, so `tests/engine/scheduler/test_scheduler.py` drives it with made-up step outputs.

Deadlines. A client plays a stream from its first chunk on, in real time, so once the first chunk has
left, the next chunk is needed by `first_audio + delivered_frames * 80 ms`. The time left until then is
the stream's slack. Chunks due for decoding are handed to the core most urgent first (first chunks, then
by deadline), and a stream whose audio cut so far runs out soon gets its pending frames decoded at once rather
than waiting to fill its next scheduled chunk (`cut_chunk`; no chunk is ever longer than its schedule's).
Overload is refused at admission (`overloaded`: while a stream is live, from the last second's step times booked in
`load`, past the number of streams that late chunks have cut the engine down to (`stream_limit.StreamLimit`), or
while a request has waited `SLOT_WAIT_TO_SHED_S` for a slot) while admitted streams still have slack, instead of
letting every stream starve a little, or letting new ones queue for seconds behind full slots (a caller would rather
hear `busy` at once and go elsewhere).

First-frame slots. Every live stream is a row of every frame step, so a step under load takes several times
a lone stream's (more rows, bigger graph buckets), and a new stream's first frame would wait for the step in
flight and then a whole step of its own. Under load (`first_frame_load` streams stepping or more), a new
stream therefore takes one of the lowest `first_frame_slots` slots, and its frames run in steps of those
slots alone (`first_frame_rows`), queued right behind the step in flight, until batched steps can keep up
with it: until the frames its next chunk lacks, one batched step each, would leave it `EARLY_HOLD_MARGIN_S`
and a step to spare before its listener runs out (`settled`). On a lightly loaded device that is after three
frames; where a batched step takes longer (hundreds of rows), a few more, since its 2-frame second chunk is
due 80 ms after the first. Its state then moves to a slot above them (`moves`), which frees
its first-frame slot for the next arrival. While new streams step there, batched steps wait for them as long
as every other stream's next chunk stays that margin ahead of its deadline (`early_release`): the streams
seconds ahead of their listeners give the device to those just starting. Once the device is full, though,
those small steps cost more than they give: a first-frame step of a few rows takes a good part of a batched
step of a hundred, and every stream then gets fewer frames a second. So for a while after a chunk leaves late,
new streams take no first-frame slot and step in the batched steps (`DeviceLoad.first_frames_paused`).

The full device. A batched step that carries a new stream's first frame would not wait for the step clock
(`paced`), so under heavy traffic every arrival would set off a step of every row: steps would come as often as
streams arrive, each of fewer rows than the clock's would be, and a step's time grows far slower than its
rows (a step of 256 rows takes about 1.3 times one of 128), so the device spends more per frame made.
From `clock_first_frame_load` streams stepping, therefore, a new stream takes no first-frame slot either, and
its first frame waits for the clock's next tick like every other frame: a few milliseconds more to first
audio for fuller steps.

Slot pressure. The step clock runs every stream at about `FRAME_SECONDS / period` times real time, so a stream
holds its slot for its utterance's length divided by that: with every slot taken, arrivals then wait for a slot
(and are refused after `SLOT_WAIT_TO_SHED_S`) while the device idles between ticks. From `SLOT_PRESSURE_FROM` of
the slots held (by streams stepping or waiting for one), the clock's period therefore shrinks in proportion to the
slots left, to none at full slots (`clock_period`): streams then finish and free their slots as fast as the device
can make their frames, and the clock's room for new streams is given back once slots are free again.

Speculative first frame. In the interleaved layout the first frame reads the second target token, and a
token is final only once the text after it has begun (a word may still grow), so a stream fed LLM tokens
would wait two token intervals for its first frame. Instead the first frame runs on the second token as the
text stands (the caller's tentative tokens): its audio is held until the token turns out final and the same
(`settle_speculation`), and if it turns out different the request starts over in a new slot (`restart`),
without speculating again. Audio that leaves the core is therefore always the audio of the final text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from ..types import FIRST_FRAME_TEXT_TOKENS, FinishReason
from . import step_timing
from .device_load import LATE_CHUNKS, SLOW_STEPS, DeviceLoad, LateChunk
from .requests import ChunkPlan, PrefillPlan, RequestState, cut_chunk, urgency
from .slots import SlotPool
from .step_timing import EARLY_HOLD_MARGIN_S, PACE_MARGIN_S
from .stream_limit import StreamLimit

# Refuse new streams while a request has waited this long for its first slot: every slot is taken, and streams
# leave them slower than new ones come, so a new stream's first audio would be that much late at least. (Lateness
# of chunks says nothing here: a queued request has no deadline yet; docs/performance.md has the run.)
SLOT_WAIT_TO_SHED_S = 0.1
SLOT_WAIT = "slot_wait"
# Why an engine refuses new streams (`Scheduler.refusal_reason`): its device's evidence, or the wait for a slot.
REFUSAL_REASONS = (SLOW_STEPS, LATE_CHUNKS, SLOT_WAIT)
# From this fraction of the slots held the step clock's period shrinks, to none at full slots (`clock_period`).
SLOT_PRESSURE_FROM = 0.75


class SlotMove(NamedTuple):
    """A request's state to copy from slot `old` to slot `new` (`Scheduler.make_room`), before a new request
    takes `old`. `after_steps`: steps queued may still write `old` (a frame or a text feed of the request in
    flight), so the copy goes on the steps' stream behind them and the prompts' lane waits for it on the
    device; otherwise the prompts' lane copies it at once."""

    request: RequestState
    old: int
    new: int
    after_steps: bool


class Scheduler:
    """Slots, prompt progress, step membership, chunking and deadlines of every live request."""

    def __init__(
        self,
        *,
        max_slots: int,
        max_seq_len: int,
        max_text_tokens: int,
        max_prefill_rows: int = 16,
        eos_token_id: int,
        keep_codes: bool = False,
        adapt_chunks: bool = True,
        speculate: bool = True,
        decode_sizes: Iterable[int] = (),
        first_frame_slots: int = 0,
        first_frame_load: int = 0,
        pace_load: int = 0,
        clock_first_frame_load: int = 0,
        shed_lateness_s: float = 0.0,
    ) -> None:
        """`adapt_chunks`: decode a stream's pending frames early when its next chunk is nearly due, rather
        than keep to its chunk schedule (which an engine slower than the schedule assumes would starve).
        `speculate`: run a streamed text's first frame on its tentative second token (module docstring).
        `decode_sizes`: chunk lengths the audio pipeline decodes in one piece (its CUDA graphs); a chunk cut
        short for a deadline takes the longest of them that its pending frames fill, so it costs one codec
        call and batches with other streams' chunks of that length (empty: any length).
        `first_frame_slots`: how many of the lowest slots new streams take under load, to run their first
        frame in a step of their own (module docstring); 0 for none. `first_frame_load`: the streams stepping
        from which they do (at least `first_frame_slots`). `pace_load`: the streams stepping from which
        batched steps keep to the step clock (`paced`); 0: never. `clock_first_frame_load`: the streams stepping
        from which new streams' first frames keep to it too and take no first-frame slot (module docstring);
        0: never. `shed_lateness_s`: how late a chunk must leave to count as evidence of load (`DeviceLoad`)."""
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.max_text_tokens = max_text_tokens
        self.max_prefill_rows = max_prefill_rows
        self.eos_token_id = eos_token_id  # the text track's end token (tts_eos)
        self.keep_codes = keep_codes  # every frame's codes stay on the request (parity tests)
        self.adapt_chunks = adapt_chunks
        self.speculate = speculate
        self.decode_sizes = sorted(set(decode_sizes))
        if not 0 <= first_frame_slots < max_slots:
            raise ValueError(f"first_frame_slots must be in [0, {max_slots}), got {first_frame_slots}")
        self.first_frame_slots = first_frame_slots
        self.first_frame_load = max(first_frame_slots, first_frame_load)
        self._first_frame: list[RequestState] = []  # requests in first-frame slots, until they move
        if pace_load < 0:
            raise ValueError(f"pace_load must not be negative, got {pace_load}")
        self.pace_load = pace_load
        if clock_first_frame_load < 0:
            raise ValueError(f"clock_first_frame_load must not be negative, got {clock_first_frame_load}")
        self.clock_first_frame_load = clock_first_frame_load
        self.waiting: list[RequestState] = []  # added, no slot yet (FIFO)
        self.running: dict[int, RequestState] = {}  # slot -> request
        self.finishing: list[RequestState] = []  # ended, last chunk not delivered yet
        # what the per-turn passes look at, so that a turn's cost does not grow with the streams stepping:
        self._prompting: dict[RequestState, None] = {}  # admitted, prompt body not prefilled yet
        self._new_text: dict[RequestState, None] = {}  # text, its end or a prefilled body since the last feed
        self.requests: dict[str, RequestState] = {}
        self.slots = SlotPool(max_slots)  # free once no step in flight may hold them (engine/scheduler/slots.py)
        self.load = DeviceLoad(shed_lateness_s)  # the steps' times and the late chunks (refusals, first-frame pauses)
        self.stream_limit = StreamLimit(max_slots)  # how many streams to take on while chunks leave late

    # ----------------------------------------------------------------- requests
    def add(self, request: RequestState) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} already exists")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def get(self, request_id: str) -> RequestState | None:
        return self.requests.get(request_id)

    def is_live(self, request: RequestState) -> bool:
        """Whether its outputs still matter (not finished, cancelled or failed)."""
        return self.requests.get(request.request_id) is request

    def append_text(self, request: RequestState, token_ids: Iterable[int], tentative: Iterable[int] = ()) -> None:
        if request.closed:
            raise ValueError("text after the input was closed")
        request.text_ids.extend(token_ids)
        request.tentative = list(tentative)
        self._new_text[request] = None

    def close_input(self, request: RequestState, token_ids: Iterable[int]) -> None:
        request.text_ids.extend(token_ids)
        request.tentative = []
        request.closed = True
        self._new_text[request] = None

    def settle_speculation(self, request: RequestState) -> bool | None:
        """After new text: whether the token a first frame ran on turned out final and the same (True), or
        not (False: `restart` the request); None while it is still open or nothing was speculated."""
        token = request.speculated
        if token is None:
            return None
        if len(request.text_ids) > request.consumed:  # the token after the body is final now
            right = request.text_ids[request.consumed] == token
        elif request.closed:
            right = False  # the text ended after the body: the track's first token is the text's end
        elif request.tentative and request.tentative[0] != token:
            right = False  # still tentative, but no longer that token
        else:
            return None
        request.speculated = None
        if right:
            request.consumed += 1  # on the track already
        return right

    def restart(self, request: RequestState) -> RequestState:
        """Start a request over whose speculated first frame was wrong: its slot's cache and text track hold
        the wrong token, so it takes a new slot (first in line) with the final text so far, and the old
        state's frames still in flight are dropped (`on_frame` skips a request that has ended)."""
        fresh = RequestState(
            request.request_id, request.shape, request.chunk_schedule, request.submitted,
            max_frames=request.max_frames, runaway_guard=request.runaway_guard, text_ids=list(request.text_ids),
            tentative=list(request.tentative), may_speculate=False, closed=request.closed,
            arrived=request.arrived, admitted_at=request.admitted_at, text_ready=request.text_ready,
        )
        request.finish_reason = FinishReason.CANCELLED
        self._release(request)
        if request in self.finishing:
            self.finishing.remove(request)
        self.requests[fresh.request_id] = fresh
        self.waiting.insert(0, fresh)
        return fresh

    def finish(self, request: RequestState, reason: FinishReason) -> None:
        """End a request at once (cancel, error): it leaves every queue; no more of its audio is decoded."""
        request.finish_reason = reason
        self._release(request)
        if request in self.finishing:
            self.finishing.remove(request)
        self.requests.pop(request.request_id, None)

    def _release(self, request: RequestState) -> None:
        """Give the slot back, for reuse once no step in flight can hold it: once the last step the request was
        a row of has completed (every step queued, if text was fed to it after that one). A stream that ended
        at its frame limit had no frame launched past its last, so its slot is free at once, though the step
        after that one is in flight."""
        self._prompting.pop(request, None)
        self._new_text.pop(request, None)
        if request in self._first_frame:
            self._first_frame.remove(request)
        if request.slot is not None:
            self.running.pop(request.slot, None)
            last = request.last_step
            if request.fed_before_step > last:  # text fed after its last step: every step queued since
                last = self.slots.launched_steps
            self.slots.release(request.slot, last)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)

    # ----------------------------------------------------------------- admission and prompts
    def admit(self, now: float) -> list[RequestState]:
        """Give waiting requests free slots, oldest first, at most a prefill batch of them per call: the lowest
        free slot, which under load is a first-frame slot while one is free (module docstring)."""
        admitted: list[RequestState] = []
        if not (self.waiting and self.slots):
            return admitted  # the usual turn: nothing to admit (and no count of the streams stepping)
        under_load = bool(self.first_frame_slots) and not self.load.first_frames_paused(now) and self._first_frame_slots_used()
        while self.waiting and self.slots and len(admitted) < self.max_prefill_rows:
            request = self.waiting.pop(0)
            request.slot = self.slots.take_lowest()
            if under_load and request.slot < self.first_frame_slots:
                self._first_frame.append(request)
            request.admitted_at = request.admitted_at or now  # a restarted request keeps its first admission
            self.running[request.slot] = request
            self._prompting[request] = None
            admitted.append(request)
        return admitted

    def make_room(self, now: float, period_s: float) -> list[SlotMove]:
        """Under load, with requests waiting, every first-frame slot taken and first frames not paused
        (`DeviceLoad.first_frames_paused`): move streams out of first-frame slots to free slots above them, one per
        waiting request (up to a prefill batch), so that new streams still take first-frame slots when the
        engine is nearly full (a free slot then appears only when a stream ends, and the next arrival would
        take it). Any stream in those slots that has had a first frame may move (also one admitted there below
        the load, which would stay): first those that nothing queued on the device may still write
        (`_at_rest`), then `settled` ones, then the furthest along. The old slot is free at once: the caller
        copies the state before it sets up any new request on the prompts' lane (`SlotMove`)."""
        if not (self.first_frame_slots and self.waiting and self.slots) or self.load.first_frames_paused(now):
            return []
        wanted = min(len(self.waiting), self.max_prefill_rows)
        wanted -= self.slots.free_below(self.first_frame_slots)
        if wanted <= 0 or not self._first_frame_slots_used():
            return []
        low = (self.running.get(slot) for slot in range(self.first_frame_slots))  # also streams admitted below the load
        movable = [r for r in low if r is not None and r.frames_launched and r.finish_reason is None]
        movable.sort(key=lambda r: (not self._at_rest(r), not self.settled(r, now, period_s), -r.frames))
        moved = []
        for request in movable[:wanted]:
            new = self.slots.lowest_free_from(self.first_frame_slots)
            if new is None:
                break
            at_rest = self._at_rest(request)
            old = self._move(request, new)
            moved.append(SlotMove(request, old, new, after_steps=not at_rest))
            self.slots.give_back(old)
        return moved

    def _at_rest(self, request: RequestState) -> bool:
        """Whether nothing queued on the device may still write a live request's slot: it has made a frame,
        has none in flight, and its last text feed ran before a step that has completed."""
        return (
            request.finish_reason is None
            and request.frames_launched == request.frames > 0
            and request.fed_before_step <= self.slots.completed_steps
        )

    def _move(self, request: RequestState, new: int) -> int:
        """Move a request in a first-frame slot to slot `new`, taken from the pool; returns its old slot, the
        caller's to free."""
        old = request.slot
        assert old is not None
        del self.running[old]
        self.running[new] = request
        request.slot = new
        if request in self._first_frame:
            self._first_frame.remove(request)
        return old

    def _stepping(self) -> int:
        """Streams that have had a frame step and are not finished: the rows of the next step."""
        return sum(1 for request in self.running.values() if request.frames_launched and request.finish_reason is None)

    def _first_frame_slots_used(self) -> bool:
        """Whether new streams take first-frame slots at the present load: from `first_frame_load` streams
        stepping, below `clock_first_frame_load`."""
        stepping = self._stepping()
        return self.first_frame_load <= stepping and not self._clocks_first_frames(stepping)

    def _clocks_first_frames(self, stepping: int) -> bool:
        """Whether, with `stepping` streams stepping, new streams' first frames wait for the step clock."""
        return bool(self.clock_first_frame_load) and stepping >= self.clock_first_frame_load

    def prefill_plans(self) -> list[PrefillPlan]:
        """Prompt pieces ready to run: heads of admitted requests, and bodies whose text is final enough."""
        plans: list[PrefillPlan] = []
        for request in self._prompting:
            if request.finish_reason is not None:
                continue
            if len(plans) >= self.max_prefill_rows:
                break
            body = request.shape.body_ready(len(request.text_ids), request.closed)
            if body or not request.head_done:
                plans.append(PrefillPlan(request, not request.head_done, list(request.text_ids) if body else None))
        return plans

    def on_prefilled(self, plan: PrefillPlan, positions: int, now: float) -> None:
        """A plan's prompt piece ran: `positions` cache positions were written."""
        request = plan.request
        request.head_done = True
        request.position += positions
        if plan.body_ids is not None:
            request.body_done = True
            request.prefill_done = now
            request.consumed = len(plan.body_ids)
            self._prompting.pop(request, None)
            self._new_text[request] = None  # its text past the body, the end, or a first frame to speculate

    def text_feeds(self) -> list[tuple[RequestState, list[int]]]:
        """Newly final text (and the text's end, once closed) to append to running requests' text tracks,
        and the tentative second token of a request whose first frame may run on it (`speculated` is set)."""
        feeds = []
        pending, self._new_text = self._new_text, {}
        for request in pending:
            if not request.body_done or request.finish_reason is not None or request.slot is None:
                continue  # a body not prefilled yet is marked again once it is (`on_prefilled`)
            ids = request.text_ids[request.consumed :]
            request.consumed = len(request.text_ids)
            if request.closed and not request.eos_fed:
                ids = [*ids, self.eos_token_id]
            if not ids and self._speculates(request):
                request.speculated = request.tentative[0]
                ids = [request.speculated]
            if ids:
                feeds.append((request, ids))
        return feeds

    def _speculates(self, request: RequestState) -> bool:
        """Whether its first frame should run now on the tentative token after its only final one."""
        return (
            request.track_len == 0  # false for every stream past its first frame: checked first (a hot loop)
            and self.speculate
            and request.may_speculate
            and request.shape.may_speculate
            and request.speculated is None
            and not request.closed
            and bool(request.tentative)
            and len(request.text_ids) == FIRST_FRAME_TEXT_TOKENS - 1
        )

    def track_room(self, request: RequestState, ids: Sequence[int]) -> bool:
        return request.track_len + len(ids) <= self.max_text_tokens

    def on_fed(self, request: RequestState, ids: Sequence[int]) -> None:
        request.track_len += len(ids)
        request.fed_before_step = self.slots.launched_steps + 1
        if request.closed:
            request.eos_fed = True

    # ----------------------------------------------------------------- steps
    def runnable(self) -> list[RequestState]:
        """Requests that can take one more frame now: prompt done, frame budget and cache room left, text known."""
        return [request for request in self.running.values() if self._can_step(request)]

    def has_runnable(self) -> bool:
        """Whether any request can take a frame now (`runnable`, without listing them: the core asks on every
        turn it would wait, with hundreds of rows live)."""
        return any(self._can_step(request) for request in self.running.values())

    def _can_step(self, request: RequestState) -> bool:
        limit = request.frame_limit
        return (
            request.body_done
            and request.finish_reason is None
            and (limit is None or request.frames_launched < limit)
            and request.position < self.max_seq_len
            and (request.eos_fed or request.frames_launched < request.track_len)
        )

    def paced(self, rows: Sequence[RequestState]) -> bool:
        """Whether a batched step of `rows` waits for the step clock (`StepPacer`): under load (`pace_load`
        streams stepping or more), unless it carries a new stream's first frame, which waits for a tick only
        on a full device (`clock_first_frame_load` streams stepping or more; module docstring)."""
        if not self.pace_load or len(rows) < self.pace_load:
            return False
        stepping = sum(1 for r in rows if r.frames_launched)
        return stepping == len(rows) or self._clocks_first_frames(stepping)

    def clock_period(self, period_s: float) -> float:
        """The step clock's period at this slot pressure: `period_s` up to `SLOT_PRESSURE_FROM` of the slots held
        (`holding_streams`), then shrinking linearly with the slots left, to 0 (steps back to back) when every
        slot is held or requests wait for one (module docstring, "Slot pressure")."""
        held = self.holding_streams() / self.max_slots
        if held <= SLOT_PRESSURE_FROM:
            return period_s
        return period_s * max(0.0, (1.0 - held) / (1.0 - SLOT_PRESSURE_FROM))

    def pace_release(
        self, rows: Sequence[RequestState], now: float, period_s: float, margin_s: float = PACE_MARGIN_S
    ) -> float:
        """Until when a paced step of `rows` may wait for the clock (`paced`): `step_timing.pace_release` at the
        device's recent step time (`DeviceLoad.step_seconds`; a period where no step ended lately, and at most
        one)."""
        seconds = self.load.step_seconds(now)
        return step_timing.pace_release(rows, min(period_s, seconds) if seconds else period_s, margin_s)

    def early_release(self, rows: Sequence[RequestState], now: float, period_s: float) -> float:
        """Until when a batched step of `rows` waits for new streams stepping in their first-frame slots
        (`first_frame_rows`): while one of them is, the release of the other rows by `pace_release` with
        `EARLY_HOLD_MARGIN_S`; minus infinity while none is (the step need not wait)."""
        early = [r for r in self._first_frame if self._stepping_early(r, now, period_s)]
        if not early:
            return -math.inf
        return self.pace_release([r for r in rows if r not in early], now, period_s, EARLY_HOLD_MARGIN_S)

    def _stepping_early(self, request: RequestState, now: float, period_s: float) -> bool:
        """Whether a request in a first-frame slot has a frame there in flight or one to run (`first_frame_rows`)."""
        in_flight = request.frames_launched > request.frames
        return in_flight or (self._can_step(request) and not self.settled(request, now, period_s))

    def settled(self, request: RequestState, now: float, period_s: float) -> bool:
        """Whether a new stream can leave its first-frame slot: `step_timing.settled` at the device's step time,
        at least the clock's `period_s`."""
        return step_timing.settled(request, now, max(period_s, self.load.step_seconds(now)))

    def first_frame_rows(self, now: float, period_s: float) -> list[RequestState]:
        """Requests in first-frame slots whose next frame can run now, in a step of those slots alone: new
        streams not yet `settled`, one frame in flight each."""
        return [
            r for r in self._first_frame
            if r.frames_launched == r.frames and self._can_step(r) and not self.settled(r, now, period_s)
        ]

    def moves(self, now: float, period_s: float) -> list[tuple[RequestState, int, int]]:
        """Move every request in a first-frame slot that is `settled`, or has made a frame and waits for text
        (it would keep the slot from new streams), to the lowest free slot above those slots:
        (request, old slot, new slot) for the caller to copy its state on the steps' stream before the next
        step (the old slot is reused once the step queued after the copy has completed). A request stays
        where it is while no such slot is free."""
        moved = []
        for request in list(self._first_frame):
            if not (self.settled(request, now, period_s) or self._waits_for_text(request)):
                continue
            new = self.slots.lowest_free_from(self.first_frame_slots)
            if new is None:
                break
            old = self._move(request, new)
            moved.append((request, old, new))
            self.slots.release(old, self.slots.launched_steps + 1)  # free once the step queued after the copy is done
        return moved

    def _waits_for_text(self, request: RequestState) -> bool:
        """Whether a request has made its frames so far, none in flight, and cannot step for want of text."""
        return request.frames_launched == request.frames > 0 and not self._can_step(request)

    def on_launched(self, rows: Sequence[RequestState]) -> int:
        """A step with these rows was queued on the device; returns its sequence number."""
        seq = self.slots.on_launched()
        for request in rows:
            request.position += 1
            request.frames_launched += 1
            request.last_step = seq
        return seq

    def on_step_done(self, seq: int) -> None:
        """Step `seq` (and every step before it) has completed on the device: its slots are free to reuse."""
        self.slots.on_completed(seq)

    def on_steps_abandoned(self) -> None:
        """Steps in flight were dropped (a failed step): nothing on the device holds a slot any more."""
        self.on_step_done(self.slots.launched_steps)

    def on_frame(
        self, rows: Sequence[RequestState], slots: Sequence[int], codes: np.ndarray, finished: np.ndarray, now: float
    ) -> list[ChunkPlan]:
        """A step's results (codes [slots, 16] and end flags [slots], by slot; `slots`: each row's slot in
        that step, which `moves` may have changed since): chunks due, most urgent first.

        Requests that ended while the step was in flight (cancel, error) are skipped: their frame is dropped.
        """
        codes = codes.copy()  # the step's host buffer is reused; each row keeps a view of this one copy
        for request, slot in zip(rows, slots, strict=True):
            if request.finish_reason is not None or request.slot is None:
                continue
            if request.frames == 0:
                request.first_frame = now
            request.pending.append(codes[slot])
            if self.keep_codes:
                request.codes.append(codes[slot].tolist())
            request.frames += 1
            limit = request.frame_limit
            if finished[slot]:
                request.finish_reason = FinishReason.EOS
            elif limit is not None and request.frames >= limit:
                capped = request.max_frames is not None and request.frames >= request.max_frames
                request.finish_reason = FinishReason.MAX_FRAMES if capped else FinishReason.LENGTH
            elif request.position >= self.max_seq_len and request.frames == request.frames_launched:
                request.finish_reason = FinishReason.MAX_FRAMES  # the KV cache is full
        plans = []
        for request in list(self.running.values()):
            plan = cut_chunk(request, now, adapt=self.adapt_chunks, decode_sizes=self.decode_sizes)
            if plan is not None:
                plans.append(plan)
            if request.finish_reason is not None:
                self._release(request)
                self.finishing.append(request)
        return sorted(plans, key=lambda p: urgency(p, now))

    def overloaded(self, now: float) -> bool:
        """Whether new streams should be refused now (the engine's `busy`): while a request is live and the
        device's recent steps or chunks say it runs behind (`DeviceLoad.overloaded`), or a request has waited
        `SLOT_WAIT_TO_SHED_S` for its slot. An engine with nothing live admits whatever the device's evidence
        says: it was about load that left with its streams, and a new stream would have the device to itself.
        (Read on callers' threads: `requests` is only tested for emptiness, `waiting` read from a copy.)"""
        return self.refusal_reason(now) is not None

    def refusal_reason(self, now: float) -> str | None:
        """Which rule of `overloaded` refuses new streams now (`REFUSAL_REASONS`), or None: `SLOW_STEPS`,
        `LATE_CHUNKS` (a new stream would pass the limit that late chunks set) or `SLOT_WAIT`."""
        if not self.requests:
            return None
        if self.load.slow_steps(now):
            return SLOW_STEPS
        if self.stream_limit.refuses(self.holding_streams(), now):
            return LATE_CHUNKS
        if self.slot_wait(now) >= SLOT_WAIT_TO_SHED_S:
            return SLOT_WAIT
        return None

    def holding_streams(self) -> int:
        """Requests holding a slot or waiting for one: what `stream_limit` limits. (Streams whose last frame
        has run hold none: their audio's decoding is what is left of them.)"""
        return len(self.running) + len(self.waiting)

    def slot_wait(self, now: float) -> float:
        """How long the oldest request still waiting for its first slot has waited (0.0: none waits). A request
        started over after a wrong speculation (`restart`) had a slot already and does not count."""
        for request in list(self.waiting):  # a copy: the core's thread changes the list
            if not request.admitted_at:
                return max(0.0, now - request.arrived)
        return 0.0

    # ----------------------------------------------------------------- delivery
    def on_delivered(self, plan: ChunkPlan, now: float) -> LateChunk | None:
        """A chunk's audio left the core: book its lateness against the stream's real-time schedule (`load`).
        The chunk, if it left late."""
        request = plan.request
        deadline = request.deadline()
        late = None
        if deadline is None:
            request.first_audio = now
        else:
            if self.load.on_delivered(deadline, now, plan.index, plan.planned_at) and self.load.late_chunks(now):
                self.stream_limit.on_late(self.holding_streams(), now)
            if now > deadline:
                assert request.first_audio is not None  # a deadline comes from it
                late = LateChunk(request.request_id, plan.index, plan.n_frames, request.first_audio, deadline,
                                 plan.planned_at, now)
        request.delivered_frames = plan.frame_start + plan.n_frames
        return late

    def audio_streams(self) -> int:
        """Live streams that may still cut chunks for the codec lane (`CodecQueue.next_batch`)."""
        return len(self.running) + len(self.finishing)

    def live(self) -> list[RequestState]:
        return list(self.requests.values())
