"""Why a chunk left late: one log line per late chunk, with the frame steps the device ran meanwhile.

The counts of late chunks by place and by cause (`scheduler.device_load`) say how many and whose share, the
step pace's ("frames": the chunk's frames were not all made by its deadline) or the codec lane's ("decode"). Near
capacity a few of them decide everything (three within a second cut the streams the engine takes on), so each
one is worth its story: when its stream's first audio left, when the chunk was due, cut and sent, and every step
queued from `WINDOW_S` before it was due until it left (when queued and read back, its rows, whether it was a
batched step or new streams' first frames, whether the late stream was in it, its device time where events
measured it: read back much later than that, it waited for the device or the core's loop). A step that ran long, a gap with
no step, or a run of first-frame steps then shows in the server's log. At most `LINES_PER_S` lines a second;
the next line says how many were left out.

The core's thread alone calls it; it keeps the last `KEEP_STEPS` steps with the list of their rows the launcher
made anyway (no copy on the step's path: a row is looked for only when a chunk is late).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..scheduler import LateChunk, RequestState

logger = logging.getLogger(__name__)

# steps queued from this long before a late chunk was due are in its line
WINDOW_S = 0.3
# the steps kept: a window's worth at a few hundred steps a second
KEEP_STEPS = 256
# at most this many lines a second (a burst of late chunks is one story told a few times)
LINES_PER_S = 5


@dataclass
class _Step:
    seq: int
    queued_at: float
    batched: bool
    rows: Sequence[RequestState]
    read_at: float | None = None  # when the core read it back
    device_s: float | None = None  # its device time, where events measured it


@dataclass
class LateChunkTrace:
    """The recent steps, and a log line for each late chunk told with them."""

    _steps: collections.deque[_Step] = field(default_factory=lambda: collections.deque(maxlen=KEEP_STEPS))
    _by_seq: dict[int, _Step] = field(default_factory=dict)
    _second: float = float("-inf")  # the start of the second whose lines are being counted
    _lines: int = 0  # lines logged in it
    _left_out: int = 0  # late chunks not logged since the last line

    def queued(self, seq: int, rows: Sequence[RequestState], now: float, *, batched: bool) -> None:
        """A step of `rows` was queued at `now` (kept as given: the launcher does not change it)."""
        if len(self._steps) == self._steps.maxlen:
            self._by_seq.pop(self._steps[0].seq, None)
        step = _Step(seq, now, batched, rows)
        self._steps.append(step)
        self._by_seq[seq] = step

    def read(self, seq: int, now: float, device_s: float | None) -> None:
        step = self._by_seq.get(seq)
        if step is not None:
            step.read_at, step.device_s = now, device_s

    def on_late(self, chunk: LateChunk) -> None:
        """Log `chunk`'s line, unless `LINES_PER_S` lines went out within the second."""
        if chunk.left_at - self._second >= 1.0:
            self._second, self._lines = chunk.left_at, 0
        if self._lines >= LINES_PER_S:
            self._left_out += 1
            return
        self._lines += 1
        left_out, self._left_out = self._left_out, 0
        logger.info("%s%s", self.describe(chunk), f" ({left_out} more late chunks not logged before it)" if left_out else "")

    def describe(self, chunk: LateChunk) -> str:
        """The chunk's story, times in ms from when it was due: e.g. `-210~-201 B120*:8.6` is a batched step of
        120 rows, the late stream among them, queued 210 ms before the chunk was due, read back 9 ms later, 8.6 ms
        of it on the device (`:` and the device time only where events measured it)."""
        due = chunk.due

        def ms(t: float) -> str:
            return f"{(t - due) * 1000:+.0f}"

        steps = [
            f"{ms(s.queued_at)}~{ms(s.read_at) if s.read_at is not None else '?'} "
            f"{'B' if s.batched else 'F'}{len(s.rows)}"
            f"{'*' if any(r.request_id == chunk.request_id for r in s.rows) else ''}"
            f"{f':{s.device_s * 1000:.1f}' if s.device_s is not None else ''}"
            for s in self._steps
            if due - WINDOW_S <= s.queued_at <= chunk.left_at
        ]
        return (
            f"late chunk {chunk.chunk_index} ({chunk.frames} frames) of {chunk.request_id}: left {ms(chunk.left_at)} ms "
            f"after it was due ({chunk.cause}); first audio {ms(chunk.first_audio)}, cut {ms(chunk.cut_at)}; "
            f"steps since {WINDOW_S * 1000:.0f} ms before (queued~read, B batched / F first frames, rows, * with "
            f"it, :device ms): {', '.join(steps) or 'none'}"
        )
