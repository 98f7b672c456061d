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
from prometheus_client.parser import text_string_to_metric_families

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


async def _session(port: int, frames: int) -> websockets.ClientConnection:
    """A session started (its worker answered `ready`) with nothing said yet."""
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/stream")
    await ws.send(json.dumps({"type": "start", "sampling": {"max_frames": frames, "ignore_eos": True}}))
    assert json.loads(await ws.recv())["type"] == "ready"
    return ws


async def _speak(ws: websockets.ClientConnection) -> None:
    await ws.send(json.dumps({"type": "text", "text": "The engine will go away under this utterance."}))
    await ws.send(json.dumps({"type": "flush"}))


async def _utterance(port: int, frames: int) -> websockets.ClientConnection:
    ws = await _session(port, frames)
    await _speak(ws)
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


def _serve(*extra: str, attempts: int = 3) -> subprocess.Popen[bytes]:
    """A `serve` listening on a port of its own. The port is free when chosen but may be taken before the server
    binds it (the other test worker's clients draw outgoing ports from the same range): a server that exits before
    it listens is started again on another port, up to `attempts` times."""
    for _ in range(attempts):
        port = _free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "qwen3tts_agent.cli", "serve", "--model", "synthetic:tiny", "--backend", "torch",
             "--port", str(port), "--max-streams", "4", "--log-level", "warning",
             *([] if "--workers" in extra else ["--workers", "1"]), *extra],  # one worker: `_core_process` finds the core
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        process.port = port  # type: ignore[attr-defined]
        deadline = time.monotonic() + STARTUP_S
        while process.poll() is None and time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return process
            time.sleep(0.1)
        if process.poll() is None:
            return process  # not listening yet: the test's own wait reports it
    raise AssertionError(f"serve exited before listening, {attempts} times (exit code {process.returncode})")


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
            ws = await _session(port, frames=60)
            pid = _worker_of(process, ws.local_address[1]).pid
            if pid in workers:  # a worker takes no connection before it is ready
                await ws.close()
                await asyncio.sleep(0.1)
            else:
                workers[pid] = ws
        (doomed_pid, doomed), (_, survivor) = workers.items()
        # both speak only now, and the doomed worker dies as its first audio arrives: a stream spoken while the
        # search above waited for the second worker could end (`done` in the socket's buffer) before the kill
        for ws in (survivor, doomed):
            await _speak(ws)
        for ws in (survivor, doomed):
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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_a_signal_to_the_whole_group_stops_serve_in_order(sig: signal.Signals, tmp_path: Path) -> None:
    """Ctrl-C in a terminal, and systemd's stop (its default KillMode), signal every process of `serve` at once,
    the engine core included. The core then keeps serving until the API workers have ended their sessions and the
    supervisor stops it: a client mid-stream gets a clean close, not an engine error, and nothing logs an error
    (before, the core left first and every API worker logged "the engine core is gone")."""
    log = tmp_path / "serve.log"
    port = _free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "qwen3tts_agent.cli", "serve", "--model", "synthetic:tiny", "--backend", "torch",
             "--port", str(port), "--max-streams", "4", "--log-level", "info", "--workers", "2"],
            start_new_session=True, stdout=sink, stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(port, 200, STARTUP_S)
        ws = await _utterance(port, frames=2000)
        first = await asyncio.wait_for(ws.recv(), 60)
        assert isinstance(first, str) and json.loads(first)["type"] == "audio"
        core = _core_process(process)
        os.killpg(process.pid, sig)
        messages: list[dict[str, object]] = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                message = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(message, str):
                    messages.append(json.loads(message))
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012, closed.value  # going away, in order
        assert not [m for m in messages if m["type"] == "error"], messages
        assert await asyncio.to_thread(process.wait, 60) == 0
        core.wait(30)
    finally:
        _stop(process)
    text = log.read_text(errors="replace")
    assert "engine core is gone" not in text and " ERROR " not in text and "Traceback" not in text, text[-3000:]


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


