"""The scheduler and the step pacer, driven with made-up step outputs (no model, no tensors)."""

from __future__ import annotations

import numpy as np
import pytest

from qwen3tts_agent.engine.scheduler import Scheduler, StepPacer
from qwen3tts_agent.engine.scheduler.device_load import (
    FIRST_FRAME_PAUSE_S,
    LATE_CHUNKS,
    LATE_CHUNKS_TO_SHED,
    LATE_WINDOW_S,
    STEP_WINDOW_S,
    DeviceLoad,
)
from qwen3tts_agent.engine.scheduler.requests import (
    FRAME_SECONDS,
    URGENT_SLACK_S,
    PromptShape,
    RequestState,
    runaway_frame_limit,
)
from qwen3tts_agent.engine.scheduler.scheduler import SLOT_WAIT_TO_SHED_S
from qwen3tts_agent.engine.scheduler.step_timing import (
    EARLY_HOLD_MARGIN_S,
    PACE_MARGIN_S,
    first_frame_in_flight,
    steps_can_wait,
)
from qwen3tts_agent.engine.scheduler.stream_limit import (
    BACKOFF,
    CUBIC_SCALE,
    CUT_INTERVAL_S,
    HOLD_S,
    StreamLimit,
)
from qwen3tts_agent.engine.types import FinishReason, TextLayout

EOS_TEXT = 999
SLOTS = 4


def make_scheduler(**kwargs: object) -> Scheduler:
    options = dict(max_slots=SLOTS, max_seq_len=64, max_text_tokens=64, max_prefill_rows=2, eos_token_id=EOS_TEXT)
    options.update(kwargs)
    return Scheduler(**options)  # type: ignore[arg-type]


def make_request(rid: str, *, schedule: tuple[int, ...] = (1, 2, 4), max_frames: int | None = 100,
                 shape: PromptShape | None = None, submitted: float = 0.0) -> RequestState:
    return RequestState(rid, shape or PromptShape(TextLayout.INTERLEAVED), schedule, submitted, max_frames=max_frames)


def start(scheduler: Scheduler, request: RequestState, text: list[int], *, closed: bool = True, now: float = 0.0) -> None:
    """Add a request and run its prompt as the core would: admit, prefill head+body, feed its text."""
    scheduler.add(request)
    scheduler.close_input(request, text) if closed else scheduler.append_text(request, text)
    scheduler.admit(now)
    for plan in scheduler.prefill_plans():
        scheduler.on_prefilled(plan, 10, now)
        if plan.body_ids is not None:  # the body takes the first token; the rest (and the end) go to the track
            trailing = plan.body_ids[1:] + ([EOS_TEXT] if plan.request.closed else [])
            scheduler.on_fed(plan.request, trailing)
    for r, ids in scheduler.text_feeds():
        scheduler.on_fed(r, ids)


def step(scheduler: Scheduler, now: float, eos: set[int] = frozenset()) -> list:  # type: ignore[assignment]
    """Launch and complete one step; slots in `eos` sample the end token. Returns the chunk plans."""
    rows = scheduler.runnable()
    slots = [r.slot for r in rows]
    seq = scheduler.on_launched(rows)
    slots_total = scheduler.max_slots
    codes = np.arange(slots_total * 16).reshape(slots_total, 16) + 1000 * seq
    finished = np.array([1 if slot in eos else 0 for slot in range(slots_total)])
    plans = scheduler.on_frame(rows, slots, codes, finished, now)
    scheduler.on_step_done(seq)
    return plans


def test_admission_is_fifo_into_the_lowest_free_slots_a_batch_at_a_time() -> None:
    scheduler = make_scheduler()
    requests = [make_request(f"r{i}") for i in range(6)]
    for r in requests:
        scheduler.add(r)
    assert [r.slot for r in scheduler.admit(0.0)] == [0, 1]  # max_prefill_rows per call
    assert [r.slot for r in scheduler.admit(0.0)] == [2, 3]
    assert scheduler.admit(0.0) == []  # no free slot
    assert [r.request_id for r in scheduler.waiting] == ["r4", "r5"]
    with pytest.raises(ValueError):
        scheduler.add(make_request("r0"))


def test_prompt_bodies_wait_for_enough_text() -> None:
    scheduler = make_scheduler()
    plain = make_request("plain")
    icl = make_request("icl", shape=PromptShape(TextLayout.INTERLEAVED, icl_codec_len=5, ref_text_len=2))
    whole = make_request("whole", shape=PromptShape(TextLayout.PREFILL))
    scheduler.max_prefill_rows = 8
    for r in (plain, icl, whole):
        scheduler.add(r)
    scheduler.admit(0.0)
    plans = {p.request.request_id: p for p in scheduler.prefill_plans()}
    assert all(p.head and p.body_ids is None for p in plans.values())  # heads run before any text
    for p in plans.values():
        scheduler.on_prefilled(p, 7, 0.0)
    assert scheduler.prefill_plans() == []
    scheduler.append_text(plain, [1])
    scheduler.append_text(icl, [1, 2])  # 2 + 2 < 5
    scheduler.append_text(whole, [1, 2, 3])
    assert [p.request.request_id for p in scheduler.prefill_plans()] == ["plain"]
    scheduler.append_text(icl, [3])  # 2 + 3 >= 5: the reference's codec span is covered
    ready = {p.request.request_id: p for p in scheduler.prefill_plans()}
    assert set(ready) == {"plain", "icl"} and not ready["icl"].head and ready["icl"].body_ids == [1, 2, 3]
    scheduler.close_input(whole, [])
    assert "whole" in {p.request.request_id for p in scheduler.prefill_plans()}  # a whole-text prompt at close
    scheduler.on_prefilled(ready["icl"], 4, 1.0)
    assert icl.position == 11 and icl.body_done and icl.consumed == 3


def test_first_frame_needs_one_text_token_past_the_prompt_body() -> None:
    """The text the first frame needs (`StreamResult.text_wait` ends when it is there): the body's, and the
    text-track token the first frame's talker step reads."""
    plain = PromptShape(TextLayout.INTERLEAVED)
    assert [plain.first_frame_ready(n, False) for n in range(3)] == [False, False, True]
    icl = PromptShape(TextLayout.INTERLEAVED, icl_codec_len=5, ref_text_len=2)
    assert [n for n in range(6) if icl.first_frame_ready(n, False)] == [4, 5]  # 5 + 1 - 2 tokens
    assert [n for n in range(6) if icl.body_ready(n, False)] == [3, 4, 5]
    early = PromptShape(TextLayout.INTERLEAVED, icl_codec_len=5, ref_text_len=2, icl_early_start=True)
    assert [n for n in range(6) if early.first_frame_ready(n, False)] == [1, 2, 3, 4, 5]
    assert [n for n in range(6) if early.body_ready(n, False)] == [1, 2, 3, 4, 5]
    long_transcript = PromptShape(TextLayout.INTERLEAVED, icl_codec_len=5, ref_text_len=7)
    assert long_transcript.first_frame_ready(0, False)  # its transcript runs past the reference's frames
    whole = PromptShape(TextLayout.PREFILL)
    assert not whole.first_frame_ready(10, False) and whole.first_frame_ready(1, True)
    assert all(shape.first_frame_ready(1, True) for shape in (plain, icl, early))


def test_text_track_feeds_new_text_then_the_end_once() -> None:
    scheduler = make_scheduler()
    r = make_request("r")
    start(scheduler, r, [5, 6], closed=False)
    assert r.track_len == 1 and not r.eos_fed  # the body took token 5
    scheduler.append_text(r, [7])
    assert scheduler.text_feeds() == [(r, [7])]
    scheduler.close_input(r, [8])
    assert scheduler.text_feeds() == [(r, [8, EOS_TEXT])]
    scheduler.on_fed(r, [8, EOS_TEXT])
    assert r.eos_fed and scheduler.text_feeds() == []


def test_a_stream_steps_only_while_it_has_text() -> None:
    scheduler = make_scheduler()
    assert not scheduler.has_runnable()
    r = make_request("r")
    start(scheduler, r, [5, 6, 7], closed=False)  # track: 6, 7
    assert scheduler.has_runnable()
    step(scheduler, 0.0)
    step(scheduler, 0.1)
    assert r.frames == 2 and scheduler.runnable() == []  # waits for text instead of padding
    assert not scheduler.has_runnable()  # what the core asks before it waits: the same answer, without the list
    scheduler.close_input(r, [])
    for ids in scheduler.text_feeds():
        scheduler.on_fed(*ids)
    assert scheduler.runnable() == [r] and scheduler.has_runnable()


