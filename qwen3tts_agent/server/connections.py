"""uvicorn's connection protocols with the time bounds a public server needs and stock uvicorn lacks.

Stock uvicorn never times out a request head: a client that sends part of one (or nothing) and falls silent
keeps its connection forever. It also never gives up on a client that stops reading: a send waits for the
transport's buffer to drain, and even a close waits behind the unread bytes, so a stalled connection and
its memory outlive the request. These subclasses add exactly those bounds and nothing else:

- HTTP (httptools): the request head must be complete within `read_timeout_s` of the connection opening
  (or of the request's first byte on a keep-alive connection), else 408 and close; a request answered before
  its body arrived (an early 401, 404 or 503: the app never reads the body, so no body deadline of its own
  starts) must finish sending the body within `read_timeout_s` of the answer, else the connection closes (each
  byte of a trickled body would otherwise keep it open for good); a response the client
  leaves unread for `send_timeout_s` aborts the connection, which the app sees as a disconnect (so the
  utterance is cancelled and its slot freed).
- WebSocket (websockets-sansio): a close never waits for the client to read: the close frame is queued
  behind what is buffered, and a connection whose close is not answered within `send_timeout_s` is aborted;
  so is any connection still open that long after its session ended. The app itself times out its sends
  (see `StreamSession`), so it can still say why it closes.
- Both: each connection queues a bounded amount before its sends wait for the client: the transport's write
  buffer holds `send_buffer_bytes`, and so does the kernel's socket buffer (SO_SNDBUF, which Linux doubles
  for bookkeeping), instead of growing by autotuning to megabytes (minutes of audio) per connection.

`uvicorn_options` gives the uvicorn settings that install them, with the rest the server relies on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState

from .config import ServerConfig
from .protocol import ApiError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    send_buffer_bytes: int
    send_timeout_s: float
    read_timeout_s: float


class BoundedHttpProtocol(HttpToolsProtocol):
    """httptools HTTP/1.1 with a deadline for each request head and for unread responses."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head_deadline: asyncio.TimerHandle | None = None
        self._unread_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        bound_send_buffers(transport, self.limits.send_buffer_bytes)
        self._expect_head()  # a connection that never sends a byte is held no longer than a slow head

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._expect_head()

    def on_headers_complete(self) -> None:
        _cancel(self._head_deadline)
        self._head_deadline = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        _cancel(self._body_deadline)  # the rest of an early-answered body came in time
        self._body_deadline = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            self._body_deadline = self.loop.call_later(self.limits.read_timeout_s, self._body_timed_out)

    def handle_websocket_upgrade(self) -> None:
        self._stop_timers()  # the WebSocket protocol takes the transport over, with bounds of its own
        super().handle_websocket_upgrade()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread_deadline is None:
            self._unread_deadline = self.loop.call_later(self.limits.send_timeout_s, self._client_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        _cancel(self._unread_deadline)
        self._unread_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        super().connection_lost(exc)

    def _expect_head(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.limits.read_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._expect_head()  # a pipelined head: its time counts once the response before it is done
            return
        err = ApiError("request_timeout", f"request head not received within {self.limits.read_timeout_s:g}s")
        body = json.dumps(err.to_openai()).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_deadline = None
        if not self.transport.is_closing():
            self.transport.close()  # the answer went out already; the rest of its body is not worth waiting for

    def _client_stalled(self) -> None:
        self._unread_deadline = None
        logger.warning("closing an HTTP connection whose client read nothing for %gs", self.limits.send_timeout_s)
        self.transport.abort()

    def _stop_timers(self) -> None:
        for timer in (self._head_deadline, self._unread_deadline, self._body_deadline):
            _cancel(timer)
        self._head_deadline = self._unread_deadline = self._body_deadline = None


class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
    """websockets-sansio whose close never waits on a client that does not read."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.close_timeout = limits.send_timeout_s  # how long an unanswered close may keep the connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        bound_send_buffers(self.transport, self.limits.send_buffer_bytes)

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.close" and self._open():
            self._close_now(message.get("code", 1000), message.get("reason") or "")
            return
        await super().send(message)

    def on_task_complete(self, task: asyncio.Task[None]) -> None:
        super().on_task_complete(task)
        # The session is over; whatever is still buffered gets as long as a close would, then the socket goes.
        self.loop.call_later(self.close_timeout, self.transport.abort)

    def _open(self) -> bool:
        return (
            self.handshake_complete
            and self.initial_response is None
            and not self.close_sent
            and not self.disconnected
            and not self.transport.is_closing()
        )

    def _close_now(self, code: int, reason: str) -> None:
        """The stock close, minus its wait for the write buffer to drain, with an abort if left unanswered."""
        try:
            self.conn.send_close(code, reason)
        except InvalidState:
            raise ClientDisconnected() from None
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.close_timer = self.loop.call_later(self.close_timeout, self.transport.abort)


def bound_send_buffers(transport: asyncio.Transport, size: int) -> None:
    """Cap what one connection buffers for its client: the transport's queue and the kernel's socket buffer."""
    transport.set_write_buffer_limits(high=size)
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


def connection_limits(config: ServerConfig) -> ConnectionLimits:
    return ConnectionLimits(
        send_buffer_bytes=config.send_buffer_bytes,
        send_timeout_s=config.send_timeout_s,
        read_timeout_s=config.http_read_timeout_s,
    )


def websocket_frame_limit(config: ServerConfig) -> int:
    """The protocol layer refuses frames over twice the app's limit before buffering them; between the two the
    app answers with a readable error. Both close with 1009."""
    return 2 * config.max_message_bytes


def connection_protocols(
    config: ServerConfig,
) -> tuple[Callable[..., BoundedHttpProtocol], Callable[..., BoundedWebSocketProtocol]]:
    """The two protocol factories, bound to this server's limits (uvicorn makes one per connection).

    Partials of module-level classes, so a uvicorn config that holds them pickles (worker processes).
    """
    limits = connection_limits(config)
    return partial(BoundedHttpProtocol, limits=limits), partial(BoundedWebSocketProtocol, limits=limits)


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def uvicorn_config(app: object, config: ServerConfig, **overrides: object) -> uvicorn.Config:
    """The uvicorn settings the server relies on, shared by the CLI and the tests."""
    return uvicorn.Config(app, **uvicorn_options(config, **overrides))  # type: ignore[arg-type]


def uvicorn_options(config: ServerConfig, **overrides: object) -> dict[str, object]:
    """The uvicorn settings as keyword arguments (the engine-core launcher builds its own Config)."""
    http_protocol, ws_protocol = connection_protocols(config)
    options: dict[str, object] = dict(
        host=config.host,
        port=config.port,
        ws_max_size=websocket_frame_limit(config),
        # No permessage-deflate, which clients (browsers, the `websockets` library) offer by default: zlib over
        # PCM saves little and cost an API worker about half its event loop under load (docs/server.md).
        ws_per_message_deflate=False,
        http=http_protocol,  # httptools and websockets-sansio, with read, send and close deadlines
        ws=ws_protocol,
        timeout_keep_alive=config.keep_alive_timeout_s,
        timeout_graceful_shutdown=5,
    )
    options.update(overrides)
    return options
