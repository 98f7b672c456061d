"""One WebSocket streaming session: text deltas in, PCM frames out, one utterance after another.

Two tasks share the socket. The reader parses client messages and feeds text into the current utterance
(straight into its engine stream once one is open); the runner takes utterances in order, waits for a
synthesis slot, streams the audio, and ends each with a `done` message carrying its metrics. A cancel or a
disconnect stops the engine streams explicitly, so no GPU work outlives the client that asked for it.

Every send has a deadline (`send_timeout_s`, `server/outbox.py`): a client that stops reading fills the
connection's bounded send buffer, the next send times out, and the session cancels its utterances (freeing
their slots) and closes with 4010, so a client that does not read can never hold synthesis capacity.

The teardown does not rely on a cancel reaching the runner: a cancel can be lost (a send that completes as
it lands, `waits.py`; an ASGI server that swallows it), so the runner also stops at a flag the teardown sets,
and the teardown waits for it (and for the engine's acknowledgements) with a bound. However the client
leaves, the session ends and the route releases its count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from ..errors import Qwen3TTSAgentError, StreamCancelledError
from ..waits import bounded, cancel_and_wait
from .audio import BYTES_PER_SAMPLE, PcmEncoder
from .outbox import Gone, SessionOutbox, Stalled
from .protocol import (
    CLOSE_IDLE,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_SEND_TIMEOUT,
    CLOSE_TOO_LARGE,
    ApiError,
    CancelMessage,
    ClientMessage,
    CloseMessage,
    FlushMessage,
    StartMessage,
    TextMessage,
    from_engine_error,
    parse_client_message,
)
from .state import ServerState, SynthesisSettings

logger = logging.getLogger(__name__)

# How long the teardown and a client's `cancel` wait for each thing they stop (the runner, an engine stream's cancel,
# the close of a stalled client) before they log it and go on: neither waits on them without a bound.
TEARDOWN_WAIT_S = 5.0


@dataclass(eq=False)
class _Utterance:
    uid: int
    parts: list[str] = field(default_factory=list)  # text received before the engine stream opened
    chars: int = 0
    has_words: bool = False  # some text that is not whitespace: only then is there anything to say
    flushed: bool = False
    cancelled: bool = False
    ended: bool = False  # audio finished (eos, max_frames, error): later text until the flush is dropped
    counted: bool = False  # in the utterances metric, by its finish reason (each utterance exactly once)
    cut_short: bool = False  # its stream was cancelled because the client went away mid-audio
    stream: Any = None
    waiter: asyncio.Future[float] | None = None  # its wait for a synthesis slot, so a cancel can end it
    speakable: asyncio.Event = field(default_factory=asyncio.Event)  # words, a flush or a cancel arrived

    def update(self) -> None:
        if self.has_words or self.flushed or self.cancelled:
            self.speakable.set()


def first_chunk_stages(timings: Any, sent: float) -> dict[str, float]:
    """Where a first chunk's time went, in ms: the way to the engine's loop (another process's, with an
    engine core process), the wait there for a slot, the prompt, the first frame, its audio decode, the way
    out."""
    arrived = timings.arrived or timings.submitted
    admitted = timings.admitted or arrived
    return {
        "handoff": 1000 * (arrived - timings.submitted),
        "admission": 1000 * (admitted - arrived),
        "prompt": 1000 * (timings.prefill_done - admitted),
        "first_frame": 1000 * (timings.first_frame - timings.prefill_done),
        "decode": 1000 * (timings.ready - timings.first_frame),
        "delivery": 1000 * (sent - timings.ready),
    }


class StreamSession:
    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self._ws = ws
        self._out = SessionOutbox(ws, send_timeout_s=state.config.send_timeout_s, on_stall=self._close_stalled)
        self._state = state
        self._config = state.config
        self._metrics = state.metrics
        self.session_id = uuid.uuid4().hex[:16]
        self._settings: SynthesisSettings | None = None
        self._queue: deque[_Utterance] = deque()  # utterances not yet finished, in order
        self._input: _Utterance | None = None  # the utterance text goes to until the next flush
        self._next_uid = 1
        self._wakeup = asyncio.Event()
        self._closing = False
        self._stopping = False  # set by the teardown: the runner stops at its next turn, cancel or not
        self._stall_closer: asyncio.Task[None] | None = None
        self._end_reason = "disconnect"  # why utterances still open at teardown are cancelled (metrics)
        self._runner: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Serve until the client leaves or the session is closed; always stops what it started."""
        watchdog = asyncio.create_task(self._idle_watchdog())
        try:
            while True:
                message = await self._ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self._out.touch()
                await self._on_message(message)
        except (Gone, WebSocketDisconnect, WebSocketDisconnected):
            pass
        except Exception:
            logger.exception("session %s failed", self.session_id)
            await self._fatal(ApiError("internal_error", "internal server error"), CLOSE_INTERNAL)
        finally:
            watchdog.cancel()
            await self._teardown()

    # ------------------------------------------------------------------ incoming
    async def _on_message(self, message: Mapping[str, Any]) -> None:
        raw = message.get("text")
        if raw is None:
            await self._send_error(ApiError("invalid_message", "binary messages are not accepted: send JSON text"))
            return
        if len(raw) > self._config.max_message_bytes or len(raw.encode()) > self._config.max_message_bytes:
            await self._send_error(
                ApiError("message_too_large", f"message exceeds {self._config.max_message_bytes} bytes")
            )
            await self._out.close(CLOSE_TOO_LARGE, "message too large")
            raise Gone
        try:
            await self._dispatch(parse_client_message(raw))
        except ApiError as err:
            await self._send_error(err)

    async def _dispatch(self, msg: ClientMessage) -> None:
        if isinstance(msg, StartMessage):
            await self._on_start(msg)
            return
        if self._settings is None:
            raise ApiError("not_started", "send a 'start' message first")
        if isinstance(msg, TextMessage):
            self._on_text(msg.text)
        elif isinstance(msg, FlushMessage):
            self._on_flush()
        elif isinstance(msg, CancelMessage):
            await self._on_cancel()
        elif isinstance(msg, CloseMessage):
            self._on_flush()
            self._closing = True
            self._wakeup.set()

    async def _on_start(self, msg: StartMessage) -> None:
        if self._settings is not None:
            raise ApiError("already_started", "the session has already started; open a new one for other settings")
        settings = self._state.settings(
            voice=msg.voice,
            language=msg.language,
            instruct=msg.instruct,
            sampling=msg.sampling,
            audio_format=msg.audio_format,
            chunk_schedule=msg.chunk_schedule,
        )
        self._settings = settings
        await self._out.send_json(
            {
                "type": "ready",
                "session_id": self.session_id,
                "model": self._config.model_name,
                "voice": settings.voice_label,
                "language": settings.language,
                "encoding": settings.audio_format.encoding,
                "sample_rate": settings.audio_format.sample_rate,
                "max_text_chars": self._state.max_text_chars,
                "max_message_bytes": self._config.max_message_bytes,
                "idle_timeout_s": self._config.idle_timeout_s,
                # what each utterance's chunks keep to (docs/server.md, "Chunks"): the session's schedule or the
                # server's, and whether a chunk before the last may be shorter, for a listener about to run dry
                "chunk_schedule": list(settings.chunk_schedule or self._state.engine.chunk_schedule),
                "chunks_cut_short_when_late": self._state.engine.adapt_chunks,
            }
        )
        self._runner = asyncio.create_task(self._run_utterances(), name=f"session-{self.session_id}")

    def _on_text(self, text: str) -> None:
        if self._closing:
            raise ApiError("invalid_message", "the session is closing: no more text is accepted")
        if not text:
            return
        utt = self._input
        used = utt.chars if utt is not None else 0
        if used + len(text) > self._state.max_text_chars:
            uid = utt.uid if utt is not None else self._next_uid
            raise ApiError(
                "text_too_long",
                f"utterance {uid} would exceed {self._state.max_text_chars} characters; this delta was dropped",
            )
        if utt is None:
            if len(self._queue) >= self._config.max_pending_utterances:
                raise ApiError(
                    "busy", f"{len(self._queue)} utterances already pending in this session; wait for their audio",
                    reason="session_pending",
                )
            utt = _Utterance(uid=self._next_uid)
            self._next_uid += 1
            self._input = utt
            self._queue.append(utt)
            self._wakeup.set()
        utt.chars += len(text)
        if not utt.has_words and not text.isspace():
            utt.has_words = True
            utt.update()
        if utt.ended or utt.cancelled:
            return
        if utt.stream is None:
            utt.parts.append(text)
            return
        try:
            utt.stream.push_text(text)
        except Qwen3TTSAgentError as exc:
            raise from_engine_error(exc) from exc

    def _on_flush(self) -> None:
        utt, self._input = self._input, None
        if utt is None:
            return
        utt.flushed = True
        utt.update()
        if utt.stream is not None and not utt.ended and not utt.cancelled:
            utt.stream.close_input()

    async def _on_cancel(self) -> None:
        """Stop everything this session has in flight; each utterance still gets its `done` (finish_reason cancelled)."""
        pending = await self._cancel_all()
        if pending:
            self._metrics.cancels.labels("client").inc()
        self._wakeup.set()

    async def _cancel_all(self) -> list[_Utterance]:
        """Mark every queued utterance cancelled and stop their engine streams; returns them."""
        self._input = None
        pending = list(self._queue)
        for utt in pending:
            utt.cancelled = True
            utt.update()
            if utt.waiter is not None:
                utt.waiter.cancel()
        streams = [utt for utt in pending if utt.stream is not None and not utt.stream.done]
        for utt in streams:  # every engine stream stops now, not each after the one before it has
            utt.stream.cancel()
        for utt in streams:
            await self._bounded_step(utt.stream.acancel(), f"cancelling utterance {utt.uid}")
        return pending

    # ------------------------------------------------------------------ outgoing
    async def _run_utterances(self) -> None:
        try:
            while True:
                while not (self._queue or self._closing or self._stopping):
                    self._wakeup.clear()
                    await self._wakeup.wait()
                if self._stopping:
                    return  # the client is gone: the teardown counts what is left
                if not self._queue:
                    break
                utt = self._queue[0]
                await self._speak(utt)
                self._queue.popleft()
                self._out.touch()
            await self._out.close(CLOSE_NORMAL, "session closed")
        except Gone:
            pass
        except Exception:
            logger.exception("session %s failed", self.session_id)
            await self._fatal(ApiError("internal_error", "internal server error"), CLOSE_INTERNAL)

    async def _speak(self, utt: _Utterance) -> None:
        assert self._settings is not None
        settings = self._settings
        await utt.speakable.wait()  # no slot is taken for an utterance that has nothing to say yet
        started = time.perf_counter()
        if utt.cancelled:
            await self._send_done(utt, "cancelled")
            return
        if not utt.has_words:
            await self._fail(utt, ApiError("invalid_text", f"utterance {utt.uid} is empty or whitespace-only"))
            return
        try:
            admission = self._state.require_ready()
        except ApiError as err:  # the engine is restarting: this utterance fails, the session goes on
            await self._fail(utt, err)
            return
        utt.waiter = asyncio.ensure_future(admission.acquire())
        try:
            queue_wait = await utt.waiter
        except ApiError as err:
            await self._fail(utt, err)
            return
        except asyncio.CancelledError:
            if _granted(utt.waiter):
                admission.release()  # the runner was cancelled just as its slot came: nobody will use it
            if not (utt.cancelled and utt.waiter.cancelled()):
                raise
            await self._send_done(utt, "cancelled")
            return
        try:
            self._metrics.queue_wait.observe(queue_wait)
            if utt.cancelled:
                await self._send_done(utt, "cancelled")
                return
            try:
                stream = self._state.open_stream(settings, None)
                utt.stream = stream
                for part in utt.parts:
                    stream.push_text(part)
                utt.parts.clear()
                if utt.flushed:
                    stream.close_input()
            except Exception as exc:
                if utt.stream is not None:
                    utt.stream.cancel()
                await self._fail(utt, exc if isinstance(exc, ApiError) else from_engine_error(exc))
                return
            await self._stream_audio(utt, stream, settings, started, queue_wait)
        finally:
            admission.release()

    async def _stream_audio(
        self, utt: _Utterance, stream: Any, settings: SynthesisSettings, started: float, queue_wait: float
    ) -> None:
        fmt = settings.audio_format
        encoder = PcmEncoder(fmt.encoding, fmt.sample_rate, self._state.engine.sample_rate)
        first_audio: float | None = None
        stages: dict[str, float] | None = None
        clock = self._metrics.playback("ws")
        seq = 0
        error: ApiError | None = None
        active = self._metrics.active_streams.labels("ws")
        active.inc()
        try:
            async with contextlib.aclosing(stream.__aiter__()) as chunks:
                async for chunk in chunks:
                    if utt.cancelled:
                        break
                    data = encoder.encode(chunk.pcm, last=chunk.is_last)
                    if not data:
                        continue
                    header = {
                        "type": "audio",
                        "utterance_id": utt.uid,
                        "seq": seq,
                        "frame_start": chunk.frame_start,
                        "frame_end": chunk.frame_end,
                        "samples": len(data) // BYTES_PER_SAMPLE[fmt.encoding],
                        "is_last": chunk.is_last,
                    }
                    await self._out.send_audio(header, data)
                    sent = time.perf_counter()
                    clock.sent(sent, chunk.duration)
                    if first_audio is None:
                        first_audio = sent - started
                        stages = first_chunk_stages(chunk.timings, sent)
                    seq += 1
        except StreamCancelledError:
            pass
        except Gone as gone:
            stream.cancel()  # at once, before the slot is released: nobody will hear the rest
            # the teardown counts it with the cancels by disconnect (a stalled client's are counted as it closes)
            utt.cut_short = not isinstance(gone, Stalled)
            raise
        except Exception as exc:
            logger.exception("session %s utterance %d failed", self.session_id, utt.uid)
            error = from_engine_error(exc)
        finally:
            active.dec()
            utt.ended = True
        if utt.cancelled:
            if not stream.done:
                await stream.acancel()
            result = stream.result
            await self._send_done(
                utt,
                "cancelled",
                {
                    "cancel_latency_s": result.cancel_latency,
                    "frames": result.frames,
                    "audio_seconds": result.audio_seconds,
                    "chunks": seq,
                },
            )
            return
        if error is not None:
            await self._fail(utt, error)
            return
        result = stream.result
        self._count(utt, str(result.finish_reason))
        self._metrics.audio_seconds.inc(result.audio_seconds)
        self._metrics.real_time_factor.observe(result.real_time_factor)
        if first_audio is not None:
            self._metrics.first_audio.labels("ws").observe(first_audio)
        await self._send_done(
            utt,
            result.finish_reason,
            {
                "first_audio_latency_s": first_audio,
                "queue_wait_s": queue_wait,
                "audio_seconds": result.audio_seconds,
                "wall_seconds": time.perf_counter() - started,
                "real_time_factor": result.real_time_factor,
                "frames": result.frames,
                "chunks": seq,
                "text_chars": utt.chars,
                "first_chunk_stages_ms": stages,
                "text_wait_s": result.text_wait,
            },
        )

    async def _fail(self, utt: _Utterance, err: ApiError) -> None:
        utt.ended = True
        self._count(utt, "error")
        await self._send_error(err, utt.uid)
        await self._send_done(utt, "error")

    def _count(self, utt: _Utterance, finish_reason: str) -> None:
        if not utt.counted:
            utt.counted = True
            self._metrics.utterances.labels("ws", finish_reason).inc()

    async def _send_done(self, utt: _Utterance, finish_reason: str, metrics: dict[str, Any] | None = None) -> None:
        if finish_reason == "cancelled":
            self._count(utt, "cancelled")
        await self._out.send_json(
            {"type": "done", "utterance_id": utt.uid, "finish_reason": finish_reason, "metrics": metrics}
        )

    async def _send_error(self, err: ApiError, uid: int | None = None) -> None:
        self._state.count_error(err)
        body: dict[str, Any] = {"type": "error", "code": err.code, "status": err.status, "message": err.message}
        if uid is not None:
            body["utterance_id"] = uid
        await self._out.send_json(body)

    def _close_stalled(self) -> asyncio.Task[None]:
        """Start (once) closing a client that stopped reading; a task, so the teardown cannot cut it short."""
        if self._stall_closer is None:
            self._stall_closer = asyncio.create_task(self._close_stalled_now(), name=f"stalled-{self.session_id}")
        return self._stall_closer

    async def _close_stalled_now(self) -> None:
        """Free the client's slots first, then say why (if it can still hear it) and close with 4010."""
        self._end_reason = "send_timeout"
        for utt in await self._cancel_all():
            self._count(utt, "cancelled")
            if utt.stream is not None:
                self._metrics.cancels.labels("send_timeout").inc()
        timeout = self._config.send_timeout_s
        err = ApiError("send_timeout", f"the client read nothing for {timeout:g}s; its utterances were cancelled")
        self._state.count_error(err)
        body = {"type": "error", "code": err.code, "status": err.status, "message": err.message}
        await self._out.last_words(body, CLOSE_SEND_TIMEOUT, "send_timeout")

    async def _fatal(self, err: ApiError, code: int) -> None:
        try:
            await self._send_error(err)
        except Gone:
            return
        await self._out.close(code, err.message[:100])

    async def _idle_watchdog(self) -> None:
        """Close a session with no message either way for idle_timeout_s, unless it is waiting for a slot.

        That includes an unflushed utterance waiting for more text: its engine stream holds a slot, and a
        client that went silent must not keep it.
        """
        timeout = self._config.idle_timeout_s
        while True:
            idle_for = time.monotonic() - self._out.last_activity
            if self._waiting_for_slot():
                await asyncio.sleep(min(timeout, 1.0))
                continue
            if idle_for >= timeout:
                self._end_reason = "idle_timeout"
                await self._fatal(ApiError("idle_timeout", f"no message for {timeout:g}s; closing"), CLOSE_IDLE)
                return
            await asyncio.sleep(max(timeout - idle_for, 0.05))

    def _waiting_for_slot(self) -> bool:
        return any(utt.waiter is not None and not utt.waiter.done() for utt in self._queue)

    async def _teardown(self) -> None:
        """The client is gone or the session closed: cancel engine work still running, then stop the runner.

        Each wait is bounded (`TEARDOWN_WAIT_S`), and the runner stops at `_stopping` even if its cancel is
        lost, so the session always ends. Utterances that never got their `done` are counted as cancelled, so
        the metrics add up to every utterance opened.
        """
        self._out.gone = True
        self._stopping = True
        self._wakeup.set()
        if self._out.stalled:
            await self._bounded_step(asyncio.shield(self._close_stalled()), "closing the stalled client")
        # streams the client's departure cut short: still running, or cancelled as a send to it failed
        interrupted = [u for u in self._queue if u.stream is not None and (u.cut_short or not u.stream.done)]
        for utt in self._queue:
            utt.cancelled = True
            utt.update()
        for utt in interrupted:
            if not utt.stream.done:
                await self._bounded_step(utt.stream.acancel(), f"cancelling utterance {utt.uid}")
            self._metrics.cancels.labels(self._end_reason).inc()
        if self._runner is not None:
            await cancel_and_wait(self._runner, TEARDOWN_WAIT_S, f"the runner of session {self.session_id}")
        for utt in self._queue:
            self._count(utt, "cancelled")

    async def _bounded_step(self, step: Awaitable[object], what: str) -> None:
        """One step of stopping (the teardown, a client's `cancel`): given `TEARDOWN_WAIT_S`, then logged and left
        behind."""
        try:
            await bounded(step, TEARDOWN_WAIT_S)
        except TimeoutError:
            logger.warning("session %s: %s took over %gs; going on", self.session_id, what, TEARDOWN_WAIT_S)
        except Exception:
            logger.exception("session %s: %s failed", self.session_id, what)


def _granted(waiter: asyncio.Future[float]) -> bool:
    """The wait for a slot ended with the slot (so it must be released by whoever holds the waiter)."""
    return waiter.done() and not waiter.cancelled() and waiter.exception() is None
