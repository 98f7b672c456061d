"""`qwen3tts-agent serve` as deployed: the engine core in a process of its own, killed while a client listens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest
import websockets

STARTUP_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _wait_for(port: int, status: int, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if _ready(port) == status:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"/ready never answered {status} within {timeout} s")


def _core_process(server: subprocess.Popen[bytes]) -> psutil.Process:
    """The engine-core process: the server's spawned child that is not multiprocessing's resource tracker."""
    for child in psutil.Process(server.pid).children(recursive=True):
        cmdline = " ".join(child.cmdline())
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            return child
    raise AssertionError("no engine-core process found")


async def _utterance(port: int, frames: int) -> websockets.ClientConnection:
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/stream")
    await ws.send(json.dumps({"type": "start", "sampling": {"max_frames": frames, "ignore_eos": True}}))
    assert json.loads(await ws.recv())["type"] == "ready"
    await ws.send(json.dumps({"type": "text", "text": "The engine will go away under this utterance."}))
    await ws.send(json.dumps({"type": "flush"}))
    return ws


async def _audio_then(ws: websockets.ClientConnection) -> list[dict[str, object]]:
    """Wait for the first audio, then collect JSON messages until `done`."""
    messages = []
    while True:
        message = await asyncio.wait_for(ws.recv(), 30)
        if isinstance(message, bytes):
            continue
        body = json.loads(message)
        messages.append(body)
        if body["type"] == "done":
            return messages


@pytest.fixture()
def server() -> subprocess.Popen[bytes]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "qwen3tts_agent.cli", "serve", "--model", "synthetic:tiny", "--backend", "torch",
         "--port", str(port), "--max-streams", "4", "--log-level", "warning"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    process.port = port  # type: ignore[attr-defined]
    try:
        _wait_for(port, 200, STARTUP_S)
        yield process
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


async def test_a_killed_core_fails_its_streams_at_once_and_serve_comes_back(server: subprocess.Popen[bytes]) -> None:
    port = server.port  # type: ignore[attr-defined]
    ws = await _utterance(port, frames=2000)
    first = await asyncio.wait_for(ws.recv(), 60)
    assert isinstance(first, str) and json.loads(first)["type"] == "audio"
    core = _core_process(server)
    core.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    messages = await _audio_then(ws)
    ended = time.monotonic() - killed
    errors = [m for m in messages if m["type"] == "error"]
    assert errors and errors[0]["code"] == "engine_error" and messages[-1]["finish_reason"] == "error"
    assert ended < 5.0, f"the stream took {ended:.1f} s to end after the core died"
    assert _ready(port) == 503  # at once: the restart takes at least the back-off
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/audio/speech", method="POST",
        data=json.dumps({"model": "qwen3-tts", "input": "Too soon."}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 503 and json.loads(refused.value.read())["error"]["code"] == "not_ready"
    await ws.close()
    _wait_for(port, 200, STARTUP_S)  # the supervisor's fresh core
    assert _core_process(server).pid != core.pid
    again = await _utterance(port, frames=3)
    done = (await _audio_then(again))[-1]
    assert done["finish_reason"] == "max_frames" and done["metrics"]["frames"] == 3
    await again.close()
