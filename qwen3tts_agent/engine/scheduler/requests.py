"""What the scheduler knows of one request: its prompt's shape, its progress, and the work planned for it.

Plain host-side state (no tensors), owned by `Scheduler` (`engine/scheduler/scheduler.py`) and read by the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..types import FIRST_FRAME_TEXT_TOKENS, FinishReason, TextLayout

FRAME_SECONDS = 0.08  # one codec frame of audio
# The runaway guard (no explicit max_frames): at most this many frames, plus this many per text token.
# Speech runs about 3-4 frames per text token; twice a slow speaker's rate plus two seconds is generous.
RUNAWAY_BASE_FRAMES = 25
RUNAWAY_FRAMES_PER_TOKEN = 8
# A stream whose chunk in the making is needed within this many seconds (`RequestState.runs_out`) has its
# pending frames decoded at once (with deadline-aware chunking, `cut_chunk`).
URGENT_SLACK_S = 0.04


def scheduled_chunk(schedule: tuple[int, ...], index: int) -> int:
    """The frames of a stream's chunk `index` by its chunk schedule: the schedule's, then its last repeated."""
    return schedule[min(index, len(schedule) - 1)]


def runaway_frame_limit(text_tokens: int) -> int:
    """The frames a closed text of `text_tokens` tokens may take before the runaway guard ends it."""
    return RUNAWAY_BASE_FRAMES + RUNAWAY_FRAMES_PER_TOKEN * text_tokens


@dataclass(frozen=True)
class PromptShape:
    """What decides when a prompt's text-dependent body can be built (see `PromptBuilder.body`)."""

    layout: TextLayout
    icl_codec_len: int | None = None  # codec_bos + reference frames, for an in-context clone
    ref_text_len: int = 0  # reference transcript tokens, for an in-context clone
    icl_early_start: bool = False  # an in-context clone starts on its first token (`Voice.icl_early_start`)

    def body_ready(self, n_text: int, closed: bool) -> bool:
        """Whether the body can be built from `n_text` final target tokens."""
        if closed:
            return True
        if self.layout is TextLayout.PREFILL:
            return False
        if self.icl_codec_len is not None:
            covered = self.ref_text_len + n_text >= self.icl_codec_len
            return covered or (self.icl_early_start and n_text >= 1)
        return n_text >= 1

    def first_frame_ready(self, n_text: int, closed: bool) -> bool:
        """Whether the text the first frame needs is there: the body's, and the text-track token that the
        first frame's talker step reads (the official layouts put no padding there while text may follow)."""
        if closed:
            return True
        if self.layout is TextLayout.PREFILL:
            return False
        if self.icl_codec_len is not None:
            needed = max(0, self.icl_codec_len + 1 - self.ref_text_len)  # the reference span's, plus one
            return n_text >= (min(needed, 1) if self.icl_early_start else needed)
        return n_text >= FIRST_FRAME_TEXT_TOKENS  # the body's first token, then the second on the text track

    @property
    def may_speculate(self) -> bool:
        """Whether the first frame may run on a tentative second token (the interleaved layout without a
        reference span; an in-context clone's first frame needs its span's text, which is not speculated)."""
        return self.layout is not TextLayout.PREFILL and self.icl_codec_len is None


