"""The sending side of one WebSocket session (`SessionOutbox`): one lock, a deadline on every send, and a close
that says why.

Every send waits only while the connection's bounded send buffer is full, i.e. while the client is not
reading; after `send_timeout_s` the outbox counts the client as stalled and calls `on_stall` (the session then
frees the client's synthesis slots and closes with 4010, `StreamSession`). An audio header and its payload go
out back to back under the lock, so a client can always pair them, and the last words of a closing session
never land between the two. Every wait here is `waits.bounded`, never `asyncio.wait_for`, whose Python 3.10/3.11
version can turn a cancel of the sending task into a normal return (the session's teardown would then wait
for a runner that was never stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from ..waits import bounded

# what starlette/uvicorn raise when sending on a socket that is closing or closed (OSError includes the
# builtin TimeoutError, which `bounded` raises: catch that first where it means something else)
SEND_ERRORS = (WebSocketDisconnect, WebSocketDisconnected, OSError, RuntimeError)

# After a send timed out, how long the last words may still wait for room before the close goes out.
LAST_WORDS_S = 1.0


class Gone(Exception):
    """The peer is gone (or we closed): stop sending and wind the session down."""


class Stalled(Gone):
    """A send waited `send_timeout_s` for a client that does not read (the session is being closed)."""


class SessionOutbox:
    """Sends a session's messages; `gone` once the peer left, a send failed or the session closed."""

    def __init__(self, ws: WebSocket, *, send_timeout_s: float, on_stall: Callable[[], object]) -> None:
        self._ws = ws
        self._send_timeout_s = send_timeout_s
        self._on_stall = on_stall
        self._lock = asyncio.Lock()
        self._mid_audio = False  # an audio header went out and its binary frame has not (yet)
        self.gone = False
        self.stalled = False  # a send timed out: the client does not read
        self.last_activity = time.monotonic()  # the last message either way (`touch` for incoming ones)

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    async def send_json(self, body: dict[str, Any]) -> None:
        async with self._lock:
            await self._send({"type": "websocket.send", "text": _dumps(body)})

    async def send_audio(self, header: dict[str, Any], data: bytes) -> None:
        async with self._lock:
            await self._send({"type": "websocket.send", "text": _dumps(header)})
            self._mid_audio = True
            await self._send({"type": "websocket.send", "bytes": data})
            self._mid_audio = False

    async def _send(self, message: dict[str, Any]) -> None:
        if self.gone:
            raise Gone
        try:
            await bounded(self._ws.send(message), self._send_timeout_s)
        except TimeoutError:
            self.gone = self.stalled = True
            self._on_stall()  # its close ends the reader, whose teardown waits for it
            raise Stalled from None
        except SEND_ERRORS:
            self.gone = True
            raise Gone from None
        self.touch()

    async def close(self, code: int, reason: str) -> None:
        """Close the socket (once), after any send in progress; the close has a send's deadline."""
        async with self._lock:
            if self.gone:
                return
            self.gone = True
            with contextlib.suppress(TimeoutError, *SEND_ERRORS):
                await bounded(self._ws.close(code, reason), self._send_timeout_s)

    async def last_words(self, body: dict[str, Any], code: int, reason: str) -> None:
        """For a stalled client: `body` if room for it appears within `LAST_WORDS_S` (never between an audio
        header and its payload), then the close, each bounded by the same wait."""
        with contextlib.suppress(TimeoutError, *SEND_ERRORS):
            await bounded(self._lock.acquire(), LAST_WORDS_S, discard=lambda _: self._lock.release())
            try:
                if not self._mid_audio:
                    await bounded(self._ws.send({"type": "websocket.send", "text": _dumps(body)}), LAST_WORDS_S)
            finally:
                self._lock.release()
        with contextlib.suppress(TimeoutError, *SEND_ERRORS):
            # BoundedWebSocketProtocol queues the close without waiting; the bound covers any other server.
            await bounded(self._ws.close(code, reason), LAST_WORDS_S)


def _dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))
