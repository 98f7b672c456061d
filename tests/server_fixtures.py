"""Harness for the server tests: the tiny engine loaded once, real uvicorn servers on loopback, real clients.

Each server runs uvicorn in its own thread and event loop, exactly as in production; tests talk to it over
TCP with `websockets` and `httpx`, so every byte crosses a real socket.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect

from qwen3tts_agent import Engine
from qwen3tts_agent.server import ServerConfig, create_app
from qwen3tts_agent.server.connections import uvicorn_config

ENGINE_SPEC = "synthetic:tiny"
API_KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

_engines: dict[str, Engine] = {}


def shared_engine(pytestconfig: pytest.Config, spec: str = ENGINE_SPEC) -> Engine:
    """One engine per spec for the whole run, closed at exit (several test modules share it)."""
    if spec not in _engines:
        engine = Engine.load(spec, device="cpu", progress=False)
        engine.warmup()
        _engines[spec] = engine

        def close() -> None:
            _engines.pop(spec, None)
            engine.close()

        pytestconfig.add_cleanup(close)
    return _engines[spec]


@pytest.fixture(scope="session")
def server_engine(pytestconfig: pytest.Config) -> Engine:
    return shared_engine(pytestconfig)


def make_config(voices_dir: Path, **overrides: Any) -> ServerConfig:
    """Test defaults: auth on, a private voices folder, limits small enough to hit cheaply."""
    values: dict[str, Any] = dict(
        api_key=API_KEY,
        model_name=ENGINE_SPEC,
        voices_dir=voices_dir,
        max_frames=400,
        max_text_chars=500,
        max_message_bytes=8 * 1024,
        idle_timeout_s=30.0,
        warmup=False,  # the shared engine is warmed up once
    )
    values.update(overrides)
    return ServerConfig(**values)


class RunningServer:
    """uvicorn serving one app on a free loopback port, in a background thread.

    `loop`: uvicorn's event loop; `serve` runs on "auto", i.e. uvloop where it is installed, whose order of
    I/O callbacks and ready tasks differs from asyncio's (issue 42's leak showed only there).
    """

    def __init__(self, config: ServerConfig, *, loop: str = "asyncio", **app_kwargs: Any) -> None:
        self.app = create_app(config, **app_kwargs)
        self.state = self.app.state.server
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn_config(self.app, config, host="127.0.0.1", port=self.port, log_level="warning", loop=loop)
        )
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def start(self, *, wait_ready: bool = True) -> None:
        self._thread.start()
        wait_for(lambda: self._server.started, 15, "server start")
        if wait_ready:
            wait_for(lambda: self.state.ready or self.state.failure is not None, 60, "server ready")
            assert self.state.failure is None, self.state.failure

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(20)
        assert not self._thread.is_alive(), "server did not shut down"


@contextmanager
def running_server(
    config: ServerConfig, *, wait_ready: bool = True, loop: str = "asyncio", **app_kwargs: Any
) -> Iterator[RunningServer]:
    server = RunningServer(config, loop=loop, **app_kwargs)
    server.start(wait_ready=wait_ready)
    try:
        yield server
    finally:
        server.stop()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `condition`; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - started


async def async_wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll without blocking the test's loop; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def reference_wav(seconds: float = 2.0, sample_rate: int = 24000, pitch: float = 130.0) -> bytes:
    """A voiced synthetic recording (harmonics with vibrato and a syllable envelope) as WAV bytes."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = pitch + 15 * np.sin(2 * np.pi * 0.8 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 9)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2)
    buf = io.BytesIO()
    sf.write(buf, (0.3 * wave / np.abs(wave).max()).astype(np.float32), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


# ---------------------------------------------------------------------- WebSocket client helpers
def ws_connect(server: RunningServer, token: str | None = API_KEY, **kwargs: Any) -> connect:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return connect(server.ws_url, additional_headers=headers, proxy=None, open_timeout=10, **kwargs)


async def recv_json(ws: ClientConnection, timeout: float = 15.0) -> dict[str, Any]:
    message = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(message, str), f"expected a JSON text message, got {len(message)} bytes"
    return json.loads(message)


async def send_json(ws: ClientConnection, body: dict[str, Any]) -> None:
    await ws.send(json.dumps(body))


async def start_session(ws: ClientConnection, **start: Any) -> dict[str, Any]:
    await send_json(ws, {"type": "start", **start})
    ready = await recv_json(ws)
    assert ready["type"] == "ready", ready
    return ready


@dataclass
class Heard:
    """What a client received for one utterance."""

    headers: list[dict[str, Any]] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None


async def listen(ws: ClientConnection, utterances: int, timeout: float = 30.0) -> dict[int, Heard]:
    """Read until `utterances` done messages; checks every audio header is followed by its binary frame."""
    heard: dict[int, Heard] = {}
    finished = 0
    while finished < utterances:
        msg = await recv_json(ws, timeout)
        if msg["type"] == "audio":
            payload = await asyncio.wait_for(ws.recv(), timeout)
            assert isinstance(payload, bytes), "an audio header must be followed by a binary frame"
            entry = heard.setdefault(msg["utterance_id"], Heard())
            assert entry.done is None, "audio after the utterance's done message"
            entry.headers.append(msg)
            entry.audio += payload
        elif msg["type"] == "done":
            entry = heard.setdefault(msg["utterance_id"], Heard())
            assert entry.done is None, "two done messages for one utterance"
            entry.done = msg
            finished += 1
        elif msg["type"] == "error" and "utterance_id" in msg:
            heard.setdefault(msg["utterance_id"], Heard()).errors.append(msg)
        else:
            raise AssertionError(f"unexpected message {msg}")
    return heard


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
