"""The connections of Serve's own servers: uncompressed WebSocket frames, and on a replica's port `serve`'s bounds.

Ray Serve 2.60 runs uvicorn for each replica's direct-ingress port (`ray/serve/_private/replica.py`,
`_maybe_start_direct_ingress_servers`) and for each proxy, both through `http_util.start_asgi_http_server`, with
uvicorn's defaults and no way to change them: `ws="auto"` (websockets-sansio) and `ws_per_message_deflate=True`.
Browsers and the `websockets` library offer permessage-deflate, so every audio message was zlib-compressed there,
although `serve` declines the extension (`server/connections.py`: PCM barely compresses, and zlib weighs on an
event loop under load; docs/server.md).

In a replica it costs far more than the CPU: Serve runs the app on an event loop of its own thread
(`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD`, on by default) while uvicorn's WebSocket protocol, and with it the
compression, runs on the replica's main loop. Every message goes from one thread to the other
(`call_soon_threadsafe`), and zlib lets go of the GIL for each compress and flush call, so under load the main loop
keeps waiting to take the GIL back from the app's busy thread (up to the interpreter's switch interval, 5 ms, each
time): the first audio of a session came late, while HTTP streaming from the same replica (no zlib) did not
(benchmarks/results/2026-12-05-cpu-ray-ws-deflate). `decline_websocket_compression` makes uvicorn's "auto" WebSocket protocol of the calling process the same
websockets-sansio protocol with the extension declined; clients lose nothing (they accept an answer without it).

A replica's own port (direct ingress) faces clients as `serve`'s port does, so `bound_replica_connections` gives
it `serve`'s connection protocols as well (`server/connections.py`): a deadline for each request head and for
unread responses, closes that never wait on a client that does not read, bounded send buffers, and WebSocket
frames refused over twice `--max-message-bytes`, all with the replica's own limits. (Stock uvicorn keeps a
connection that sends half a request head, or stops reading, for good.) The proxies only decline compression:
they serve Serve's routing, and their process knows no server settings.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import uvicorn
from uvicorn import config as uvicorn_config
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from ..server.config import ServerConfig
from ..server.connections import (
    BoundedHttpProtocol,
    BoundedWebSocketProtocol,
    ConnectionLimits,
    connection_limits,
    websocket_frame_limit,
)

AUTO = "auto"  # the `http` and `ws` protocols of Serve's uvicorn servers (it passes neither)


class UncompressedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol (what `ws="auto"` picks) that never accepts permessage-deflate."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        if config.ws_per_message_deflate:
            config = copy.copy(config)  # this connection's view only: the server's own config stays as Serve set it
            config.ws_per_message_deflate = False
        super().__init__(config, *args, **kwargs)


def decline_websocket_compression() -> None:
    """Make uvicorn's `ws="auto"` in this process `UncompressedWebSocketProtocol`.

    uvicorn resolves the name when a server loads its config (`uvicorn.config.WS_PROTOCOLS`), so call this in the
    process before Serve starts a server there: the replica's constructor (Serve starts the direct-ingress server
    after it) and the proxy's middleware callback (called before the proxy's server starts). Idempotent.
    """
    uvicorn_config.WS_PROTOCOLS[AUTO] = f"{__name__}:{UncompressedWebSocketProtocol.__name__}"


class ReplicaConnections:
    """The limits a replica's own port applies, set once in its process by `bound_replica_connections`."""

    limits: ClassVar[ConnectionLimits | None] = None
    websocket_frame_limit: ClassVar[int] = 0

    @classmethod
    def installed(cls) -> ConnectionLimits:
        if cls.limits is None:
            raise RuntimeError("bound_replica_connections was not called in this process")
        return cls.limits


class ReplicaHttpProtocol(BoundedHttpProtocol):
    """`serve`'s HTTP protocol with the replica's limits (uvicorn builds protocols from the class alone)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, limits=ReplicaConnections.installed(), **kwargs)


class ReplicaWebSocketProtocol(BoundedWebSocketProtocol):
    """`serve`'s WebSocket protocol with the replica's limits: no permessage-deflate, frames bounded."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        config = copy.copy(config)  # this connection's view only: the server's own config stays as Serve set it
        config.ws_per_message_deflate = False
        config.ws_max_size = ReplicaConnections.websocket_frame_limit
        super().__init__(config, *args, limits=ReplicaConnections.installed(), **kwargs)


def bound_replica_connections(server: ServerConfig) -> None:
    """Make uvicorn's `http="auto"` and `ws="auto"` in this process `serve`'s bounded protocols with `server`'s
    limits. Call it in the replica's constructor: Serve starts the replica's direct-ingress server after it."""
    ReplicaConnections.limits = connection_limits(server)
    ReplicaConnections.websocket_frame_limit = websocket_frame_limit(server)
    uvicorn_config.HTTP_PROTOCOLS[AUTO] = f"{__name__}:{ReplicaHttpProtocol.__name__}"
    uvicorn_config.WS_PROTOCOLS[AUTO] = f"{__name__}:{ReplicaWebSocketProtocol.__name__}"
