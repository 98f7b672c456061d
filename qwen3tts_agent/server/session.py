"""One WebSocket streaming session: text deltas in, PCM frames out, one utterance after another.

Two tasks share the socket. The reader parses client messages and feeds text into the current utterance
(straight into its engine stream once one is open); the runner takes utterances in order, waits for a
synthesis slot, streams the audio, and ends each with a `done` message carrying its metrics. A cancel or a
disconnect stops the engine streams explicitly, so no GPU work outlives the client that asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from ..errors import Qwen3TTSAgentError, StreamCancelledError
from .audio import BYTES_PER_SAMPLE, PcmEncoder
from .protocol import (
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

CLOSE_NORMAL = 1000
CLOSE_TOO_LARGE = 1009
CLOSE_INTERNAL = 1011
CLOSE_IDLE = 4008  # application range; mirrors HTTP 408


# what starlette/uvicorn raise when sending on a socket that is closing or closed
_SEND_ERRORS = (WebSocketDisconnect, WebSocketDisconnected, OSError, RuntimeError)


class _Gone(Exception):
    """The peer is gone (or we closed): stop sending and wind the session down."""


@dataclass(eq=False)
class _Utterance:
    uid: int
    parts: list[str] = field(default_factory=list)  # text received before the engine stream opened
    chars: int = 0
    flushed: bool = False
    cancelled: bool = False
    ended: bool = False  # audio finished (eos, max_frames, error): later text until the flush is dropped
    stream: Any = None
    waiter: asyncio.Future[float] | None = None  # its wait for a synthesis slot, so a cancel can end it


class StreamSession:
    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self._ws = ws
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
        self._gone = False
        self._send_lock = asyncio.Lock()
        self._last_activity = time.monotonic()
        self._runner: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Serve until the client leaves or the session is closed; always stops what it started."""
        watchdog = asyncio.create_task(self._idle_watchdog())
        try:
            while True:
                message = await self._ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self._last_activity = time.monotonic()
                await self._on_message(message)
        except (_Gone, WebSocketDisconnect, WebSocketDisconnected):
            pass
        finally:
            watchdog.cancel()
            await self._teardown()

    # ------------------------------------------------------------------ incoming
    async def _on_message(self, message: dict[str, Any]) -> None:
        raw = message.get("text")
        if raw is None:
            await self._send_error(ApiError("invalid_message", "binary messages are not accepted: send JSON text"))
            return
        if len(raw) > self._config.max_message_bytes or len(raw.encode()) > self._config.max_message_bytes:
            await self._send_error(
                ApiError("message_too_large", f"message exceeds {self._config.max_message_bytes} bytes")
            )
            await self._close(CLOSE_TOO_LARGE, "message too large")
            raise _Gone
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
        await self._send_json(
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
                    "busy", f"{len(self._queue)} utterances already pending in this session; wait for their audio"
                )
            utt = _Utterance(uid=self._next_uid)
            self._next_uid += 1
            self._input = utt
            self._queue.append(utt)
            self._wakeup.set()
        utt.chars += len(text)
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
        if utt.stream is not None and not utt.ended and not utt.cancelled:
            utt.stream.close_input()

    async def _on_cancel(self) -> None:
        """Stop everything this session has in flight; each utterance still gets its `done` (finish_reason cancelled)."""
        self._input = None
        pending = list(self._queue)
        for utt in pending:
            utt.cancelled = True
            if utt.waiter is not None:
                utt.waiter.cancel()
        for utt in pending:
            if utt.stream is not None and not utt.stream.done:
                await utt.stream.acancel()
        if pending:
            self._metrics.cancels.labels("client").inc()
        self._wakeup.set()

    # ------------------------------------------------------------------ outgoing
    async def _run_utterances(self) -> None:
        try:
            while True:
                while not self._queue and not self._closing:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                if not self._queue:
                    break
                utt = self._queue[0]
                await self._speak(utt)
                self._queue.popleft()
                self._last_activity = time.monotonic()
            await self._close(CLOSE_NORMAL, "session closed")
        except _Gone:
            pass
        except Exception:
            logger.exception("session %s failed", self.session_id)
            await self._fatal(ApiError("internal_error", "internal server error"), CLOSE_INTERNAL)

    async def _speak(self, utt: _Utterance) -> None:
        assert self._settings is not None
        settings = self._settings
        started = time.perf_counter()
        if utt.cancelled:
            await self._send_done(utt, "cancelled")
            return
        admission = self._state.require_ready()
        utt.waiter = asyncio.ensure_future(admission.acquire())
        try:
            queue_wait = await utt.waiter
        except ApiError as err:
            await self._fail(utt, err)
            return
        except asyncio.CancelledError:
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
                    await self._send_audio(header, data)
                    if first_audio is None:
                        first_audio = time.perf_counter() - started
                    seq += 1
        except StreamCancelledError:
            pass
        except _Gone:
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
        self._metrics.utterances.labels("ws", result.finish_reason).inc()
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
            },
        )

    async def _fail(self, utt: _Utterance, err: ApiError) -> None:
        utt.ended = True
        self._metrics.utterances.labels("ws", "error").inc()
        await self._send_error(err, utt.uid)
        await self._send_done(utt, "error")

    async def _send_done(self, utt: _Utterance, finish_reason: str, metrics: dict[str, Any] | None = None) -> None:
        if finish_reason == "cancelled":
            self._metrics.utterances.labels("ws", "cancelled").inc()
        await self._send_json(
            {"type": "done", "utterance_id": utt.uid, "finish_reason": finish_reason, "metrics": metrics}
        )

    async def _send_error(self, err: ApiError, uid: int | None = None) -> None:
        self._state.count_error(err)
        body: dict[str, Any] = {"type": "error", "code": err.code, "status": err.status, "message": err.message}
        if uid is not None:
            body["utterance_id"] = uid
        await self._send_json(body)

    async def _send_json(self, body: dict[str, Any]) -> None:
        async with self._send_lock:
            await self._raw_send({"type": "websocket.send", "text": json.dumps(body, separators=(",", ":"))})

    async def _send_audio(self, header: dict[str, Any], data: bytes) -> None:
        # header and payload go out back to back, so a client can always pair them
        async with self._send_lock:
            await self._raw_send({"type": "websocket.send", "text": json.dumps(header, separators=(",", ":"))})
            await self._raw_send({"type": "websocket.send", "bytes": data})

    async def _raw_send(self, message: dict[str, Any]) -> None:
        if self._gone:
            raise _Gone
        try:
            await self._ws.send(message)
        except _SEND_ERRORS:
            self._gone = True
            raise _Gone from None

    async def _close(self, code: int, reason: str) -> None:
        async with self._send_lock:
            if self._gone:
                return
            self._gone = True
            with contextlib.suppress(*_SEND_ERRORS):
                await self._ws.close(code, reason)

    async def _fatal(self, err: ApiError, code: int) -> None:
        try:
            await self._send_error(err)
        except _Gone:
            return
        await self._close(code, err.message[:100])

    async def _idle_watchdog(self) -> None:
        timeout = self._config.idle_timeout_s
        while True:
            idle_for = time.monotonic() - self._last_activity
            if not self._queue and idle_for >= timeout:
                await self._fatal(ApiError("idle_timeout", f"no message for {timeout:g}s; closing"), CLOSE_IDLE)
                return
            await asyncio.sleep(max(timeout - idle_for, 0.05) if not self._queue else timeout)

    async def _teardown(self) -> None:
        """The client is gone or the session closed: cancel engine work still running, then the runner."""
        self._gone = True
        interrupted = [u for u in self._queue if u.stream is not None and not u.stream.done]
        for utt in self._queue:
            utt.cancelled = True
        for utt in interrupted:
            try:
                await utt.stream.acancel()
            except Exception:
                logger.exception("cancelling utterance %d of session %s", utt.uid, self.session_id)
        if interrupted:
            self._metrics.cancels.labels("disconnect").inc()
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