# ---------------------------------------------------------------------- two API workers: one server's view
def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    """One sample of an exposition, or the sum of every sample of `name` that has `labels` (0 when none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _api_workers(server: subprocess.Popen[bytes]) -> set[int]:
    """The pids of the supervisor's API workers: its children listening on the server's port."""
    port = server.port  # type: ignore[attr-defined]
    workers = set()
    for child in psutil.Process(server.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):  # a dead worker that uvicorn reaps meanwhile
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp")):
                workers.add(child.pid)
    return workers


async def _session(port: int, frames: int = 3) -> websockets.ClientConnection:
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/stream")
    await ws.send(json.dumps({"type": "start", "sampling": {"max_frames": frames, "ignore_eos": True}}))
    assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "ready"
    return ws


async def _until_sessions(port: int, count: int) -> None:
    """Until /metrics (whichever worker answers) counts `count` sessions open."""
    deadline = time.monotonic() + 10
    while _sample(_scrape(port), "qwen3tts_active_sessions") != count:
        assert time.monotonic() < deadline, f"/metrics never counted {count} sessions"
        await asyncio.sleep(0.05)


async def _sessions_on_both_workers(
    server: subprocess.Popen[bytes], count: int, frames: int = 3
) -> list[tuple[websockets.ClientConnection, int]]:
    """`count` sessions open, each with the pid of the worker holding it, both workers holding at least one."""
    port = server.port  # type: ignore[attr-defined]
    held: list[tuple[websockets.ClientConnection, int]] = []
    deadline = time.monotonic() + 60
    while len(held) < count or len({pid for _, pid in held}) < 2:
        assert time.monotonic() < deadline, "one worker took every connection for a minute"
        if len(held) == count:  # all on one worker: give one back and try again
            await held.pop()[0].close()
            await _until_sessions(port, len(held))
        ws = await _session(port, frames)
        held.append((ws, _worker_of(server, ws.local_address[1]).pid))
    return held


async def _refused_busy(port: int) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(f"ws://127.0.0.1:{port}/v1/stream")
    assert refused.value.response.status_code == 503
    assert json.loads(refused.value.response.body)["error"]["code"] == "busy"


def _speech(port: int, frames: int) -> bytes:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/audio/speech", method="POST",
        data=json.dumps({"model": "qwen3-tts", "input": "Counted once, whoever scrapes.", "response_format": "pcm",
                         "sampling": {"max_frames": frames, "ignore_eos": True}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


async def test_two_workers_metrics_read_the_same_server_wide_totals_on_every_scrape() -> None:
    """Every scrape, whichever worker answers, sums both workers' series (the engine's once); a SIGKILLed
    worker's gauges drop out while its counters keep counting, and its replacement adds to them."""
    process = _serve("--workers", "2", "--send-timeout", "60", "--no-warmup")  # the engine starts no stream of its own
    port = process.port  # type: ignore[attr-defined]
    try:
        _wait_for(port, 200, STARTUP_S)
        served_by: list[int] = []
        while len(served_by) < 6 or len(set(served_by)) < 2:  # utterances over WebSocket, on both workers
            assert len(served_by) < 200, "one worker took every connection"
            ws = await _utterance(port, frames=3)
            served_by.append(_worker_of(process, ws.local_address[1]).pid)
            assert (await _audio_then(ws))[-1]["finish_reason"] == "max_frames"
            await ws.close()
        await _until_sessions(port, 0)
        http = 4
        for _ in range(http):
            assert len(_speech(port, frames=3)) == 3 * 1920 * 2
        ws_count = len(served_by)
        deadline = time.monotonic() + 10  # the core publishes its stats every 0.25 s
        while _sample(_scrape(port), "qwen3tts_engine_streams_started") != ws_count + http:
            assert time.monotonic() < deadline, "the engine's streams_started never read the streams started"
            await asyncio.sleep(0.1)
        for _ in range(20):  # the issue: each scrape read the one worker that took it
            text = _scrape(port)
            assert _sample(text, "qwen3tts_first_audio_seconds_count", endpoint="ws") == ws_count
            assert _sample(text, "qwen3tts_first_audio_seconds_count", endpoint="http") == http
            assert _sample(text, "qwen3tts_utterances_total", finish_reason="max_frames") == ws_count + http
            assert _sample(text, "qwen3tts_queue_wait_seconds_count") == ws_count + http
            assert _sample(text, "qwen3tts_engine_streams_started") == ws_count + http  # once, not per worker
            assert _sample(text, "qwen3tts_active_streams") == 0
        # the late chunks by their place in their streams come across from the core process, and add up
        late = {sample.labels["index"]: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "qwen3tts_engine_late_chunks_by_index"}
        assert set(late) == {"1", "2", "3", "4+"}
        assert sum(late.values()) == _sample(text, "qwen3tts_engine_late_chunks")
        causes = {sample.labels["cause"]: sample.value for family in text_string_to_metric_families(text)
                  for sample in family.samples if sample.name == "qwen3tts_engine_late_chunks_by_cause"}
        assert set(causes) == {"frames", "decode"} and sum(causes.values()) == sum(late.values())

        # a long utterance held on each worker, then one worker SIGKILLed
        held = await _sessions_on_both_workers(process, 2, frames=2000)
        for ws, _ in held:
            await ws.send(json.dumps({"type": "text", "text": "Long enough to outlive a worker."}))
            await ws.send(json.dumps({"type": "flush"}))
            first = await asyncio.wait_for(ws.recv(), 60)
            assert isinstance(first, str) and json.loads(first)["type"] == "audio"
        for _ in range(5):
            text = _scrape(port)
            assert _sample(text, "qwen3tts_active_streams", endpoint="ws") == 2
            assert _sample(text, "qwen3tts_active_sessions") == 2
        (_, doomed), (survivor, _) = held
        workers = _api_workers(process)
        killed = psutil.Process(doomed)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        for _ in range(5):  # at once: the scrape finds the dead worker's cell unheld
            text = _scrape(port)
            assert _sample(text, "qwen3tts_active_streams", endpoint="ws") == 1
            assert _sample(text, "qwen3tts_active_sessions") == 1
            assert _sample(text, "qwen3tts_utterances_total", finish_reason="max_frames") == ws_count + http
        await survivor.close()
        deadline = time.monotonic() + 60
        while len(_api_workers(process) - workers) < 1:  # uvicorn's replacement
            assert time.monotonic() < deadline, "uvicorn did not replace the killed worker"
            await asyncio.sleep(0.1)
        await _until_sessions(port, 0)
        done = await _sessions_on_both_workers(process, 2)
        assert {pid for _, pid in done} == _api_workers(process)  # the survivor and the replacement
        for ws, _ in done:
            await ws.send(json.dumps({"type": "text", "text": "After the restart."}))
            await ws.send(json.dumps({"type": "flush"}))
        for ws, _ in done:
            await _audio_then(ws)
            await ws.close()
        await _until_sessions(port, 0)
        # the survivor's long utterance ended cancelled (its client left); every other finished one counts
        for _ in range(10):
            text = _scrape(port)
            assert _sample(text, "qwen3tts_utterances_total", endpoint="ws") == ws_count + 1 + 2
            assert _sample(text, "qwen3tts_first_audio_seconds_count") == ws_count + http + 2
            assert _sample(text, "qwen3tts_active_streams") == 0
    finally:
        _stop(process)