def test_chunk_schedule_end_of_speech_and_the_last_chunk() -> None:
    scheduler = make_scheduler()
    r = make_request("r", schedule=(1, 2, 4))
    start(scheduler, r, [5, 6])
    sizes = []
    for i in range(6):
        for plan in step(scheduler, 0.01 * i, eos={0} if i == 5 else set()):
            sizes.append((plan.frame_start, plan.n_frames, plan.is_first, plan.is_last))
            assert plan.codes.shape == (plan.n_frames, 16)
    assert sizes == [(0, 1, True, False), (1, 2, False, False), (3, 3, False, True)]
    assert r.finish_reason is FinishReason.EOS and r.slot is None and r in scheduler.finishing


def test_a_chunks_codes_are_the_frames_own_after_the_steps_buffer_is_reused() -> None:
    """The core reads each step's codes from a host buffer that a later step overwrites: the frames waiting for
    their chunk keep their own codes, not the buffer's latest."""
    scheduler = make_scheduler()
    r = make_request("r", schedule=(3,))
    start(scheduler, r, [5, 6])
    buffer = np.zeros((SLOTS, 16), dtype=np.int64)
    for frame in range(3):
        rows = scheduler.runnable()
        seq = scheduler.on_launched(rows)
        buffer[:] = 100 + frame  # this step's codes, in the buffer the last step's were in
        plans = scheduler.on_frame(rows, [0], buffer, np.zeros(SLOTS, dtype=np.int64), 0.01 * frame)
        scheduler.on_step_done(seq)
    buffer[:] = -1
    (plan,) = plans
    assert plan.codes[:, 0].tolist() == [100, 101, 102]


def test_a_frame_in_flight_for_an_ended_stream_is_dropped_and_its_slot_waits_for_the_step() -> None:
    scheduler = make_scheduler(max_slots=1)
    r = make_request("r")
    start(scheduler, r, [5, 6])
    first = scheduler.runnable()
    seq1 = scheduler.on_launched(first)
    seq2 = scheduler.on_launched(scheduler.runnable())  # queued behind the first
    codes, finished = np.zeros((1, 16), dtype=np.int64), np.array([1])
    scheduler.on_frame(first, [0], codes, finished, 0.02)  # EOS in the first step
    scheduler.on_step_done(seq1)
    assert r.finish_reason is FinishReason.EOS and r.frames == 1
    scheduler.add(make_request("next"))
    assert scheduler.admit(0.03) == []  # the second step may still hold slot 0
    assert scheduler.on_frame(first, [0], codes, np.array([0]), 0.04) == []  # its frame is dropped
    scheduler.on_step_done(seq2)
    assert [x.slot for x in scheduler.admit(0.05)] == [0]


def test_a_stream_ended_at_its_frame_limit_frees_its_slot_while_a_step_without_it_is_in_flight() -> None:
    scheduler = make_scheduler(max_slots=2)
    short, other = make_request("short", max_frames=2), make_request("other")
    start(scheduler, short, [5, 6])
    start(scheduler, other, [5, 6])
    step(scheduler, 0.0)
    last = scheduler.runnable()
    seq = scheduler.on_launched(last)  # short's last frame
    assert scheduler.runnable() == [other]  # its limit is reached: the next step has other alone
    after = scheduler.on_launched([other])
    codes, finished = np.zeros((2, 16), dtype=np.int64), np.zeros(2)
    scheduler.on_frame(last, [r.slot for r in last], codes, finished, 0.01)
    scheduler.on_step_done(seq)
    assert short.finish_reason is FinishReason.MAX_FRAMES
    scheduler.add(make_request("next"))
    assert [x.slot for x in scheduler.admit(0.02)] == [0]  # step `after` is in flight, but never held slot 0
    scheduler.on_step_done(after)


def test_cancel_frees_the_slot_at_once_when_no_step_is_in_flight() -> None:
    scheduler = make_scheduler(max_slots=1)
    r = make_request("r")
    start(scheduler, r, [5], closed=False)
    scheduler.finish(r, FinishReason.CANCELLED)
    assert not scheduler.is_live(r) and r.finish_reason is FinishReason.CANCELLED
    scheduler.add(make_request("next"))
    assert [x.slot for x in scheduler.admit(0.0)] == [0]


def test_runaway_guard_ends_a_stream_that_never_reaches_end_of_speech() -> None:
    scheduler = make_scheduler(max_seq_len=4096)
    r = make_request("r", max_frames=1000, schedule=(64,))
    text = [5, 6, 7]
    start(scheduler, r, text)
    assert r.frame_limit == runaway_frame_limit(len(text))
    unbounded = make_request("u", max_frames=None)
    assert unbounded.frame_limit is None  # no max_frames, text still open: nothing bounds it yet
    unbounded.closed = True
    unbounded.text_ids = text
    assert unbounded.frame_limit == runaway_frame_limit(len(text))  # then the guard alone
    unbounded.runaway_guard = False
    assert unbounded.frame_limit is None
    n = 0
    while scheduler.runnable():
        step(scheduler, 0.0)
        n += 1
    assert n == r.frames == runaway_frame_limit(len(text)) and r.finish_reason is FinishReason.LENGTH
    explicit = make_request("x", max_frames=3, schedule=(64,))
    start(scheduler, explicit, text)
    while scheduler.runnable():
        step(scheduler, 0.0)
    assert explicit.frames == 3 and explicit.finish_reason is FinishReason.MAX_FRAMES
    fixed = make_request("f", max_frames=200, schedule=(64,))
    fixed.runaway_guard = False  # fixed-length output (ignore_eos): only max_frames counts
    start(scheduler, fixed, text)
    while scheduler.runnable():
        step(scheduler, 0.0)
    assert fixed.frames == 200 and fixed.finish_reason is FinishReason.MAX_FRAMES


def test_a_stream_close_to_its_deadline_gets_its_frames_decoded_early() -> None:
    for adapt in (True, False):
        scheduler = make_scheduler(adapt_chunks=adapt)
        r = make_request("r", schedule=(1, 8))
        start(scheduler, r, [5, 6])
        [first] = step(scheduler, 0.0)
        scheduler.on_delivered(first, now=1.0)  # played from t=1.0: the next chunk is due at 1.08
        assert step(scheduler, 1.0) == []  # plenty of slack: wait to fill the 8-frame chunk
        plans = step(scheduler, 1.08 - URGENT_SLACK_S / 2)
        assert [p.n_frames for p in plans] == ([2] if adapt else [])


def test_chunks_are_handed_out_most_urgent_first() -> None:
    scheduler = make_scheduler()
    a, b, c = (make_request(x, schedule=(1, 1), submitted=t) for x, t in (("a", 0.0), ("b", 0.1), ("c", 0.2)))
    for r in (a, b):
        start(scheduler, r, [5, 6])
    for plan in step(scheduler, 0.3):
        scheduler.on_delivered(plan, now=0.4 if plan.request is a else 0.35)  # b's deadline comes first
    start(scheduler, c, [5, 6])
    plans = step(scheduler, 0.45)
    assert [p.request.request_id for p in plans] == ["c", "b", "a"]  # a first chunk, then by deadline


