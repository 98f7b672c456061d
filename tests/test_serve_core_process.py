"""`qwen3tts-agent serve` as deployed: the engine core in a process of its own, killed while a client listens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

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


def _serve(*extra: str) -> subprocess.Popen[bytes]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "qwen3tts_agent.cli", "serve", "--model", "synthetic:tiny", "--backend", "torch",
         "--port", str(port), "--max-streams", "4", "--log-level", "warning",
         *([] if "--workers" in extra else ["--workers", "1"]), *extra],  # one worker: `_core_process` finds the core
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    process.port = port  # type: ignore[attr-defined]
    return process


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group may be gone already
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture()
def server() -> subprocess.Popen[bytes]:
    process = _serve()
    try:
        _wait_for(process.port, 200, STARTUP_S)  # type: ignore[attr-defined]
        yield process
    finally:
        _stop(process)


def _worker_of(server: subprocess.Popen[bytes], client_port: int) -> psutil.Process:
    """The API worker holding the server side of the client's connection from `client_port`."""
    for child in psutil.Process(server.pid).children(recursive=True):
        for conn in child.net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == client_port:
                return child
    raise AssertionError(f"no worker holds the connection from port {client_port}")


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


async def test_a_killed_api_worker_loses_no_other_workers_streams() -> None:
    process = _serve("--workers", "2", "--max-streams", "8")  # room for the sessions the loop opens and closes
    port = process.port  # type: ignore[attr-defined]
    try:
        _wait_for(port, 200, STARTUP_S)  # one worker is ready: the other may still be loading
        workers: dict[int, websockets.ClientConnection] = {}
        deadline = time.monotonic() + 60
        while len(workers) < 2:  # until the two workers each hold one of our sessions
            assert time.monotonic() < deadline, "one worker took every connection for a minute"
            ws = await _utterance(port, frames=60)
            pid = _worker_of(process, ws.local_address[1]).pid
            if pid in workers:  # a worker takes no connection before it is ready
                await ws.close()
                await asyncio.sleep(0.1)
            else:
                workers[pid] = ws
        (doomed_pid, doomed), (_, survivor) = workers.items()
        for ws in workers.values():
            first = await asyncio.wait_for(ws.recv(), 60)
            assert isinstance(first, str) and json.loads(first)["type"] == "audio"
        psutil.Process(doomed_pid).send_signal(signal.SIGKILL)
        done = (await _audio_then(survivor))[-1]  # the other worker's stream plays to its end
        assert done["finish_reason"] == "max_frames" and done["metrics"]["frames"] == 60
        with pytest.raises(websockets.ConnectionClosed):
            await _audio_then(doomed)
        _wait_for(port, 200, 60)  # uvicorn replaced the worker; the port still serves
        again = await _utterance(port, frames=3)
        assert (await _audio_then(again))[-1]["finish_reason"] == "max_frames"
        await again.close()
    finally:
        _stop(process)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_exits_with_the_reason_when_its_core_cannot_start(workers: str, tmp_path) -> None:
    """A core that fails to start (here: no such model folder) ends `serve` with code 1 and the reason, not a
    hang on workers waiting for a core that never serves, nor death by the supervisor's own signal."""
    command = [sys.executable, "-m", "qwen3tts_agent.cli", "serve", "--model", str(tmp_path / "no-such-model"),
               "--port", str(_free_port()), "--workers", workers, "--log-level", "warning"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "the engine core failed to start" in result.stderr and "does not exist" in result.stderr
    assert not any(Path(tempfile.gettempdir()).glob("qwen3tts-core-*.failed")), "the failure note was left behind"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_core_never_outlives_its_supervisor(sig: signal.Signals) -> None:
    """A signal to the supervisor alone (an operator's `kill`, an OOM kill) also ends the engine core, which
    would otherwise hold the device; SIGTERM is a graceful stop (exit 0)."""
    process = _serve()
    try:
        _wait_for(process.port, 200, STARTUP_S)  # type: ignore[attr-defined]
        core = _core_process(process)
        os.kill(process.pid, sig)
        assert process.wait(60) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        core.wait(30)  # psutil.TimeoutExpired if the core lives on
    finally:
        _stop(process)


def test_only_the_core_process_loads_torch(server: subprocess.Popen[bytes]) -> None:
    """`serve`'s supervisor and its API workers only pass requests, voices and audio along: they load no
    torch (seconds at every start, hundreds of MB per worker); the engine core does."""

    def loads_torch(process: psutil.Process) -> bool:
        return any("torch" in region.path for region in process.memory_maps())

    core = _core_process(server)
    supervisor = psutil.Process(server.pid)  # with one worker, the app runs in the supervisor's process
    others = [child for child in supervisor.children(recursive=True) if child.pid != core.pid]
    assert loads_torch(core)
    assert not any(loads_torch(p) for p in (supervisor, *others))