@dataclass(eq=False)
class RequestState:
    """Host-side state of one request in the core."""

    request_id: str
    shape: PromptShape
    chunk_schedule: tuple[int, ...]
    submitted: float
    max_frames: int | None = None  # the caller's cap
    runaway_guard: bool = True  # bound the frames by the text's length too (off for fixed-length output)
    text_ids: list[int] = field(default_factory=list)  # final target tokens so far
    tentative: list[int] = field(default_factory=list)  # the tokens after them as the text stands (may change)
    speculated: int | None = None  # the tentative token its first frame ran on, until it turns out final
    may_speculate: bool = True  # False after a wrong speculation: the restarted request waits for final text
    closed: bool = False
    slot: int | None = None
    arrived: float = 0.0  # when the core took its AddRequest off its queue
    admitted_at: float = 0.0
    text_ready: float = 0.0  # when the core had the text its first frame needs (`PromptShape.first_frame_ready`)
    head_done: bool = False
    body_done: bool = False
    consumed: int = 0  # target tokens already placed in the prompt body or handed to the text track
    track_len: int = 0  # text-track tokens handed to the runner
    eos_fed: bool = False
    fed_before_step: int = 0  # its last text feed runs on the device before this step (the scheduler's count)
    last_step: int = 0  # the last step it was a row of
    position: int = 0  # talker cache length, mirrored on the host to size attention without a sync
    frames: int = 0  # frames received
    frames_launched: int = 0  # frames queued on the device (may run one step ahead)
    chunk_index: int = 0
    pending: list[np.ndarray] = field(default_factory=list)  # codes [16] not yet decoded
    pending_start: int = 0
    prefill_done: float = 0.0
    first_frame: float = 0.0
    first_audio: float | None = None  # when its first chunk left the core
    delivered_frames: int = 0
    finish_reason: FinishReason | None = None
    codes: list[list[int]] = field(default_factory=list)  # every frame's codes, when the scheduler keeps them

    @property
    def next_chunk_frames(self) -> int:
        return scheduled_chunk(self.chunk_schedule, self.chunk_index)

    @property
    def frame_limit(self) -> int | None:
        """Frames this request may make: its max_frames and, once all text is in, the runaway guard's bound."""
        if not (self.closed and self.runaway_guard):  # asked for every live row many times a second: no lists
            return self.max_frames
        guard = runaway_frame_limit(len(self.text_ids))
        return guard if self.max_frames is None else min(self.max_frames, guard)

    def ahead_s(self, now: float) -> float | None:
        """Seconds of audio made beyond the listener's playback position; None before its first chunk."""
        if self.first_audio is None:
            return None
        return self.frames * FRAME_SECONDS - (now - self.first_audio)

    def deadline(self) -> float | None:
        """When its next chunk must have left for a client playing from the first chunk; None before that."""
        if self.first_audio is None:
            return None
        return self.first_audio + self.delivered_frames * FRAME_SECONDS

    def runs_out(self) -> float | None:
        """When its listener, playing from the first chunk on in real time, will have played every chunk cut so
        far (delivered or still decoding): the chunk it is filling now is needed then. None before that first
        chunk has left."""
        if self.first_audio is None:
            return None
        return self.first_audio + self.pending_start * FRAME_SECONDS

    def text_wait(self, now: float) -> float:
        """How long the first frame waited for text: from admission (before it, the request waited for a
        slot) until the text its first frame needs had arrived, or until `now` if it never did."""
        if not self.admitted_at:
            return 0.0
        return max(0.0, (self.text_ready or now) - self.admitted_at)

    def take_pending(self, n_frames: int) -> np.ndarray:
        codes = np.stack(self.pending[:n_frames])
        del self.pending[:n_frames]
        self.pending_start += n_frames
        self.chunk_index += 1
        return codes


@dataclass(frozen=True)
class PrefillPlan:
    """Prefill a request's prompt now: its head (if not done yet) and, with `body_ids`, its body too."""

    request: RequestState
    head: bool
    body_ids: list[int] | None  # final target tokens the body is built from; None: head only


@dataclass(frozen=True)
class ChunkPlan:
    """Decode `codes` (frames [frame_start, frame_start + n)) of a request now."""

    request: RequestState
    codes: np.ndarray  # [n, 16]
    frame_start: int
    index: int  # the stream's chunks before it
    is_last: bool
    planned_at: float  # when the scheduler cut it (time.perf_counter())

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def n_frames(self) -> int:
        return int(self.codes.shape[0])


def urgency(plan: ChunkPlan, now: float) -> tuple[int, float]:
    """The order chunks are decoded in: first chunks first (oldest request first), then the earliest deadline."""
    if plan.is_first:
        return (0, plan.request.submitted)
    deadline = plan.request.deadline()
    return (1, deadline if deadline is not None else now)


def cut_chunk(request: RequestState, now: float, *, adapt: bool, decode_sizes: list[int]) -> ChunkPlan | None:
    """The chunk a request's pending frames make now, if one is due: its next scheduled chunk once it has the
    frames, every frame left once it has ended, and with `adapt` (deadline-aware chunking), as soon as the
    chunk is needed within `URGENT_SLACK_S` (`RequestState.runs_out`: a chunk cut before it and still decoding
    covers the listener until then, so the frames after it wait for their own chunk's time, not that one's),
    the most of its frames one decode takes (the longest of the sorted `decode_sizes` they fill, so that it
    costs one codec call; the rest are due later).

    What a chunk schedule promises (docs/server.md, "Chunks") follows: called after every frame, this cuts a
    scheduled chunk as soon as it fills, so no chunk holds more than its scheduled frames; a first chunk is
    never urgent (no deadline before first audio); and a shorter one is the last, or an urgent one."""
    if not request.pending:
        return None
    ended = request.finish_reason is not None
    needed = request.runs_out()
    urgent = adapt and needed is not None and needed - now < URGENT_SLACK_S
    if not (ended or urgent or len(request.pending) >= request.next_chunk_frames):
        return None
    if ended:
        n = len(request.pending)
    elif urgent:
        fitting = [size for size in decode_sizes if size <= len(request.pending)]
        n = fitting[-1] if fitting else len(request.pending)
    else:
        n = request.next_chunk_frames
    start, index = request.pending_start, request.chunk_index
    return ChunkPlan(request, request.take_pending(n), start, index, ended and not request.pending, now)