def test_late_chunks_are_counted_and_several_are_evidence_of_load_for_a_while() -> None:
    scheduler = make_scheduler()
    r = make_request("r", schedule=(1,), max_frames=None)
    start(scheduler, r, list(range(20)))
    [first] = step(scheduler, 0.0)
    assert scheduler.on_delivered(first, now=1.0) is None  # a first chunk has no deadline
    late = 0.03
    for i in range(LATE_CHUNKS_TO_SHED):
        [chunk] = step(scheduler, 1.0 + i * 0.01)
        assert not scheduler.load.late_chunks(1.0)
        left = 1.0 + (i + 1) * FRAME_SECONDS + (i + 1) * late  # later and later
        told = scheduler.on_delivered(chunk, now=left)  # what the core logs (engine/core/late_trace.py)
        assert told == ("r", i + 1, 1, 1.0, 1.0 + (i + 1) * FRAME_SECONDS, 1.0 + i * 0.01, left)
        assert told is not None and told.cause == "decode"
    assert scheduler.load.stats.late_chunks == LATE_CHUNKS_TO_SHED
    # the chunks after the first, one frame each, by their place: the second ("1"), the third, the fourth, later
    places = ["1", "2", "3", *["4+"] * LATE_CHUNKS_TO_SHED][:LATE_CHUNKS_TO_SHED]
    assert scheduler.load.stats.late_by_index == {key: places.count(key) for key in ("1", "2", "3", "4+")}
    # each was cut (its frame made) before it was due: the decode, not the frames, came late
    assert scheduler.load.stats.late_by_cause == {"frames": 0, "decode": LATE_CHUNKS_TO_SHED}
    # chunk k is due k frames after the first and left k * 30 ms after that
    assert scheduler.load.stats.underrun_seconds == pytest.approx(sum(k * late for k in range(1, LATE_CHUNKS_TO_SHED + 1)))
    now = 1.0 + LATE_CHUNKS_TO_SHED * (FRAME_SECONDS + late)
    assert scheduler.load.late_chunks(now) and not scheduler.load.late_chunks(now + LATE_WINDOW_S + 0.5)



def regrowth_s(peak: float, slots: int) -> float:
    """Seconds from a cut with `peak` streams there until the limit is back at every slot: the hold, CUBIC's `K`
    (back at the peak) and the cubic's climb from the peak to the slots."""
    growth = CUBIC_SCALE * slots
    return HOLD_S + ((peak - BACKOFF * peak) / growth) ** (1 / 3) + ((slots - peak) / growth) ** (1 / 3)


def test_late_chunks_cut_the_limit_to_a_fraction_of_the_streams_there_then_it_grows_back_to_every_slot() -> None:
    slots = 200
    limit = StreamLimit(max_slots=slots)
    assert limit.limit(0.0) == 200 and not limit.refuses(300, 0.0)  # off: requests may wait for a slot
    assert limit.on_late(streams=100, now=10.0)
    assert limit.limit(10.0) == pytest.approx(BACKOFF * 100)
    assert limit.refuses(int(BACKOFF * 100), 10.0) and not limit.refuses(int(BACKOFF * 100) - 1, 10.0)
    # more late chunks of the same excess do not cut again within the interval
    assert not limit.on_late(streams=95, now=10.0 + CUT_INTERVAL_S / 2)
    assert limit.limit(10.0 + HOLD_S) == pytest.approx(BACKOFF * 100)  # held, then it grows
    # as CUBIC's window: back at the 100 streams of the cut after K seconds, flat around them, steep away from them
    growth = CUBIC_SCALE * slots
    back = 10.0 + HOLD_S + ((100 - BACKOFF * 100) / growth) ** (1 / 3)
    assert limit.limit(back) == pytest.approx(100)
    assert 99 < limit.limit(back - 0.2) < 100 < limit.limit(back + 0.2) < 101
    assert limit.limit(back - 1.0) < 99 and limit.limit(back + 1.0) > 101
    after = back + 2.0
    assert limit.limit(after) == pytest.approx(100 + growth * 2.0**3)
    # lateness that goes on cuts again, from the limit where fewer streams are there than it allows
    assert limit.on_late(streams=150, now=after)
    assert limit.limit(after) == pytest.approx(BACKOFF * (100 + growth * 2.0**3))
    assert limit.cuts == 2
    assert limit.limit(after + 1000.0) == 200 and not limit.refuses(300, after + 1000.0)  # off again
    assert limit.on_late(streams=0, now=after + 1000.0) and limit.limit(after + 1000.0) == 1  # nor below one
    with pytest.raises(ValueError, match="max_slots"):
        StreamLimit(0)


def test_the_seconds_the_limit_spends_below_the_slots_add_up_over_its_cuts() -> None:
    """`limited_seconds` is what a cut cost admission: from the cut until the limit is back at every slot, a cut
    that comes before the last one's regrowth ends that stretch where it begins its own. A cut with few streams
    there (a burst's, say: its limit low) is back at every slot within seconds too, not many times later than one
    near the slots."""
    slots = 200
    limit = StreamLimit(max_slots=slots)
    assert limit.limited_seconds(50.0) == 0.0  # never cut
    assert limit.on_late(streams=180, now=10.0)
    regrowth = regrowth_s(180, slots)
    assert limit.limited_seconds(10.0 + regrowth / 2) == pytest.approx(regrowth / 2)
    assert limit.limited_seconds(100.0) == pytest.approx(regrowth)  # back at every slot: the count stops
    assert limit.limit(10.0 + regrowth) == pytest.approx(slots) and limit.limit(10.0 + regrowth - 0.01) < slots
    # a second cut inside the first one's regrowth: the first stretch ends there
    second = 10.0 + regrowth / 2
    limit = StreamLimit(max_slots=slots)
    limit.on_late(streams=180, now=10.0)
    before = limit.limit(second)  # regrowing, below the 190 streams there: the second cut starts from it
    assert before < 190 and limit.on_late(streams=190, now=second)
    assert limit.limit(second) == pytest.approx(BACKOFF * before)
    assert limit.limited_seconds(1000.0) == pytest.approx(regrowth / 2 + regrowth_s(before, slots))
    # a cut with 20 streams there: a low limit, yet back at every slot within 1.3 times the cut at 180's seconds
    few = StreamLimit(max_slots=slots)
    few.on_late(streams=20, now=0.0)
    assert few.limited_seconds(1000.0) == pytest.approx(regrowth_s(20, slots))
    assert regrowth < few.limited_seconds(1000.0) < 1.3 * regrowth
    one = StreamLimit(max_slots=1)
    assert one.on_late(streams=1, now=0.0) and one.limited_seconds(10.0) == 0.0  # one slot: never below it


def test_late_chunks_make_the_scheduler_refuse_past_fewer_streams_not_every_new_stream() -> None:
    """Ten streams live, their chunks late: the scheduler takes on fewer streams (a new one comes in as others
    leave) instead of refusing every new stream while the lateness lasts, and later takes on every slot again."""
    slots = 12
    scheduler = make_scheduler(max_slots=slots)
    live = [make_request(f"r{i}", schedule=(1,), max_frames=None) for i in range(10)]
    for r in live:
        start(scheduler, r, list(range(20)))
    for plan in step(scheduler, 0.0):
        scheduler.on_delivered(plan, now=1.0)  # first audio at 1.0: the next chunks are due one frame on
    assert scheduler.refusal_reason(1.0) is None
    late_at = 1.0 + FRAME_SECONDS + 0.05
    for plan in step(scheduler, late_at):
        scheduler.on_delivered(plan, now=late_at)
    assert scheduler.load.stats.late_chunks == len(live) >= LATE_CHUNKS_TO_SHED
    assert scheduler.stream_limit.cuts == 1  # one cut for the lot
    assert scheduler.stream_limit.limit(late_at) == pytest.approx(BACKOFF * len(live))
    assert scheduler.refusal_reason(late_at) == LATE_CHUNKS  # a tenth would pass 9 (the old rule: every new one)
    scheduler.finish(live[0], FinishReason.CANCELLED)
    assert scheduler.refusal_reason(late_at) == LATE_CHUNKS
    scheduler.finish(live[1], FinishReason.CANCELLED)
    assert scheduler.refusal_reason(late_at) is None  # eight left: a new stream takes a place
    start(scheduler, make_request("next"), [5, 6], now=late_at)
    assert scheduler.refusal_reason(late_at) == LATE_CHUNKS
    # the evidence fades within a second; held, then growing, the limit lets a tenth stream in once it is back at
    # the ten streams of the cut ...
    assert not scheduler.load.late_chunks(late_at + LATE_WINDOW_S + 0.01)
    tenth = late_at + HOLD_S + ((len(live) - BACKOFF * len(live)) / (CUBIC_SCALE * slots)) ** (1 / 3)
    assert scheduler.refusal_reason(tenth - 0.1) == LATE_CHUNKS and scheduler.refusal_reason(tenth + 0.1) is None
    # ... and is back at every slot, and off, a few seconds after the cut
    regrown = late_at + regrowth_s(len(live), slots)
    assert scheduler.stream_limit.limit(regrown - 0.01) < slots == scheduler.stream_limit.limit(regrown + 1e-6)


