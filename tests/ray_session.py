"""A WebSocket session against a Serve deployment of this package, and the replica that took it, and a client that
sends half a request head: shared by the Ray test modules (through Serve's proxy, and on the replicas' own ports
under direct ingress)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from qwen3tts_agent.ray.replica import REPLICA_HEADER


class Session:
    """One WebSocket session and the replica that took it (its handshake's header)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.replica = ws.response.headers[REPLICA_HEADER]

    @classmethod
    async def open(cls, url: str, headers: dict[str, str], **sampling: Any) -> Session:
        """Open a session at `url` (ws://host:port, or host:port) and start it with these sampling options."""
        base = url if "://" in url else f"ws://{url}"
        ws = await connect(f"{base}/v1/stream", additional_headers=headers, max_size=None)
        await ws.send(json.dumps({"type": "start", "sampling": {"ignore_eos": True, "seed": 7, **sampling}}))
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready", ready
        return cls(ws)

    async def say(self, text: str, *, flush: bool = True) -> None:
        await self.ws.send(json.dumps({"type": "text", "text": text}))
        if flush:
            await self.ws.send(json.dumps({"type": "flush"}))

    async def until(self, kind: str, timeout: float = 60.0) -> tuple[dict[str, Any], int]:
        """Messages up to the first of `kind`: (that message, PCM bytes received before it)."""
        pcm = 0
        deadline = time.monotonic() + timeout
        while True:
            message = await asyncio.wait_for(self.ws.recv(), max(0.0, deadline - time.monotonic()))
            if isinstance(message, bytes):
                pcm += len(message)
                continue
            body = json.loads(message)
            if body["type"] == kind:
                return body, pcm
            assert body["type"] == "audio", body

    async def close(self) -> None:
        await self.ws.close()


def answer_to_half_a_head(host: str, port: int, timeout: float) -> tuple[bytes, float]:
    """Send half a request head and fall silent: what the server answered before it closed, and after how many
    seconds (at most `timeout`)."""
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(timeout)
        started, answer = time.monotonic(), b""
        while chunk := sock.recv(4096):
            answer += chunk
        return answer, time.monotonic() - started
