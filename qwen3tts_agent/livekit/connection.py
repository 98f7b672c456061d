"""One WebSocket session with the server, reused by consecutive streams, with failures as LiveKit API errors.

A session's voice, language, sampling and audio format are fixed by its `start` message, so a connection
carries the options it was started with and serves only streams with equal options. Between two streams it
must owe nothing: every utterance it opened has had its `done`. A stream that ends early (the agent was
interrupted) therefore sends `cancel` and reads the remaining `done` messages before the connection goes
back to the pool; anything unexpected closes it instead.

Every wait here is `waits.bounded`, not `asyncio.wait_for`: on Python 3.10/3.11 that can return a message to
a reader that was just cancelled, which then reads on while the stream waits for it to end.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from livekit.agents import APIConnectionError, APIError, APIStatusError, APITimeoutError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedOK,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)
from websockets.protocol import State

from ..waits import bounded
from . import protocol
from .protocol import SessionOptions

# Reuse an idle connection only within this share of the server's idle timeout, so the server does not
# close it while a new stream is starting on it.
IDLE_REUSE_SHARE = 0.8
# After an interruption, how long to wait for the server's `done` messages before giving the connection up.
DRAIN_TIMEOUT_S = 2.0


class Connection:
    """A started server session: send messages, read the server's messages in order, count open utterances."""

    def __init__(self, ws: ClientConnection, opts: SessionOptions, idle_timeout: float) -> None:
        self.opts = opts
        self.timeout = 10.0  # seconds of silence that count as a timeout while an answer is due; set per stream
        self.open_utterances = 0  # utterances with text sent and no `done` yet: only then is silence a timeout
        self._ws = ws
        self._idle_timeout = idle_timeout
        self._idle_since = time.monotonic()

    @classmethod
    async def open(cls, opts: SessionOptions, timeout: float) -> Connection:
        """Connect and start a session; raises APIStatusError (refused), APITimeoutError or APIConnectionError."""
        try:
            ws = await connect(
                opts.url,
                additional_headers=opts.headers(),
                open_timeout=timeout,
                close_timeout=1,
                max_size=protocol.MAX_MESSAGE_BYTES,
                proxy=None,
            )
        except InvalidStatus as exc:
            raise handshake_error(exc) from exc
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise APITimeoutError(f"connecting to {opts.url} timed out") from exc
        except (OSError, InvalidHandshake, InvalidURI) as exc:
            raise APIConnectionError(f"cannot connect to the TTS server at {opts.url}") from exc
        conn = cls(ws, opts, protocol.DEFAULT_IDLE_TIMEOUT_S)
        conn.timeout = timeout
        try:
            await conn.send(opts.start_message())
            ready = await conn._recv_json(expected=True)
            if ready.get("type") == "error":
                raise server_error(ready)
            if ready.get("type") != "ready":
                raise APIError(f"unexpected first message from the TTS server: {ready}")
        except BaseException:
            await conn.aclose()
            raise
        conn._idle_timeout = float(ready.get("idle_timeout_s") or protocol.DEFAULT_IDLE_TIMEOUT_S)
        return conn

    @property
    def is_open(self) -> bool:
        return self._ws.state is State.OPEN

    def reusable(self) -> bool:
        """Open, owing nothing, and idle for well under the server's idle timeout."""
        idle = time.monotonic() - self._idle_since
        return self.is_open and self.open_utterances == 0 and idle < IDLE_REUSE_SHARE * self._idle_timeout

    def mark_idle(self) -> None:
        """A stream is done with it: the server's idle clock starts now."""
        self._idle_since = time.monotonic()

    async def send(self, body: dict[str, Any]) -> None:
        try:
            await self._ws.send(json.dumps(body))
        except ConnectionClosed as exc:
            raise APIConnectionError("the TTS server closed the connection") from exc

    async def _recv(self, *, expected: bool = False) -> str | bytes:
        """The next message. Silence is a timeout only when an answer is due (`expected`, or audio owed)."""
        while True:
            try:
                return await bounded(self._ws.recv(), self.timeout)
            except TimeoutError:
                if expected or self.open_utterances > 0:
                    raise APITimeoutError(f"no answer from the TTS server for {self.timeout:g}s") from None
                # waiting for our own text (an LLM still thinking) is not the server's fault

    async def _recv_json(self, *, expected: bool = False) -> dict[str, Any]:
        message = await self._recv(expected=expected)
        if not isinstance(message, str):
            raise APIError("protocol error: audio without its header")
        body: dict[str, Any] = json.loads(message)
        return body

    async def next_message(self) -> tuple[dict[str, Any], bytes]:
        """(header, payload) for an audio chunk, (message, b"") otherwise; keeps `open_utterances` current.

        Raises APIConnectionError when the server closes the session, which it never does while a stream
        still expects messages on it.
        """
        try:
            msg = await self._recv_json()
            if msg.get("type") == "audio":
                payload = await self._recv(expected=True)
                if not isinstance(payload, bytes):
                    raise APIError("protocol error: audio header without its payload")
                return msg, payload
            if msg.get("type") == "done":
                self.open_utterances -= 1
            return msg, b""
        except ConnectionClosedOK as exc:
            raise APIConnectionError(f"the TTS server closed the session ({exc.rcvd})") from exc
        except ConnectionClosed as exc:
            raise APIConnectionError("lost the connection to the TTS server") from exc

    async def cancel_and_drain(self) -> bool:
        """Stop this session's utterances and read their `done` messages; True when it owes nothing after."""
        if self.open_utterances == 0:
            return self.is_open

        async def read_dones() -> None:
            while self.open_utterances > 0:
                message = await self._ws.recv()
                # an interrupted reader may have left an audio payload behind its header: skip it
                if isinstance(message, str) and json.loads(message).get("type") == "done":
                    self.open_utterances -= 1

        try:
            await bounded(self._ws.send(json.dumps(protocol.CANCEL)), 1.0)
            await bounded(read_dones(), DRAIN_TIMEOUT_S)
        except (ConnectionClosed, OSError, TimeoutError, ValueError):
            return False
        return self.is_open

    async def aclose(self, *, cancel: bool = False) -> None:
        """Close; with `cancel`, first tell the server to stop the utterance so its GPU slot frees at once."""
        try:
            if cancel and self.open_utterances > 0:
                await bounded(self._ws.send(json.dumps(protocol.CANCEL)), 1.0)
            await bounded(self._ws.close(), 2.0)
        except (ConnectionClosed, OSError, TimeoutError):
            pass  # the connection is already gone: the server cancels on disconnect anyway


def server_error(msg: dict[str, Any]) -> APIStatusError:
    """A server `error` message as the LiveKit error its retry logic understands.

    APIStatusError marks 4xx (except 408/429) non-retryable and 5xx (busy = 503) retryable.
    """
    return APIStatusError(
        f"TTS server error {msg.get('code')}: {msg.get('message')}", status_code=int(msg.get("status", 500)), body=msg
    )


def handshake_error(exc: InvalidStatus) -> APIStatusError:
    response = exc.response
    body: Any
    try:
        body = json.loads(response.body or b"{}")
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        body, message = None, f"HTTP {response.status_code}"
    return APIStatusError(f"TTS server refused the connection: {message}", status_code=response.status_code, body=body)