def test_slow_steps_make_the_scheduler_refuse_new_streams() -> None:
    load = DeviceLoad()
    for i in range(10):
        load.record_step_time(0.02, 0.02 * i)  # 4x faster than real time
    assert not load.slow_steps(0.2)
    for i in range(10):
        load.record_step_time(0.07, 0.2 + 0.07 * i)  # barely faster than real time: no headroom
    assert load.step_seconds(0.9) == pytest.approx((10 * 0.02 + 10 * 0.07) / 20)
    assert not load.slow_steps(0.9)  # the fast steps still weigh in
    assert load.slow_steps(1.25)  # the last second's steps: nine of 0.07 s


def test_one_long_step_counts_for_the_step_window_and_then_not_at_all_whether_steps_follow_or_not() -> None:
    """A first compile for new shapes, a capture, a stall: one step of seconds. It is evidence of load for
    STEP_WINDOW_S after it ended, then none, with steps after it or without (a moving average over steps kept
    it for good when nothing stepped, and refused every stream from then on)."""
    idle = DeviceLoad()
    idle.record_step_time(0.01, 99.0)
    idle.record_step_time(25.0, 100.0)  # nothing steps after it
    assert idle.slow_steps(100.0) and idle.slow_steps(100.0 + STEP_WINDOW_S)
    assert not idle.slow_steps(100.0 + STEP_WINDOW_S + 0.001) and idle.step_seconds(100.0 + STEP_WINDOW_S + 0.001) == 0.0
    busy = DeviceLoad()
    busy.record_step_time(25.0, 100.0)
    ends = [100.0 + 0.02 * (i + 1) for i in range(100)]  # fast steps go on for two seconds after it
    for end in ends:
        busy.record_step_time(0.02, end)
        if end <= 100.0 + STEP_WINDOW_S:
            assert busy.slow_steps(end), end
    assert not busy.slow_steps(ends[-1]) and busy.step_seconds(ends[-1]) == pytest.approx(0.02)


def test_late_chunks_and_the_first_frame_pause_fade_in_time_without_deliveries() -> None:
    load = DeviceLoad()
    for i in range(LATE_CHUNKS_TO_SHED):
        load.on_delivered(deadline=10.0, now=10.1 + 0.01 * i, chunk_index=4 + i, cut_at=9.9)  # left late
    last = 10.1 + 0.01 * (LATE_CHUNKS_TO_SHED - 1)
    assert load.late_chunks(last) and load.first_frames_paused(last)
    assert not load.late_chunks(last + LATE_WINDOW_S + 0.001)  # nothing delivered since: it fades all the same
    assert load.first_frames_paused(last + FIRST_FRAME_PAUSE_S - 0.001)
    assert not load.first_frames_paused(last + FIRST_FRAME_PAUSE_S)
    assert load.stats.late_chunks == LATE_CHUNKS_TO_SHED  # the counters keep every late chunk


def test_a_late_chunk_is_booked_to_its_frames_when_they_were_made_after_it_was_due() -> None:
    """Why a chunk left late: its frames came after its deadline (the step pace) or it was cut in time and its
    decode or delivery came late (the codec lane)."""
    scheduler = make_scheduler()
    r = make_request("r", schedule=(1,), max_frames=None)
    start(scheduler, r, list(range(20)))
    [first] = step(scheduler, 0.0)
    scheduler.on_delivered(first, now=1.0)  # the second chunk is due at 1.08
    for k in (1, 2):  # the second and third chunks' frames made 5 ms after each was due
        [cut_late] = step(scheduler, 1.0 + k * FRAME_SECONDS + 0.005)
        scheduler.on_delivered(cut_late, now=1.0 + k * FRAME_SECONDS + 0.006)
    [cut_in_time] = step(scheduler, 1.0 + 3 * FRAME_SECONDS - 0.02)  # the fourth's frame 20 ms before it is due
    scheduler.on_delivered(cut_in_time, now=1.0 + 3 * FRAME_SECONDS + 0.004)  # decoded 4 ms past its deadline
    assert scheduler.load.stats.late_chunks == 3
    assert scheduler.load.stats.late_by_cause == {"frames": 2, "decode": 1}


def test_chunks_late_within_the_shedding_tolerance_are_counted_but_refuse_nothing() -> None:
    """`shed_lateness_s`: chunks a few ms late are booked (stats, metrics) but are no evidence of load; the same
    number later than the tolerance refuse new streams and pause the first-frame slots as before."""
    load = DeviceLoad(shed_lateness_s=0.02)
    for i in range(2 * LATE_CHUNKS_TO_SHED):
        load.on_delivered(deadline=10.0 + 0.01 * i, now=10.019 + 0.01 * i, chunk_index=1, cut_at=9.9)  # 19 ms late
    assert load.stats.late_chunks == 2 * LATE_CHUNKS_TO_SHED and load.stats.late_by_index["1"] == 2 * LATE_CHUNKS_TO_SHED
    assert load.stats.underrun_seconds == pytest.approx(2 * LATE_CHUNKS_TO_SHED * 0.019)
    now = 10.02 + 0.01 * (2 * LATE_CHUNKS_TO_SHED)
    assert not load.late_chunks(now) and not load.first_frames_paused(now)
    for i in range(LATE_CHUNKS_TO_SHED):
        load.on_delivered(deadline=11.0, now=11.021 + 0.001 * i, chunk_index=2, cut_at=10.9)  # 21 ms late +
    assert load.late_chunks(11.03) and load.first_frames_paused(11.03)
    assert load.stats.late_chunks == 3 * LATE_CHUNKS_TO_SHED
    with pytest.raises(ValueError, match="shed_lateness_s"):
        DeviceLoad(shed_lateness_s=-0.001)


def test_an_engine_with_nothing_live_admits_whatever_its_recent_steps_say() -> None:
    """The evidence was about load that left with its streams: with no request live the scheduler never refuses;
    once one is, the same evidence counts again."""
    scheduler = make_scheduler()
    scheduler.load.record_step_time(25.0, 1.0)
    assert scheduler.load.slow_steps(1.1) and not scheduler.overloaded(1.1)
    r = make_request("r", max_frames=2)
    start(scheduler, r, [5, 6], now=1.1)
    assert scheduler.overloaded(1.1)  # a stream is live: the device's last second of steps was slow
    assert not scheduler.overloaded(1.0 + STEP_WINDOW_S + 0.01)  # and then it was not
    scheduler.finish(r, FinishReason.CANCELLED)
    assert not scheduler.overloaded(1.1)


def test_a_request_kept_waiting_for_a_slot_refuses_new_streams_until_it_has_one() -> None:
    """Every slot taken, a request that has waited SLOT_WAIT_TO_SHED_S for its first slot is evidence that new
    streams would wait as long: the scheduler refuses them until it has a slot. The device's own evidence says
    nothing (no step is slow, no chunk late)."""
    scheduler = make_scheduler()
    for i in range(SLOTS):
        start(scheduler, make_request(f"r{i}"), [5, 6], now=1.0)
    queued = make_request("queued")
    queued.arrived = 1.0
    scheduler.add(queued)
    assert scheduler.admit(1.0) == [] and scheduler.slot_wait(1.0) == 0.0
    assert scheduler.slot_wait(1.05) == pytest.approx(0.05) and not scheduler.overloaded(1.05)
    waited = 1.0 + SLOT_WAIT_TO_SHED_S
    assert scheduler.overloaded(waited) and not scheduler.load.slow_steps(waited) and not scheduler.load.late_chunks(waited)
    scheduler.finish(scheduler.get("r0"), FinishReason.CANCELLED)  # no step in flight: its slot is free at once
    assert scheduler.admit(1.2) == [queued]
    assert scheduler.slot_wait(1.2) == 0.0 and not scheduler.overloaded(1.2)