async def test_max_sessions_holds_over_both_workers_and_a_killed_workers_sessions_are_released() -> None:
    """`--max-sessions 3` with 2 workers: 3 sessions in all, a 4th refused whichever worker takes it; the
    sessions of a SIGKILLed worker stop counting, and the limit holds over its replacement too."""
    process = _serve("--workers", "2", "--max-sessions", "3")
    port = process.port  # type: ignore[attr-defined]
    try:
        _wait_for(port, 200, STARTUP_S)
        workers = _api_workers(process)
        held = await _sessions_on_both_workers(process, 3)
        for _ in range(10):  # a per-worker limit would let each worker take 3
            await _refused_busy(port)
        assert _sample(_scrape(port), "qwen3tts_active_sessions") == 3
        pids = [pid for _, pid in held]
        doomed = max(set(pids), key=pids.count)  # the worker holding two of the three
        psutil.Process(doomed).send_signal(signal.SIGKILL)
        await _until_sessions(port, 1)
        survivors = [ws for ws, pid in held if pid != doomed]
        late = [await _session(port), await _session(port)]  # the dead worker's two, free again
        await _refused_busy(port)
        for ws in [*survivors, *late]:
            await ws.close()
        await _until_sessions(port, 0)
        deadline = time.monotonic() + 60
        while len(_api_workers(process) - workers) < 1:  # uvicorn's replacement
            assert time.monotonic() < deadline, "uvicorn did not replace the killed worker"
            await asyncio.sleep(0.1)
        again = await _sessions_on_both_workers(process, 3)  # the replacement takes sessions, within the limit
        assert {pid for _, pid in again} == _api_workers(process)
        for _ in range(10):
            await _refused_busy(port)
        for ws, _ in again:
            await ws.close()
        await _until_sessions(port, 0)
    finally:
        _stop(process)


