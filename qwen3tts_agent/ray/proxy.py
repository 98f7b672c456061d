"""Middleware for Ray Serve's HTTP proxies: the server's error shapes where Serve itself answers.

Serve's proxy (one per node) accepts the connections and relays them to a replica. Two of its answers
never pass through our app, and this middleware gives them the shapes the server documents:

- A replica that dies (killed, out of memory, node lost) in the middle of a WebSocket session leaves
  its client with a socket that Serve simply drops. Here the client instead gets an `error`
  (`engine_error`, 500) and a close with 1011, so it knows to open a new session, which Serve routes to
  a live replica.
- Serve's own HTTP errors (the replica died before answering, every replica at its ongoing-request
  limit and the proxy's queue full, no application yet) are plain text; here they become the
  OpenAI-shaped JSON errors of `server/protocol.py` (`engine_error`, `busy` with Retry-After, ...).

And one relay it keeps going: a WebSocket client that leaves first (it closes as its `done` arrives, racing
the replica's own close) makes the proxy's next send fail, and Serve's proxy then abandoned the request and
logged a normal session as failed; the middleware drops what can no longer be delivered instead.

Serve loads proxy middleware from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read by each proxy at
start: `serve-ray` sets it for the cluster it starts; on a cluster started with `ray start`, export
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=qwen3tts_agent.ray.proxy:proxy_middlewares` before it on
every node (docs/ray.md).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.utils import ClientDisconnected

from ..server.protocol import CLOSE_INTERNAL, ApiError
from .transport import bound_proxy_connections

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "qwen3tts_agent.ray.proxy:proxy_middlewares"

REPLICA_LOST = "the replica serving this session stopped; open a new session to continue"
_SERVE_ERRORS = {  # Serve's own plain-text answers, in the server's codes
    404: ("not_found", "no such route"),
    408: ("request_timeout", "the request timed out in the Serve proxy"),
    500: ("engine_error", "the replica serving this request stopped; retry"),
    503: ("busy", "every replica is at its limit; retry shortly"),
}


def proxy_middlewares() -> list[Middleware]:
    """The callback Serve calls in each proxy (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`), before the proxy starts
    its server: that server gets `serve`'s connection protocols and bounds too (`transport.py`)."""
    bound_proxy_connections()
    return [Middleware(ServeErrorShapes)]


def _openai_error(status: int, detail: bytes) -> tuple[ApiError, bytes]:
    code, message = _SERVE_ERRORS.get(status, ("internal_error", "the Serve proxy failed the request"))
    text = detail.decode(errors="replace").strip()
    err = ApiError(code, f"{message} ({text[:200]})" if text else message)
    return err, json.dumps(err.to_openai()).encode()


class ServeErrorShapes:
    """Pure ASGI middleware (see the module docstring): no buffering of successful responses."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = {"accepted": False, "ended": False, "client_gone": False}

        async def tracked_receive() -> Message:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                state["ended"] = True
            return message

        async def tracked_send(message: Message) -> None:
            kind = message["type"]
            if kind == "websocket.accept":
                state["accepted"] = True
            elif kind in ("websocket.close", "websocket.http.response.start"):
                state["ended"] = True
            if state["client_gone"]:
                return
            try:
                await send(message)
            except ClientDisconnected:
                # The client left first: it closed as its `done` arrived, racing the replica's own close, or
                # its connection dropped. Nothing is left to deliver, so the message is dropped, as are the
                # replica's last ones: raised here, Serve's proxy would stop relaying mid-request and log
                # the session as failed ("Request failed due to unexpected error", once for about half the
                # sessions of a load that closes on `done`). The replica learns of the departure from the
                # disconnect on its receive side and ends the session itself.
                state["client_gone"] = state["ended"] = True

        try:
            await self.app(scope, tracked_receive, tracked_send)
        finally:
            if state["accepted"] and not state["ended"]:
                await self._replica_lost(send)

    @staticmethod
    async def _replica_lost(send: Send) -> None:
        """The session's replica is gone without a close: say so, then close as a server fault does."""
        err = ApiError("engine_error", REPLICA_LOST)
        body = {"type": "error", "code": err.code, "status": err.status, "message": err.message}  # as session.py
        try:
            await send({"type": "websocket.send", "text": json.dumps(body, separators=(",", ":"))})
            await send({"type": "websocket.close", "code": CLOSE_INTERNAL, "reason": "replica lost"})
        except Exception:  # noqa: BLE001 - the client left meanwhile: nothing to tell
            pass

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        held: dict[str, Any] = {}  # a plain-text error response being rewritten
        state = {"started": False}

        async def rewriting_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                state["started"] = True
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                if message["status"] >= 400 and b"json" not in headers.get(b"content-type", b""):
                    held.update(status=message["status"], body=b"")
                    return
            elif kind == "http.response.body" and held:
                held["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    await self._send_error(send, held["status"], held["body"])
                return
            await send(message)

        try:
            await self.app(scope, receive, rewriting_send)
        except Exception:
            if state["started"]:
                raise
            await self._send_error(send, 500, b"")
            return
        if not state["started"]:
            await self._send_error(send, 500, b"")

    @staticmethod
    async def _send_error(send: Send, status: int, detail: bytes) -> None:
        err, body = _openai_error(status, detail)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if err.status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