def test_pacer_queues_the_next_step_just_before_the_one_in_flight_ends() -> None:
    pacer = StepPacer(margin_s=0.001, max_in_flight=2)
    assert pacer.may_launch(0.0)
    pacer.launched(8, 0.0)
    assert pacer.may_launch(0.0)  # the bucket was never measured: no basis for waiting
    pacer.completed(0.010)
    pacer.launched(8, 1.0)
    assert pacer.expected_end() == pytest.approx(1.010)
    assert not pacer.may_launch(1.005) and pacer.may_launch(1.0095)
    pacer.launched(8, 1.0095)
    assert not pacer.may_launch(5.0)  # two in flight
    pacer.completed(0.012)
    assert pacer.may_launch(5.0)


def test_the_step_clock_spaces_batched_steps_and_first_frame_steps_do_not_tick_it() -> None:
    pacer = StepPacer(step_period_s=0.02)
    assert pacer.clock_tick() < 0.0  # no batched step yet
    pacer.launched(8, 1.0)
    assert pacer.clock_tick() == pytest.approx(1.02)
    assert pacer.clock_tick(period_s=0.005) == pytest.approx(1.005)  # a shorter period
    pacer.completed(0.005)
    pacer.launched(4, 1.01, batched=False)  # a step of new streams' first frames: not a tick
    assert pacer.clock_tick() == pytest.approx(1.02)
    assert StepPacer().clock_tick() == float("-inf")  # period 0: the clock never holds a step back


def test_the_pacer_says_when_the_next_step_may_launch() -> None:
    """`StepPacer.launch_at`: at once with nothing in flight; the expected end of the step in flight less the
    margin; not known while a queued bucket is unmeasured or every place in flight is taken."""
    pacer = StepPacer(margin_s=0.001)
    assert pacer.launch_at() == float("-inf")
    pacer.launched(8, 1.0)
    assert pacer.launch_at() == float("inf")  # bucket 8 never measured
    pacer.completed(0.010)
    pacer.launched(8, 2.0)
    assert pacer.launch_at() == pytest.approx(2.009)
    assert not pacer.may_launch(2.0085) and pacer.may_launch(2.009)
    pacer.launched(8, 2.009)
    assert pacer.launch_at() == float("inf")  # both places in flight taken
    with pytest.raises(ValueError):
        StepPacer(step_period_s=-0.01)


def test_the_clocks_period_shrinks_with_the_slots_left_from_three_quarters_held_to_none_at_full_slots() -> None:
    scheduler = make_scheduler(max_slots=8)
    periods = []
    for i in range(9):  # the ninth waits for a slot
        periods.append(scheduler.clock_period(0.02))
        start(scheduler, make_request(f"r{i}"), [5, 6])
    periods.append(scheduler.clock_period(0.02))
    assert len(scheduler.waiting) == 1
    # 0..6 of 8 held: the period; 7 held: a half of it (1/8 left of the last quarter's 2/8); 8 held and more: none
    assert periods == pytest.approx([0.02] * 7 + [0.01, 0.0, 0.0])


def test_batched_steps_keep_to_the_clock_under_load_unless_they_carry_a_first_frame() -> None:
    scheduler = make_scheduler(pace_load=2)
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    start(scheduler, a, [5, 6])
    step(scheduler, 0.0)
    assert not scheduler.paced(scheduler.runnable())  # one stream stepping: below the load, as fast as it goes
    start(scheduler, b, [5, 6])
    assert not scheduler.paced(scheduler.runnable())  # b's first frame is in it: it goes at once
    step(scheduler, 0.01)
    assert scheduler.paced(scheduler.runnable())
    start(scheduler, c, [5, 6])
    assert not scheduler.paced(scheduler.runnable())
    assert not make_scheduler().paced([a, b])  # no pace load: never


def test_on_a_full_device_a_new_streams_first_frame_waits_for_the_clock_too() -> None:
    """From `clock_first_frame_load` streams stepping, a step carrying a first frame is paced like any other
    (no step of every row set off by each arrival), and below it is not."""
    scheduler = make_scheduler(pace_load=2, clock_first_frame_load=3)
    running = [make_request(f"r{i}") for i in range(3)]
    for r in running[:2]:
        start(scheduler, r, [5, 6])
    step(scheduler, 0.0)
    start(scheduler, running[2], [5, 6])
    assert not scheduler.paced(scheduler.runnable())  # two stepping: its first frame goes at once
    step(scheduler, 0.01)
    new = make_request("new")
    start(scheduler, new, [5, 6])
    rows = scheduler.runnable()
    assert new in rows and scheduler.paced(rows)  # three stepping: it waits for the tick with them
    assert scheduler.pace_release(rows, 0.01, 0.02) == float("inf")  # nobody presses before their next chunk
    with pytest.raises(ValueError):
        make_scheduler(clock_first_frame_load=-1)


def test_on_a_full_device_new_streams_take_no_first_frame_slot() -> None:
    """First-frame slots serve from `first_frame_load` streams stepping up to `clock_first_frame_load`: above
    it a new stream takes the lowest slot as a batched stream, and no room is made there for arrivals."""
    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2, clock_first_frame_load=2)
    _, busy = _under_load(scheduler)  # two stepping (slots 2, 3), slots 0 and 1 free again
    new = make_request("new")
    start(scheduler, new, [5, 6], now=0.02)
    assert new.slot == 0 and scheduler.first_frame_rows(0.02, 0.02) == []
    rows = scheduler.runnable()
    assert new in rows and scheduler.early_release(rows, 0.02, 0.02) == float("-inf")
    step(scheduler, 0.03)
    other = make_request("other")
    start(scheduler, other, [5, 6], now=0.04)  # slot 1, the last first-frame slot
    scheduler.add(make_request("waiting"))
    assert scheduler.make_room(0.04, 0.02) == []
    below = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2, clock_first_frame_load=3)
    _under_load(below)
    fresh = make_request("fresh")
    start(below, fresh, [5, 6], now=0.02)
    assert below.first_frame_rows(0.02, 0.02) == [fresh]  # two stepping, under the clock load: a first-frame slot


def test_a_first_frame_is_in_flight_from_its_launch_until_its_codes_are_read() -> None:
    scheduler = make_scheduler()
    a, b = make_request("a"), make_request("b")
    start(scheduler, a, [5, 6])
    step(scheduler, 0.0)
    start(scheduler, b, [5, 6])
    assert not first_frame_in_flight(scheduler.runnable())  # b's first frame is not queued yet
    rows = scheduler.runnable()
    seq = scheduler.on_launched(rows)
    assert first_frame_in_flight(scheduler.runnable())
    codes = np.zeros((SLOTS, 16), dtype=np.int64)
    scheduler.on_frame(rows, [r.slot for r in rows], codes, np.zeros(SLOTS), 0.01)
    scheduler.on_step_done(seq)
    assert not first_frame_in_flight(scheduler.runnable())


def test_the_clock_lets_a_step_go_early_when_a_streams_next_chunk_would_be_late() -> None:

    scheduler = make_scheduler(pace_load=1)
    a = make_request("a", schedule=(1, 2, 4))
    start(scheduler, a, [5, 6])
    assert scheduler.pace_release([a], 0.0, 0.02) == float("inf")  # no first audio yet: nothing is due
    [first] = step(scheduler, 0.0)
    scheduler.on_delivered(first, now=0.01)  # the second chunk (2 frames) is due at 0.01 + 0.08
    assert scheduler.pace_release([a], 0.01, 0.02) == pytest.approx(0.09 - 2 * 0.02 - PACE_MARGIN_S)
    step(scheduler, 0.02)  # one of them made
    assert scheduler.pace_release([a], 0.02, 0.02) == pytest.approx(0.09 - 0.02 - PACE_MARGIN_S)
    scheduler.on_launched([a])  # the other in flight: the chunk needs no more steps
    assert scheduler.pace_release([a], 0.02, 0.02) == float("inf")


