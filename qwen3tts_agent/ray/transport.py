"""The connections of Serve's own servers (replicas' ports, proxies): `serve`'s protocols, with its bounds.

Ray Serve 2.60 runs uvicorn for each replica's direct-ingress port (`ray/serve/_private/replica.py`,
`_maybe_start_direct_ingress_servers`) and for each proxy, both through `http_util.start_asgi_http_server`, with
uvicorn's defaults and no way to change them: `http="auto"` and `ws="auto"` (httptools, websockets-sansio), with
`ws_per_message_deflate=True` and no deadline for a request head or an unread response. Both kinds of port face
clients as `serve`'s does, so `bound_connections` makes uvicorn's "auto" protocols of the calling process
`serve`'s (`server/connections.py`), with a server's limits:

- No permessage-deflate. Browsers and the `websockets` library offer it, so every audio message was
  zlib-compressed, although `serve` declines the extension (PCM barely compresses, and zlib weighs on an event
  loop under load; docs/server.md). In a replica it cost far more than the CPU: Serve runs the app on an event
  loop of its own thread (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD`, on by default) while uvicorn's WebSocket
  protocol, and with it the compression, runs on the replica's main loop. Every message goes from one thread to
  the other (`call_soon_threadsafe`), and zlib lets go of the GIL for each compress and flush call, so under load
  the main loop kept waiting to take the GIL back from the app's busy thread (up to the interpreter's switch
  interval, 5 ms, each time): the first audio of a session came late, while HTTP streaming from the same replica
  (no zlib) did not (benchmarks/results/2026-12-05-cpu-ray-ws-deflate). Clients lose nothing (they accept an
  answer without it).
- A deadline for each request head and for unread responses, closes that never wait on a client that does not
  read, bounded send buffers, and WebSocket frames refused over twice `--max-message-bytes`. Stock uvicorn keeps
  a connection that sends half a request head, or stops reading, for good.

A replica calls it in its constructor with its own limits. A proxy's process knows no server settings: it calls
`bound_proxy_connections` from its middleware callback, with the limits `serve-ray` put in its environment
(`proxy_limits_environment`; a cluster of `ray start` that was not given them: `ServerConfig`'s defaults).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
from typing import Any, ClassVar

import uvicorn
from uvicorn import config as uvicorn_config

from ..server.config import ServerConfig
from ..server.connections import (
    BoundedHttpProtocol,
    BoundedWebSocketProtocol,
    ConnectionLimits,
    connection_limits,
    websocket_frame_limit,
)

logger = logging.getLogger(__name__)

AUTO = "auto"  # the `http` and `ws` protocols of Serve's uvicorn servers (it passes neither)
# The variable that carries `serve-ray`'s connection limits to the proxies its Ray cluster starts (JSON of the
# `ServerConfig` fields below).
PROXY_LIMITS_ENV = "QWEN3TTS_PROXY_LIMITS"
_PROXY_LIMIT_FIELDS = ("max_message_bytes", "send_timeout_s", "send_buffer_bytes", "http_read_timeout_s")


class ProcessConnections:
    """The limits this process's Serve server applies, set once by `bound_connections`."""

    limits: ClassVar[ConnectionLimits | None] = None
    websocket_frame_limit: ClassVar[int] = 0

    @classmethod
    def installed(cls) -> ConnectionLimits:
        if cls.limits is None:
            raise RuntimeError("bound_connections was not called in this process")
        return cls.limits


class LimitedHttpProtocol(BoundedHttpProtocol):
    """`serve`'s HTTP protocol with this process's limits (uvicorn builds protocols from the class alone)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, limits=ProcessConnections.installed(), **kwargs)


class LimitedWebSocketProtocol(BoundedWebSocketProtocol):
    """`serve`'s WebSocket protocol with this process's limits: no permessage-deflate, frames bounded."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        config = copy.copy(config)  # this connection's view only: the server's own config stays as Serve set it
        config.ws_per_message_deflate = False
        config.ws_max_size = ProcessConnections.websocket_frame_limit
        super().__init__(config, *args, limits=ProcessConnections.installed(), **kwargs)


class ProxyWebSocketProtocol(LimitedWebSocketProtocol):
    """A proxy's WebSocket protocol, which also gives up on a client that leaves its audio unread.

    On a replica's port (as in `serve`) the app times its own sends out, and says why (`send_timeout`, close
    4010). Serve's proxy app instead waits for good on a client that stopped reading, and so does the replica's
    session behind it, holding its engine slot: here a connection whose writes stay paused (its buffers full)
    for `send_timeout_s` is aborted, which the proxy passes on to the replica as the client's disconnect."""

    _unread_deadline: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread_deadline is None:
            self._unread_deadline = self.loop.call_later(self.limits.send_timeout_s, self._client_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_unread_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_unread_deadline()
        super().connection_lost(exc)

    def _stop_unread_deadline(self) -> None:
        if self._unread_deadline is not None:
            self._unread_deadline.cancel()
            self._unread_deadline = None

    def _client_stalled(self) -> None:
        self._unread_deadline = None
        logger.warning("closing a WebSocket whose client read nothing for %gs", self.limits.send_timeout_s)
        self.transport.abort()


def bound_connections(server: ServerConfig) -> None:
    """Make uvicorn's `http="auto"` and `ws="auto"` in this process `serve`'s bounded protocols with `server`'s
    limits. uvicorn resolves the names when a server loads its config, so call it before Serve starts one here:
    in a replica's constructor (Serve starts its direct-ingress server after it), in a proxy's middleware
    callback (called before the proxy starts its server). Idempotent."""
    ProcessConnections.limits = connection_limits(server)
    ProcessConnections.websocket_frame_limit = websocket_frame_limit(server)
    uvicorn_config.HTTP_PROTOCOLS[AUTO] = f"{__name__}:{LimitedHttpProtocol.__name__}"
    uvicorn_config.WS_PROTOCOLS[AUTO] = f"{__name__}:{LimitedWebSocketProtocol.__name__}"


def proxy_limits_environment(server: ServerConfig) -> dict[str, str]:
    """What to set in the environment of the Ray cluster `serve-ray` starts, so that its proxies bound their
    connections with `server`'s limits (`bound_proxy_connections`)."""
    return {PROXY_LIMITS_ENV: json.dumps({name: getattr(server, name) for name in _PROXY_LIMIT_FIELDS})}


def bound_proxy_connections() -> None:
    """`bound_connections` in a proxy, with the limits of `PROXY_LIMITS_ENV` (unset: `ServerConfig`'s defaults;
    malformed: a ValueError that names the variable, so the proxy fails to start rather than serve unbounded),
    and WebSockets that give up on a client that stops reading (`ProxyWebSocketProtocol`)."""
    text = os.environ.get(PROXY_LIMITS_ENV)
    try:
        values = json.loads(text) if text else {}
        if not isinstance(values, dict) or set(values) - set(_PROXY_LIMIT_FIELDS):
            raise ValueError(f"a JSON object of {list(_PROXY_LIMIT_FIELDS)}")
        server = ServerConfig(**values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{PROXY_LIMITS_ENV}={text!r}: {e}") from None
    bound_connections(server)
    uvicorn_config.WS_PROTOCOLS[AUTO] = f"{__name__}:{ProxyWebSocketProtocol.__name__}"