async def _session_on(server: subprocess.Popen[bytes], pid: int, frames: int) -> websockets.ClientConnection:
    """A session held by the worker `pid` (others that the port hands elsewhere are closed)."""
    port = server.port  # type: ignore[attr-defined]
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"worker {pid} took no connection for a minute"
        ws = await _session(port, frames)
        if _worker_of(server, ws.local_address[1]).pid == pid:
            return ws
        await ws.close()


async def _say(ws: websockets.ClientConnection, text: str) -> None:
    await ws.send(json.dumps({"type": "text", "text": text}))
    await ws.send(json.dumps({"type": "flush"}))


async def test_max_queued_holds_over_both_workers() -> None:
    """`--max-queued 1` with 2 workers of one slot each: one utterance waits in one worker, and the other
    worker refuses its next one at once instead of queuing a second."""
    process = _serve("--workers", "2", "--max-active-streams", "1", "--max-queued", "1", "--queue-timeout", "60",
                     "--send-timeout", "60")
    port = process.port  # type: ignore[attr-defined]
    try:
        _wait_for(port, 200, STARTUP_S)
        playing = await _sessions_on_both_workers(process, 2, frames=2000)
        for ws, _ in playing:  # each worker's one slot taken
            await _say(ws, "Long enough to keep the slot.")
            first = await asyncio.wait_for(ws.recv(), 60)
            assert isinstance(first, str) and json.loads(first)["type"] == "audio"
        (_, first_worker), (_, second_worker) = playing
        waiting = await _session_on(process, first_worker, frames=3)
        await _say(waiting, "I wait for the slot.")
        deadline = time.monotonic() + 10
        while _sample(_scrape(port), "qwen3tts_queued_requests") != 1:
            assert time.monotonic() < deadline, "the utterance never queued"
            await asyncio.sleep(0.05)
        refused = await _session_on(process, second_worker, frames=3)
        await _say(refused, "No room in the queue for me.")
        error = json.loads(await asyncio.wait_for(refused.recv(), 10))
        assert error["type"] == "error" and error["code"] == "busy", error
        assert json.loads(await asyncio.wait_for(refused.recv(), 10))["finish_reason"] == "error"
        for _ in range(5):
            assert _sample(_scrape(port), "qwen3tts_queued_requests") == 1
        for ws in (refused, waiting, *(ws for ws, _ in playing)):
            await ws.close()
        await _until_sessions(port, 0)
        assert _sample(_scrape(port), "qwen3tts_queued_requests") == 0
    finally:
        _stop(process)