def test_the_release_counts_the_missing_frames_at_the_devices_step_time_up_to_a_period() -> None:

    scheduler = make_scheduler(pace_load=1)
    a = make_request("a", schedule=(1, 2, 4))
    start(scheduler, a, [5, 6])
    [first] = step(scheduler, 0.0)
    scheduler.on_delivered(first, now=0.01)  # the second chunk (2 frames) is due at 0.09
    scheduler.load.record_step_time(0.005, 0.01)
    assert scheduler.pace_release([a], 0.01, 0.02) == pytest.approx(0.09 - 2 * 0.005 - PACE_MARGIN_S)
    scheduler.load.record_step_time(0.095, 0.01)  # steps slower than the period on average: one a period
    assert scheduler.pace_release([a], 0.01, 0.02) == pytest.approx(0.09 - 2 * 0.02 - PACE_MARGIN_S)
    # no step ended within the window: a period each, not the old steps' time
    assert scheduler.pace_release([a], 0.01 + STEP_WINDOW_S + 0.01, 0.02) == pytest.approx(0.09 - 2 * 0.02 - PACE_MARGIN_S)
    scheduler.load.record_step_time(0.005, 2.0)
    assert scheduler.pace_release([a], 2.0, 0.02) == pytest.approx(0.09 - 2 * 0.005 - PACE_MARGIN_S)


def test_steps_may_wait_for_audio_only_when_every_stream_is_well_ahead_of_its_listener() -> None:
    scheduler = make_scheduler()
    ahead, fresh = make_request("ahead", schedule=(1, 64)), make_request("fresh", schedule=(1, 64))
    start(scheduler, ahead, [5, 6], closed=False)
    [first] = step(scheduler, 0.0)
    scheduler.on_delivered(first, now=0.0)
    for i in range(12):  # 13 frames made (1.04 s) by t=0.2: 0.84 s ahead of playback
        scheduler.append_text(ahead, [7])
        for r, ids in scheduler.text_feeds():
            scheduler.on_fed(r, ids)
        step(scheduler, 0.01 * i)
    assert ahead.ahead_s(0.2) == pytest.approx(13 * FRAME_SECONDS - 0.2)
    assert steps_can_wait([ahead], 0.2)
    assert not steps_can_wait([ahead], 0.7)  # played on: now only 0.34 s ahead
    start(scheduler, fresh, [5, 6])
    assert not steps_can_wait([ahead, fresh], 0.2)  # a stream without first audio never waits


def _prefill(scheduler: Scheduler, now: float = 0.0) -> None:
    """Admit and prefill as the core would, feeding each body's trailing tokens (none while text streams)."""
    scheduler.admit(now)
    for plan in scheduler.prefill_plans():
        scheduler.on_prefilled(plan, 10, now)
        if plan.body_ids is not None:
            scheduler.on_fed(plan.request, plan.body_ids[1:])


def test_first_frame_runs_on_the_tentative_second_token_and_settles_when_it_is_final() -> None:
    scheduler = make_scheduler()
    r = make_request("r")
    scheduler.add(r)
    scheduler.append_text(r, [5], tentative=[6])  # "Hello" final, " there" as the text stands
    _prefill(scheduler)
    assert scheduler.text_feeds() == [(r, [6])] and r.speculated == 6
    scheduler.on_fed(r, [6])
    assert scheduler.runnable() == [r]
    assert len(step(scheduler, 0.01)) == 1  # its first chunk is due (the core holds its audio)
    assert scheduler.runnable() == []  # the second frame needs the third token, final
    scheduler.append_text(r, [], tentative=[6])
    assert scheduler.settle_speculation(r) is None  # still tentative, still the same token
    scheduler.append_text(r, [6, 7], tentative=[8])
    assert scheduler.settle_speculation(r) is True and r.speculated is None
    assert scheduler.text_feeds() == [(r, [7])]  # 6 is on the track already
    assert scheduler.settle_speculation(r) is None


def test_a_wrong_speculation_starts_the_request_over_without_speculating_again() -> None:
    scheduler = make_scheduler(max_slots=2)
    r = make_request("r")
    scheduler.add(r)
    scheduler.append_text(r, [5], tentative=[6])  # " wor" ...
    _prefill(scheduler)
    scheduler.on_fed(r, scheduler.text_feeds()[0][1])
    rows = scheduler.runnable()
    slots = [x.slot for x in rows]
    seq = scheduler.on_launched(rows)
    scheduler.append_text(r, [], tentative=[9])  # ... became " world"
    assert scheduler.settle_speculation(r) is False
    fresh = scheduler.restart(r)
    assert scheduler.get("r") is fresh and not scheduler.is_live(r) and scheduler.waiting == [fresh]
    assert fresh.text_ids == [5] and fresh.tentative == [9] and fresh.slot is None and fresh.track_len == 0
    codes = np.zeros((SLOTS, 16), dtype=np.int64)
    assert scheduler.on_frame(rows, slots, codes, np.zeros(SLOTS), 0.02) == [] and r.frames == 0  # the old frame is dropped
    scheduler.on_step_done(seq)
    _prefill(scheduler)
    assert fresh.slot is not None and fresh.body_done
    assert scheduler.text_feeds() == [] and scheduler.runnable() == []  # waits for " world" to be final
    scheduler.append_text(fresh, [9], tentative=[10])
    assert scheduler.text_feeds() == [(fresh, [9])]


def test_only_an_open_interleaved_text_with_one_final_token_speculates() -> None:
    cases = {
        "icl": (PromptShape(TextLayout.INTERLEAVED, icl_codec_len=2, ref_text_len=1), [5], False),
        "whole": (PromptShape(TextLayout.PREFILL), [5], False),
        "two final": (PromptShape(TextLayout.INTERLEAVED), [5, 6], False),
        "closed": (PromptShape(TextLayout.INTERLEAVED), [5], True),
    }
    for name, (shape, text, closed) in cases.items():
        scheduler = make_scheduler()
        r = make_request(name, shape=shape)
        scheduler.add(r)
        scheduler.close_input(r, text) if closed else scheduler.append_text(r, text, tentative=[7])
        _prefill(scheduler)
        assert all(request.speculated is None for request, _ in scheduler.text_feeds()), name
    off = make_scheduler(speculate=False)
    r = make_request("off")
    off.add(r)
    off.append_text(r, [5], tentative=[6])
    _prefill(off)
    assert off.text_feeds() == [] and r.speculated is None


def test_frames_after_a_chunk_cut_short_wait_for_their_own_chunks_time_not_the_decoding_ones() -> None:
    """A chunk cut short for its deadline covers the listener once it is decoded and sent: the frames made while
    it decodes belong to the next scheduled chunk, needed when the audio cut so far has played. (They were
    cut at once, one by one, against the deadline of the chunk still decoding: more chunks shorter than their
    schedule, and more codec calls, for no audio sooner.)"""
    scheduler = make_scheduler()
    r = make_request("r", schedule=(1, 8))
    start(scheduler, r, [5, 6])
    [first] = step(scheduler, 0.0)
    scheduler.on_delivered(first, now=1.0)  # played from 1.0: the second chunk is needed at 1.08
    step(scheduler, 1.0)
    [second] = step(scheduler, 1.08 - URGENT_SLACK_S / 2)  # cut short, 2 frames: the third is needed at 1.24
    assert (second.index, second.n_frames) == (1, 2) and r.runs_out() == pytest.approx(1.24)
    assert step(scheduler, 1.07) == [] and step(scheduler, 1.08) == []  # the second still decodes: no 1-frame chunks
    scheduler.on_delivered(second, now=1.085)  # it left 5 ms late
    assert step(scheduler, 1.09) == []  # 3 of 8 made, 150 ms left: wait for the rest
    [third] = step(scheduler, 1.24 - URGENT_SLACK_S / 2)  # a fourth, and now it is needed within 40 ms
    assert (third.index, third.frame_start, third.n_frames) == (2, 3, 4)


def test_a_chunk_cut_short_for_its_deadline_is_as_long_as_one_codec_call_takes() -> None:
    """With decodes graphed for 1, 2, 4 and 8 frames, 7 urgent pending frames go as 4 (one call, batched
    with other streams' 4-frame chunks); the other 3 are due 320 ms later and wait for the schedule."""
    for sizes, expected in (((1, 2, 4, 8), 4), ((), 7)):
        scheduler = make_scheduler(decode_sizes=sizes)
        r = make_request("r", schedule=(1, 16))
        start(scheduler, r, [5, 6])
        [first] = step(scheduler, 0.0)
        scheduler.on_delivered(first, now=0.0)  # the next chunk is due at 0.08
        for i in range(6):
            assert step(scheduler, 0.001 * i) == []
        plans = step(scheduler, 0.08 - URGENT_SLACK_S / 2)
        assert [p.n_frames for p in plans] == [expected] and len(r.pending) == 7 - expected


