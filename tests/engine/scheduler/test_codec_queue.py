"""The codec lane's queue (`engine/scheduler/codec_queue.py`): which waiting chunks go in one codec call, and when.

Plain host objects (`RequestState`, `ChunkPlan`) with made-up clocks: no model, no tensors.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen3tts_agent.engine.scheduler import ChunkPlan, CodecQueue, PromptShape, RequestState
from qwen3tts_agent.engine.types import TextLayout

HOLD_S = 0.05
SLACK_S = 0.15


def _stream(name: str, *, playing_since: float | None, delivered_frames: int = 1) -> RequestState:
    """A request whose listener started playing at `playing_since` (None: no audio out yet)."""
    request = RequestState(name, PromptShape(TextLayout.INTERLEAVED), (1, 2, 4, 8), submitted=0.0)
    request.first_audio = playing_since
    request.delivered_frames = delivered_frames
    return request


def _chunk(request: RequestState, frames: int, *, at: float, start: int = 1, index: int = 1) -> ChunkPlan:
    """A later chunk (not a stream's first) of `frames` frames, cut at `at`."""
    codes = np.zeros((frames, 16), dtype=np.int64)
    return ChunkPlan(request, codes, start, index, is_last=False, planned_at=at)


def _queue(max_batch: int = 16, hold_s: float = HOLD_S) -> CodecQueue:
    return CodecQueue(max_batch=max_batch, hold_s=hold_s, launch_slack_s=SLACK_S)


def _ids(plans: list[ChunkPlan]) -> list[str]:
    return [plan.request.request_id for plan in plans]


def test_a_chunk_with_audio_to_spare_waits_until_its_hold_runs_out() -> None:
    """A stream 20 frames ahead of its listener: its chunk waits while other streams may still join it."""
    queue = _queue()
    ahead = _stream("a", playing_since=0.0, delivered_frames=20)  # runs out at 1.6 s
    queue.add([_chunk(ahead, 8, at=0.0)])
    assert queue.next_batch(0.0, streams=3) == []
    assert queue.next_batch(HOLD_S - 0.001, streams=3) == []
    assert _ids(queue.next_batch(HOLD_S, streams=3)) == ["a"]
    assert len(queue) == 0


def test_a_chunk_goes_at_once_when_its_listener_is_about_to_run_out_or_has_nothing_yet() -> None:
    queue = _queue()
    # playing since 0.0 with 2 frames delivered: runs out at 0.16 s, within the slack at 0.02 s
    short = _stream("short", playing_since=0.0, delivered_frames=2)
    queue.add([_chunk(short, 2, at=0.02)])
    assert _ids(queue.next_batch(0.02, streams=4)) == ["short"]
    unplayed = _stream("new", playing_since=None)  # its first chunk has not left: no deadline to plan by
    queue.add([_chunk(unplayed, 2, at=0.02)])
    assert _ids(queue.next_batch(0.02, streams=4)) == ["new"]


def test_a_due_chunk_takes_every_waiting_chunk_of_its_length_most_urgent_first() -> None:
    queue = _queue()
    now = 1.0
    urgent = _stream("urgent", playing_since=0.0, delivered_frames=13)  # runs out at 1.04 s
    later = _stream("later", playing_since=0.5, delivered_frames=20)  # at 2.1 s
    soon = _stream("soon", playing_since=0.0, delivered_frames=20)  # at 1.6 s
    other_length = _stream("four", playing_since=0.0, delivered_frames=20)
    queue.add([_chunk(later, 8, at=now), _chunk(other_length, 4, at=now), _chunk(soon, 8, at=now),
               _chunk(urgent, 8, at=now)])
    assert _ids(queue.next_batch(now, streams=5)) == ["urgent", "soon", "later"]
    assert [plan.request.request_id for plan in queue] == ["four"]  # another length: another call, later


def test_only_each_streams_earliest_chunk_goes() -> None:
    queue = _queue(hold_s=0.0)
    a = _stream("a", playing_since=0.0, delivered_frames=20)
    b = _stream("b", playing_since=0.0, delivered_frames=20)
    first, second = _chunk(a, 8, at=0.0, start=1), _chunk(a, 8, at=0.0, start=9, index=2)
    queue.add([first, second, _chunk(b, 8, at=0.0)])
    batch = queue.next_batch(0.0, streams=2)
    assert _ids(batch) == ["a", "b"] and batch[0] is first
    assert queue.next_batch(0.0, streams=2) == [second]


def test_a_length_goes_at_once_when_every_live_stream_has_a_chunk_of_it_waiting() -> None:
    """Nobody is left to wait for: a lone stream never holds its chunks, nor do streams all in step."""
    queue = _queue()
    lone = _stream("lone", playing_since=0.0, delivered_frames=20)
    queue.add([_chunk(lone, 8, at=0.0)])
    assert _ids(queue.next_batch(0.0, streams=1)) == ["lone"]
    streams = [_stream(name, playing_since=0.0, delivered_frames=20) for name in "abc"]
    queue.add([_chunk(s, 8, at=0.0) for s in streams[:2]])
    assert queue.next_batch(0.0, streams=3) == []  # c may still cut one
    queue.add([_chunk(streams[2], 8, at=0.001)])
    assert _ids(queue.next_batch(0.001, streams=3)) == ["a", "b", "c"]


def test_a_stream_that_ends_can_complete_the_group_of_those_waiting() -> None:
    """The queue answers a wait from what it worked out last time, until something changes: fewer live
    streams is such a change (the ones waiting may now be all there are)."""
    queue = _queue()
    waiting = [_stream(name, playing_since=0.0, delivered_frames=20) for name in "ab"]
    queue.add([_chunk(s, 8, at=0.0) for s in waiting])
    assert queue.next_batch(0.01, streams=3) == [] and queue.next_batch(0.02, streams=3) == []
    assert _ids(queue.next_batch(0.02, streams=2)) == ["a", "b"]


def test_a_full_call_goes_at_once_and_takes_at_most_max_batch() -> None:
    queue = _queue(max_batch=4)
    streams = [_stream(f"s{i}", playing_since=0.0, delivered_frames=20 + i) for i in range(6)]
    queue.add([_chunk(s, 8, at=0.0) for s in streams])
    assert _ids(queue.next_batch(0.0, streams=32)) == ["s0", "s1", "s2", "s3"]  # the four most urgent
    assert queue.next_batch(0.0, streams=32) == []  # two left: they wait for company or their hold
    assert _ids(queue.next_batch(HOLD_S, streams=32)) == ["s4", "s5"]


def test_no_hold_decodes_every_chunk_at_once() -> None:
    queue = _queue(hold_s=0.0)
    ahead = _stream("a", playing_since=0.0, delivered_frames=100)
    queue.add([_chunk(ahead, 8, at=0.0)])
    assert _ids(queue.next_batch(0.0, streams=64)) == ["a"]


def test_drop_forgets_a_requests_chunks() -> None:
    queue = _queue()
    a, b = _stream("a", playing_since=0.0), _stream("b", playing_since=0.0)
    queue.add([_chunk(a, 8, at=0.0), _chunk(b, 8, at=0.0), _chunk(a, 8, at=0.0, start=9, index=2)])
    queue.drop("a")
    assert [plan.request.request_id for plan in queue] == ["b"]
    queue.clear()
    assert len(queue) == 0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        CodecQueue(max_batch=0, hold_s=0.0, launch_slack_s=0.1)
    with pytest.raises(ValueError):
        CodecQueue(max_batch=4, hold_s=-1.0, launch_slack_s=0.1)



def test_a_good_batch_of_one_length_goes_without_waiting_for_the_other_streams() -> None:
    """Under heavy load, chunks of one length that make a good call go at once: the lane does not stand idle
    while they wait out their hold for streams that have not cut theirs."""
    queue = CodecQueue(max_batch=16, hold_s=HOLD_S, launch_slack_s=SLACK_S, good_batch=3)
    streams = [_stream(f"s{i}", playing_since=0.0, delivered_frames=20 + i) for i in range(5)]
    queue.add([_chunk(s, 8, at=0.0) for s in streams[:2]] + [_chunk(streams[4], 4, at=0.0)])
    assert queue.next_batch(0.001, streams=200) == []  # two of a length: they wait for company or the hold
    queue.add([_chunk(streams[2], 8, at=0.002)])
    assert _ids(queue.next_batch(0.002, streams=200)) == ["s0", "s1", "s2"]
    queue.add([_chunk(streams[3], 8, at=0.003)])
    assert queue.next_batch(0.003, streams=200) == []  # the 4-frame chunk and a lone 8 still wait
    assert _ids(queue.next_batch(HOLD_S, streams=200)) == ["s4"]  # the hold: the oldest first
    assert _ids(queue.next_batch(HOLD_S + 0.003, streams=200)) == ["s3"]


def test_good_batch_is_at_most_max_batch_and_checked() -> None:
    assert CodecQueue(max_batch=4, hold_s=0.0, launch_slack_s=0.1, good_batch=32).good_batch == 4
    assert CodecQueue(max_batch=4, hold_s=0.0, launch_slack_s=0.1).good_batch == 4
    with pytest.raises(ValueError):
        CodecQueue(max_batch=4, hold_s=0.0, launch_slack_s=0.1, good_batch=0)


def _playing(count: int, frames_ahead: int) -> list[RequestState]:
    """`count` streams playing since 0.0, each `frames_ahead` frames delivered: deadlines at frames_ahead × 80 ms."""
    return [_stream(f"s{i:02d}", playing_since=0.0, delivered_frames=frames_ahead + i) for i in range(count)]


def test_while_the_lane_is_busy_a_call_fills_a_graph_batch_and_leaves_the_rest() -> None:
    """11 chunks with audio to spare and graphs of 1, 2, 4, 8 and 16 rows: with a call in flight the 8 most
    urgent go (no padded rows) and the 3 others wait for the next call, first in it; with the lane idle all 11
    go at once (they would wait for nothing)."""
    queue = CodecQueue(max_batch=16, hold_s=0.0, launch_slack_s=SLACK_S, batch_sizes=(1, 2, 4, 8, 16))
    streams = _playing(11, frames_ahead=10)  # running out from 0.8 s on, far past the slack at 0.1 s
    queue.add([_chunk(s, 8, at=0.1) for s in reversed(streams)])
    first = queue.next_batch(0.1, streams=11, lane_busy=True)
    assert _ids(first) == [f"s{i:02d}" for i in range(8)] and len(queue) == 3  # the most urgent first
    newcomers = _playing(14, frames_ahead=30)[11:]  # three more streams' chunks, later deadlines
    queue.add([_chunk(s, 8, at=0.11) for s in newcomers])
    assert _ids(queue.next_batch(0.11, streams=14, lane_busy=True)) == ["s08", "s09", "s10", "s11"]
    assert _ids(queue.next_batch(0.12, streams=14, lane_busy=False)) == ["s12", "s13"]  # idle lane: everything
    queue.add([_chunk(s, 8, at=0.2, start=9, index=2) for s in streams])
    assert len(queue.next_batch(0.2, streams=14, lane_busy=False)) == 11  # the 16-row graph, 5 rows padded


def test_a_chunk_due_by_its_deadline_is_never_left_for_the_next_call() -> None:
    """Past a whole batch, a chunk whose listener runs out within the slack (or that has no audio out yet)
    goes now: the call pads up instead."""
    queue = CodecQueue(max_batch=16, hold_s=0.0, launch_slack_s=SLACK_S, batch_sizes=(1, 2, 4, 8, 16))
    tight = [_stream(f"t{i}", playing_since=0.0, delivered_frames=2) for i in range(10)]  # run out at 0.16 s
    queue.add([_chunk(s, 8, at=0.1) for s in tight])
    assert len(queue.next_batch(0.1, streams=10, lane_busy=True)) == 10
    late = [_stream(f"l{i}", playing_since=0.0, delivered_frames=1) for i in range(8)]  # ran out at 0.08 s
    unplayed = _stream("new", playing_since=None)  # its first chunk has not left: no deadline to plan by
    queue.add([_chunk(s, 8, at=0.1) for s in late] + [_chunk(unplayed, 8, at=0.1)])
    group = queue.next_batch(0.1, streams=9, lane_busy=True)
    assert len(group) == 9 and _ids(group)[-1] == "new"


def test_without_batch_sizes_a_call_takes_every_chunk_of_its_length() -> None:
    queue = _queue(hold_s=0.0)
    queue.add([_chunk(s, 8, at=0.1) for s in _playing(11, frames_ahead=10)])
    assert len(queue.next_batch(0.1, streams=11, lane_busy=True)) == 11
    with pytest.raises(ValueError, match="batch sizes"):
        CodecQueue(max_batch=4, hold_s=0.0, launch_slack_s=0.1, batch_sizes=(0, 4))
