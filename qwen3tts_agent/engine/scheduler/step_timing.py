"""When a frame step may wait, from the streams' deadlines (functions of request state alone; no tensors).

Under load the step clock (`engine/scheduler/pacer.py`) holds batched steps; these say until when a held step may
wait before a stream's next chunk would be late (`pace_release`), whether a new stream stepping in a
first-frame slot can leave it for the batched steps (`settled`), and whether steps may yield the device to
urgent audio decodes (`steps_can_wait`). `Scheduler` applies them at the device's recent step time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .requests import FRAME_SECONDS, RequestState

# A paced step waits for the step clock only while every stream in it would still have its next chunk in
# time: the frames that chunk lacks at one step each, plus this long for the last step, the decode and delivery.
PACE_MARGIN_S = 0.04
# While new streams step in their first-frame slots, a batched step waits for them until a stream's next chunk
# would otherwise be made less than this long before its deadline (its decode and delivery under load); a new
# stream leaves those slots once batched steps can make its next chunk with this margin and a step to spare.
EARLY_HOLD_MARGIN_S = 0.1
# A frame step may wait for urgent audio decodes when every stream in it has at least this much audio made
# beyond what its listener has heard: the audio is due sooner than their next frames.
STEP_CAN_WAIT_AHEAD_S = 0.5


def pace_release(rows: Sequence[RequestState], step_s: float, margin_s: float = PACE_MARGIN_S) -> float:
    """The latest start of a step of `rows` that still gives every stream its next chunk's missing frames, one
    step of `step_s` each, and `margin_s` for the last step and the decode, before that chunk's deadline;
    infinity if no stream presses. A released step's successors are released by the same rule, one step
    later each, so a pressed stream's frames go back to back rather than one a tick."""
    release = math.inf
    for request in rows:
        deadline = request.deadline()
        if deadline is None:  # its first chunk is on its way: its next is due a frame after that leaves
            continue
        missing = request.next_chunk_frames - len(request.pending) - (request.frames_launched - request.frames)
        if missing > 0:
            release = min(release, deadline - missing * step_s - margin_s)
    return release


def settled(request: RequestState, now: float, step_s: float) -> bool:
    """Whether batched steps, one frame each `step_s`, would make a stream's next chunk with
    `EARLY_HOLD_MARGIN_S` and a step to spare before its listener runs out of the audio cut so far (counted
    from now while its first chunk is on its way). A stream with a frame in flight or none made yet is not
    (what it lacks is not known yet)."""
    if request.frames == 0 or request.frames_launched > request.frames:
        return False
    start = request.first_audio if request.first_audio is not None else now
    runs_out = start + request.pending_start * FRAME_SECONDS
    missing = max(0, request.next_chunk_frames - len(request.pending))
    return now + (missing + 1) * step_s + EARLY_HOLD_MARGIN_S <= runs_out


def steps_can_wait(rows: Sequence[RequestState], now: float) -> bool:
    """Whether a step for `rows` may yield the device to urgent audio: every row is well ahead of its playback
    (a stream still waiting for its first audio never waits)."""
    for request in rows:
        ahead = request.ahead_s(now)
        if ahead is None or ahead < STEP_CAN_WAIT_AHEAD_S:
            return False
    return True


def first_frame_in_flight(rows: Sequence[RequestState]) -> bool:
    """Whether a stream among `rows` has its first frame on the device (queued, not yet read back)."""
    return any(r.frames == 0 and r.frames_launched for r in rows)