def _prefill_all(scheduler: Scheduler, now: float) -> None:
    """Run every ready prompt piece and feed the text that follows, as the core does each turn."""
    for plan in scheduler.prefill_plans():
        scheduler.on_prefilled(plan, 10, now)
        if plan.body_ids is not None:
            scheduler.on_fed(plan.request, plan.body_ids[1:] + [EOS_TEXT])
    for r, ids in scheduler.text_feeds():
        scheduler.on_fed(r, ids)


def _frame(scheduler: Scheduler, rows: list[RequestState], now: float) -> list:  # type: ignore[type-arg]
    """Launch one step of `rows` alone (as a first-frame step) and read it back at `now`; the chunk plans."""
    slots = [r.slot for r in rows]
    seq = scheduler.on_launched(rows)
    codes, finished = np.arange(8 * 16).reshape(8, 16) + 1000 * seq, np.zeros(8)
    plans = scheduler.on_frame(rows, slots, codes, finished, now)  # type: ignore[arg-type]
    scheduler.on_step_done(seq)
    return plans


def _under_load(scheduler: Scheduler) -> tuple[list[RequestState], list[RequestState]]:
    """Two streams in the first-frame slots (0, 1) stepping, two more above them (2, 3), then the first two end."""
    early = [make_request(f"early{i}") for i in range(2)]
    for r in early:
        start(scheduler, r, [5, 6])
    assert [r.slot for r in early] == [0, 1]  # light load: the lowest slots, to stay
    step(scheduler, 0.0)
    busy = [make_request(f"busy{i}") for i in range(2)]
    for r in busy:
        start(scheduler, r, [5, 6])
    assert [r.slot for r in busy] == [2, 3]  # under load, but no first-frame slot is free: the lowest above
    assert scheduler.first_frame_rows(0.0, 0.02) == []
    step(scheduler, 0.01, eos={0, 1})  # the early streams end: their slots are first-frame slots again
    assert all(r.finish_reason is FinishReason.EOS for r in early)
    return early, busy


def test_under_load_a_new_stream_steps_in_a_first_frame_slot_until_batched_steps_keep_up_then_moves_above() -> None:
    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2)
    _, busy = _under_load(scheduler)
    new = make_request("new", schedule=(1, 2, 4))
    start(scheduler, new, [5, 6], now=0.02)
    assert new.slot == 0 and scheduler.first_frame_rows(0.02, 0.02) == [new]
    seq = scheduler.on_launched([new])  # its first frame, in a step of the first-frame slots alone
    assert scheduler.first_frame_rows(0.02, 0.02) == [] and scheduler.moves(0.02, 0.02) == []  # in flight
    codes, finished = np.arange(8 * 16).reshape(8, 16), np.zeros(8)
    [first] = scheduler.on_frame([new], [0], codes, finished, 0.025)
    scheduler.on_step_done(seq)
    scheduler.on_delivered(first, 0.03)
    # its 2-frame second chunk is due at 0.11: batched steps, one frame a 20 ms tick, would leave it less than
    # EARLY_HOLD_MARGIN_S and a step to spare: it steps on in its slot
    assert not scheduler.settled(new, 0.03, 0.02) and scheduler.moves(0.03, 0.02) == []
    assert scheduler.first_frame_rows(0.03, 0.02) == [new]
    _frame(scheduler, [new], 0.033)
    [second] = _frame(scheduler, [new], 0.036)
    assert second.n_frames == 2
    # 3 frames cut, heard until 0.27; the 4-frame third chunk at a tick each, a step to spare and the margin: 0.236
    assert scheduler.settled(new, 0.036, 0.02)
    assert scheduler.first_frame_rows(0.036, 0.02) == []
    moves = scheduler.moves(0.036, 0.02)  # before the next step: to the lowest free slot above them
    assert moves == [(new, 0, 4)] and new.slot == 4 and scheduler.running[4] is new and 0 not in scheduler.running
    assert scheduler.moves(0.036, 0.02) == []
    after = make_request("after")
    start(scheduler, after, [5, 6], now=0.04)
    assert after.slot == 1  # slot 0 waits for the step after the move (its copies read slot 0)
    rows = scheduler.runnable()
    assert new in rows and after in rows and busy[0] in rows
    big = scheduler.on_launched(rows)
    scheduler.on_step_done(big)
    other = make_request("other")
    start(scheduler, other, [5, 6], now=0.05)
    assert other.slot == 0  # free again once that step completed


def test_where_batched_steps_are_slow_a_new_stream_stays_longer_in_its_first_frame_slot() -> None:
    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2)
    _under_load(scheduler)
    scheduler.load.record_step_time(0.03, 0.02)  # a batched step of hundreds of rows
    new = make_request("new", schedule=(1, 2, 4))
    start(scheduler, new, [5, 6], now=0.02)
    [first] = _frame(scheduler, [new], 0.025)
    scheduler.on_delivered(first, 0.03)
    _frame(scheduler, [new], 0.033)
    _frame(scheduler, [new], 0.036)
    assert not scheduler.settled(new, 0.036, 0.02)  # 0.036 + 5 * 0.03 + 0.1 > 0.27
    assert scheduler.first_frame_rows(0.036, 0.02) == [new]
    _frame(scheduler, [new], 0.039)  # the third chunk now lacks 3 frames: 0.039 + 4 * 0.03 + 0.1 <= 0.27
    assert scheduler.settled(new, 0.039, 0.02) and [m[0] for m in scheduler.moves(0.039, 0.02)] == [new]


def test_batched_steps_wait_for_new_streams_in_first_frame_slots_while_the_others_have_slack() -> None:

    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2)
    _, busy = _under_load(scheduler)
    for r in busy:  # they have played from 0.0 and have one 1-frame chunk out: their next is due at 0.08
        r.first_audio, r.delivered_frames = 0.0, 1
    assert scheduler.early_release(scheduler.runnable(), 0.02, 0.02) == float("-inf")  # no new stream: no wait
    new = make_request("new", schedule=(1, 2, 4))
    start(scheduler, new, [5, 6], now=0.02)
    rows = scheduler.runnable()
    assert new in rows
    # the busy streams' second chunks lack one frame each (they made 2; the pending one, the in-flight none)
    missing = busy[0].next_chunk_frames - len(busy[0].pending)
    expected = 0.08 - missing * 0.02 - EARLY_HOLD_MARGIN_S
    assert scheduler.early_release(rows, 0.02, 0.02) == pytest.approx(expected)
    assert scheduler.early_release(rows, 0.02, 0.02) == pytest.approx(
        scheduler.pace_release(busy, 0.02, 0.02, EARLY_HOLD_MARGIN_S)
    )


def test_a_new_stream_waiting_for_text_leaves_its_first_frame_slot_and_holds_no_step() -> None:
    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2)
    _under_load(scheduler)
    new = make_request("new", schedule=(1, 2, 4))
    start(scheduler, new, [5, 6], closed=False, now=0.02)  # its text so far makes one frame
    _frame(scheduler, [new], 0.025)
    assert not scheduler.settled(new, 0.025, 0.02) and scheduler.first_frame_rows(0.025, 0.02) == []
    assert scheduler.early_release(scheduler.runnable(), 0.025, 0.02) == float("-inf")
    assert [m[0] for m in scheduler.moves(0.025, 0.02)] == [new]


def test_a_first_frame_slot_stream_stays_while_no_slot_above_is_free() -> None:
    scheduler = make_scheduler(max_slots=3, max_prefill_rows=8, first_frame_slots=1)
    a, b = make_request("a"), make_request("b")
    start(scheduler, a, [5, 6])
    step(scheduler, 0.0)
    start(scheduler, b, [5, 6])
    assert b.slot == 1  # under load; slot 0 is a's
    step(scheduler, 0.01, eos={0})
    c, d = make_request("c"), make_request("d")
    start(scheduler, c, [5, 6], now=0.02)
    start(scheduler, d, [5, 6], now=0.02)
    assert (c.slot, d.slot) == (0, 2)
    for now in (0.021, 0.022, 0.023):  # three frames: settled at a 20 ms tick (test above)
        _frame(scheduler, scheduler.first_frame_rows(now, 0.02), now)
    assert scheduler.settled(c, 0.023, 0.02)
    assert scheduler.moves(0.023, 0.02) == [] and c.slot == 0  # every slot above is taken: c stays, steps in place
    scheduler.finish(d, FinishReason.CANCELLED)
    scheduler.on_steps_abandoned()
    assert [(r.request_id, old, new) for r, old, new in scheduler.moves(0.023, 0.02)] == [("c", 0, 2)]


def test_a_nearly_full_engine_makes_room_in_the_first_frame_slots_for_the_next_arrival() -> None:
    """Every slot taken: a slot frees only when a stream ends, and the next arrival would take it. `make_room`
    moves a stream out of its first-frame slot into the freed one, and the arrival takes the first-frame slot
    at once: a stream that nothing queued on the device may still write first (copied on the prompts' lane),
    else one with a text feed or a frame in flight (copied behind them on the steps' stream)."""
    from qwen3tts_agent.engine.scheduler.scheduler import SlotMove

    scheduler = make_scheduler(max_slots=6, max_prefill_rows=8, first_frame_slots=2)
    light = [make_request(f"light{i}") for i in range(2)]
    for r in light:
        start(scheduler, r, [5, 6])
    step(scheduler, 0.0)
    busy = [make_request(f"busy{i}") for i in range(4)]
    for r in busy:
        start(scheduler, r, [5, 6])
    assert [r.slot for r in busy] == [2, 3, 4, 5]
    step(scheduler, 0.01, eos={0, 1})  # the light streams end: first-frame slots free
    new = [make_request(f"new{i}") for i in range(2)]
    for r in new:
        start(scheduler, r, [5, 6], now=0.02)
    assert [r.slot for r in new] == [0, 1]
    step(scheduler, 0.03, eos={2})  # busy0 ends; the new streams have their first frames
    late = make_request("late")
    scheduler.add(late)
    scheduler.close_input(late, [5, 6])
    scheduler.on_fed(new[0], [7])  # a text feed queued for new0 after the last step: it may still write slot 0
    moves = scheduler.make_room(0.04, 0.02)
    assert moves == [SlotMove(new[1], 1, 2, after_steps=False)] and scheduler.running[2] is new[1]
    assert scheduler.admit(0.04) == [late] and late.slot == 1  # at once: the move is copied before its set-up
    assert scheduler.make_room(0.04, 0.02) == []  # nobody waits

    step(scheduler, 0.05, eos={3})  # busy1 ends
    later = make_request("later")
    scheduler.add(later)
    scheduler.close_input(later, [5, 6])
    scheduler.on_launched(scheduler.runnable())  # a step in flight with new0 and late
    assert scheduler.make_room(0.06, 0.02) == [SlotMove(new[0], 0, 3, after_steps=True)]
    assert [r.slot for r in scheduler.admit(0.06)] == [0]


def test_make_room_also_moves_a_stream_admitted_to_a_low_slot_below_the_load() -> None:
    scheduler = make_scheduler(max_slots=4, max_prefill_rows=8, first_frame_slots=2)
    light = [make_request(f"light{i}") for i in range(2)]
    for r in light:
        start(scheduler, r, [5, 6])
    assert [r.slot for r in light] == [0, 1]  # below the load: to stay
    step(scheduler, 0.0)
    busy = [make_request(f"busy{i}") for i in range(2)]
    for r in busy:
        start(scheduler, r, [5, 6])
    step(scheduler, 0.01, eos={2})  # busy0 ends: slot 2 is the only free one
    new = make_request("new")
    scheduler.add(new)
    scheduler.close_input(new, [5, 6])
    moves = scheduler.make_room(0.02, 0.02)
    assert [(m.request.request_id, m.old, m.new) for m in moves] == [("light0", 0, 2)]
    assert scheduler.admit(0.02) == [new] and new.slot == 0
    assert scheduler.first_frame_rows(0.02, 0.02) == []  # its prompt first
    _prefill_all(scheduler, 0.02)
    assert scheduler.first_frame_rows(0.02, 0.02) == [new]


def test_make_room_moves_nobody_below_the_load_or_while_a_first_frame_slot_is_free() -> None:
    scheduler = make_scheduler(max_slots=6, max_prefill_rows=8, first_frame_slots=2, first_frame_load=4)
    running = [make_request(f"r{i}") for i in range(3)]
    for r in running:
        start(scheduler, r, [5, 6])
    step(scheduler, 0.0)
    waiting = make_request("waiting")
    scheduler.add(waiting)
    assert scheduler.make_room(0.01, 0.02) == []  # 3 streams stepping: below the load of 4


def test_first_frame_slots_must_leave_slots_above_them() -> None:
    with pytest.raises(ValueError):
        make_scheduler(max_slots=4, first_frame_slots=4)



@pytest.mark.parametrize("stepping, first_frame", [(2, False), (3, True)])
def test_first_frame_slots_wait_for_their_load(stepping: int, first_frame: bool) -> None:
    """Below `first_frame_load` streams stepping, a new stream takes the lowest free slot to stay in it."""
    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2, first_frame_load=3)
    running = [make_request(f"r{i}") for i in range(stepping + 1)]
    for r in running:
        start(scheduler, r, [5, 6])
    step(scheduler, 0.0)
    scheduler.finish(running[0], FinishReason.CANCELLED)  # slot 0 is free at once: no step in flight
    new = make_request("new")
    start(scheduler, new, [5, 6], now=0.01)
    assert new.slot == 0
    assert scheduler.first_frame_rows(0.01, 0.02) == ([new] if first_frame else [])


def test_after_a_late_chunk_new_streams_step_in_the_batched_steps_until_the_pause_ends() -> None:
    """A full device: a first-frame step of a few rows costs nearly a batched step, so for FIRST_FRAME_PAUSE_S
    after a chunk left late new streams neither take a first-frame slot nor have room made there for them."""
    from qwen3tts_agent.engine.scheduler import ChunkPlan

    scheduler = make_scheduler(max_slots=8, max_prefill_rows=8, first_frame_slots=2)
    _, busy = _under_load(scheduler)
    busy[0].first_audio, busy[0].delivered_frames = 0.0, 1  # its next chunk was due at 0.08
    assert not scheduler.load.first_frames_paused(0.1)
    scheduler.on_delivered(ChunkPlan(busy[0], np.zeros((2, 16)), 1, 1, False, 0.1), 0.1)  # 20 ms late
    assert scheduler.load.stats.late_chunks == 1 and scheduler.load.first_frames_paused(0.1)
    paused = make_request("paused")
    start(scheduler, paused, [5, 6], now=0.1)
    assert paused.slot == 0 and scheduler.first_frame_rows(0.1, 0.02) == []  # the lowest slot, but not as a first-frame stream
    assert paused in scheduler.runnable()  # its first frame goes in the next batched step
    assert scheduler.early_release(scheduler.runnable(), 0.1, 0.02) == float("-inf")  # which waits for nothing
    step(scheduler, 0.11)
    full = make_request("full")
    start(scheduler, full, [5, 6], now=0.12)  # takes slot 1, the last first-frame slot
    waiting = make_request("waiting")
    scheduler.add(waiting)
    assert scheduler.make_room(0.12, 0.02) == []  # no stream moves out of the first-frame slots for it
    after = 0.1 + FIRST_FRAME_PAUSE_S
    assert not scheduler.load.first_frames_paused(after)
    assert [m.request for m in scheduler.make_room(after, 0.02)] == [paused]  # room made for it again


def test_a_released_slot_is_free_again_only_once_the_steps_that_may_hold_it_completed() -> None:
    from qwen3tts_agent.engine.scheduler.slots import SlotPool

    pool = SlotPool(4)
    assert [pool.take_lowest() for _ in range(2)] == [0, 1]
    seq = pool.on_launched()  # slots 0 and 1 are rows of step 1
    pool.release(0, seq)
    assert pool.free_below(2) == 0  # step 1 is in flight: slot 0 waits
    assert pool.lowest_free_from(1) == 2 and pool.lowest_free_from(3) == 3 and pool.lowest_free_from(0) is None
    assert not pool
    pool.on_completed(seq)
    assert pool and pool.take_lowest() == 0
    pool.release(1, seq)  # its last step has completed: free at once
    assert pool.take_lowest() == 1
