"""What a hostile or broken client tries against a real server: bad Unicode, deep JSON, clients that stop
reading, half-open HTTP connections, out-of-range sampling, empty utterances; each gets a clear error and
nothing else is affected."""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from qwen3tts_agent import Engine
from qwen3tts_agent.engine.frontend import engine as engine_module
from qwen3tts_agent.engine.scheduler.scheduler import REFUSAL_REASONS
from qwen3tts_agent.server import protocol
from qwen3tts_agent.server.connections import BoundedWebSocketProtocol, uvicorn_config
from qwen3tts_agent.server.protocol import ERROR_STATUS
from tests.engine_helpers import engine_for
from tests.server_fixtures import (
    API_KEY,
    AUTH,
    RunningServer,
    async_wait_for,
    listen,
    make_config,
    metric,
    recv_json,
    running_server,
    send_json,
    server_engine,  # noqa: F401  (fixture)
    start_session,
    ws_connect,
)

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"max_frames": 6, "ignore_eos": True, "seed": 3}
SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "sampling": SHORT}
LONE_SURROGATE = '{"type":"text","text":"Hello \\ud800 there"}'  # the JSON escape, as a client sends it
DEEP = "[" * 3000 + "]" * 3000  # 6 KB: far below the size limit, far beyond any sane nesting


@pytest.fixture(scope="module")
def server(server_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:  # noqa: F811
    with running_server(make_config(tmp_path_factory.mktemp("voices")), engine=server_engine) as srv:
        yield srv


async def expect_error(ws: ClientConnection, code: str) -> dict:
    msg = await recv_json(ws)
    assert msg["type"] == "error" and msg["code"] == code, msg
    assert msg["status"] == ERROR_STATUS[code]
    return msg


async def still_speaks(ws: ClientConnection, uid: int) -> None:
    await send_json(ws, {"type": "text", "text": "Still here."})
    await send_json(ws, {"type": "flush"})
    heard = (await listen(ws, 1))[uid]
    assert heard.done["finish_reason"] == "max_frames" and heard.errors == []
    assert len(heard.audio) == SHORT["max_frames"] * 1920 * 2


async def get_metrics(server: RunningServer) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{server.http_url}/metrics", headers=AUTH)).text


# ---------------------------------------------------------------------- input hygiene
async def test_lone_surrogates_are_invalid_text_and_the_session_goes_on(
    server: RunningServer, server_engine: Engine  # noqa: F811
) -> None:
    async with ws_connect(server) as ws:
        for start in ('{"type":"start","voice":"al\\udfffloy"}', '{"type":"start","instruct":"soft \\ud800"}'):
            await ws.send(start)
            assert "Unicode" in (await expect_error(ws, "invalid_text"))["message"]
        await start_session(ws, sampling=SHORT)
        await send_json(ws, {"type": "text", "text": "Good "})
        await ws.send(LONE_SURROGATE)
        error = await expect_error(ws, "invalid_text")
        assert "lone surrogate at character 6" in error["message"]
        await send_json(ws, {"type": "text", "text": "morning."})
        await send_json(ws, {"type": "flush"})
        heard = (await listen(ws, 1))[1]
        assert heard.done["finish_reason"] == "max_frames" and heard.done["metrics"]["text_chars"] == len("Good morning.")
        await still_speaks(ws, 2)
    async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH, timeout=30) as client:
        for field in ("input", "instructions", "voice"):
            body = json.dumps({**SPEECH, field: "PLACEHOLDER"}).replace("PLACEHOLDER", "Hello \\ud800 there")
            response = await client.post("/v1/audio/speech", content=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "invalid_text"
            assert response.json()["error"]["param"] == field
        assert (await client.post("/v1/audio/speech", json=SPEECH)).status_code == 200
    assert server_engine.stats().errors == 0  # nothing bad reached the engine


async def test_deep_json_is_invalid_json_on_both_transports(server: RunningServer) -> None:
    async with ws_connect(server) as ws:
        await ws.send(DEEP)
        assert "nested deeper" in (await expect_error(ws, "invalid_json"))["message"]
        await start_session(ws, sampling=SHORT)
        await ws.send('{"type":"text","text":' + DEEP.replace("[", '["x",', 40) + "}")
        await expect_error(ws, "invalid_json")
        await send_json(ws, {"type": "text", "text": "[[[[ brackets in a string are text ]]]] " * 9})
        await send_json(ws, {"type": "flush"})
        assert (await listen(ws, 1))[1].done["finish_reason"] == "max_frames"
    async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH, timeout=30) as client:
        for path in ("/v1/audio/speech", "/v1/voices"):
            response = await client.post(path, content=DEEP)
            assert response.status_code == 400 and response.headers["content-type"] == "application/json"
            assert response.json()["error"]["code"] == "invalid_json"


async def test_no_route_answers_outside_the_openai_error_shape(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.state.voices, "records", broken)  # fault injection: an unexpected exception
    async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH, timeout=30) as client:
        for method, path, status, code in (
            ("GET", "/v1/voices", 500, "internal_error"),
            ("GET", "/v1/nowhere", 404, "not_found"),
            ("PUT", "/v1/audio/speech", 405, "method_not_allowed"),
        ):
            response = await client.request(method, path)
            assert response.status_code == status, response.text
            assert response.headers["content-type"] == "application/json"
            error = response.json()["error"]
            assert error["code"] == code and ERROR_STATUS[code] == status and error["message"]


async def test_sampling_bounds_are_checked_at_start(server: RunningServer, server_engine: Engine) -> None:  # noqa: F811
    over = {"top_k": 100, "seed": 1}  # the schema allows it; this engine's top_k_cap (64) does not
    async with ws_connect(server) as ws:
        await send_json(ws, {"type": "start", "sampling": over})
        assert "top_k" in (await expect_error(ws, "invalid_request"))["message"]
        await start_session(ws, sampling=SHORT)  # the session starts once the settings are fixed
        await still_speaks(ws, 1)
    async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH, timeout=30) as client:
        response = await client.post("/v1/audio/speech", json={**SPEECH, "sampling": over})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"


async def test_whitespace_only_utterances_are_invalid_text_on_both_transports(server: RunningServer) -> None:
    async with ws_connect(server) as ws:
        await start_session(ws, sampling=SHORT)
        for delta in (" ", "\n\t ", "\u3000"):
            await send_json(ws, {"type": "text", "text": delta})
        await send_json(ws, {"type": "flush"})
        heard = (await listen(ws, 1))[1]
        assert heard.done["finish_reason"] == "error" and heard.audio == bytearray()
        assert [e["code"] for e in heard.errors] == ["invalid_text"]
        await send_json(ws, {"type": "text", "text": "  "})  # leading whitespace, then words: spoken
        await still_speaks(ws, 2)
    async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH, timeout=30) as client:
        for text in ("", " \n\t", "\u3000"):
            response = await client.post("/v1/audio/speech", json={**SPEECH, "input": text})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_text"


# ---------------------------------------------------------------------- clients that stop reading
def small_receive_buffer(port: int) -> socket.socket:
    """A connected socket whose receive window is tiny, so a client that stops reading stalls the server fast."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window scale
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


async def test_clients_that_stop_reading_lose_their_slots_not_the_server(
    server_engine: Engine, tmp_path: Path  # noqa: F811
) -> None:
    config = make_config(tmp_path, max_active_streams=4, send_timeout_s=3.0, send_buffer_bytes=16384, max_frames=2000)
    with running_server(config, engine=server_engine) as srv:
        stalled = []
        opened = server_engine.stats().streams_started
        for seed in range(4):  # as many as there are slots, each streaming a long utterance it never reads
            ws = await connect(
                srv.ws_url, additional_headers=AUTH, sock=small_receive_buffer(srv.port), max_queue=1, proxy=None
            )
            await start_session(
                ws,
                sampling={"max_frames": 2000, "ignore_eos": True, "seed": seed},
                audio_format={"encoding": "pcm_f32le", "sample_rate": 48000},  # 15 KB a frame: stalls soon
            )
            await send_json(ws, {"type": "text", "text": "Nobody reads this."})
            await send_json(ws, {"type": "flush"})
            stalled.append(ws)
        await async_wait_for(lambda: server_engine.stats().streams_started - opened == 4, 10, "four slots taken")
        started = time.monotonic()
        async with ws_connect(srv) as ws:
            await start_session(ws, sampling=SHORT)
            await send_json(ws, {"type": "text", "text": "Let me through."})
            await send_json(ws, {"type": "flush"})
            heard = (await listen(ws, 1))[1]  # a fifth client is served once the stalled ones lose their slots
        assert heard.done["finish_reason"] == "max_frames" and time.monotonic() - started < 20
        assert heard.done["metrics"]["queue_wait_s"] > 0.1, "the four did not hold every slot"
        await async_wait_for(lambda: server_engine.stats().active_streams == 0, 5, "slots freed")

        for ws in stalled:  # reading again, each finds its audio, perhaps the reason, then the close
            errors = []
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    message = await asyncio.wait_for(ws.recv(), 10)
                    if isinstance(message, str) and json.loads(message)["type"] == "error":
                        errors.append(json.loads(message)["code"])
            assert closed.value.rcvd is not None and closed.value.rcvd.code == protocol.CLOSE_SEND_TIMEOUT
            assert closed.value.rcvd.reason == "send_timeout" and errors in ([], ["send_timeout"])
        text = await get_metrics(srv)
        assert metric(text, "qwen3tts_cancels_total", reason="send_timeout") == 4
        assert metric(text, "qwen3tts_errors_total", code="send_timeout") == 4
        assert metric(text, "qwen3tts_utterances_total", endpoint="ws", finish_reason="cancelled") == 4
        await async_wait_for(lambda: srv.state.sessions == 0, 5, "stalled sessions gone")


async def test_an_http_client_that_stops_reading_frees_its_slot(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    config = make_config(tmp_path, max_active_streams=1, send_timeout_s=1.0, send_buffer_bytes=16384, max_frames=2000)
    with running_server(config, engine=server_engine) as srv:
        # far longer than the test: only the stall can end it in time
        body = json.dumps({**SPEECH, "response_format": "pcm", "sampling": {"max_frames": 2000, "ignore_eos": True}})
        opened = server_engine.stats().streams_started
        sock = small_receive_buffer(srv.port)
        sock.setblocking(True)
        sock.sendall(
            f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert sock.recv(12) == b"HTTP/1.1 200"  # then it reads no more
        await async_wait_for(lambda: server_engine.stats().streams_started > opened, 10, "the slot taken")
        await async_wait_for(lambda: server_engine.stats().active_streams == 0, 15, "the slot freed")
        async with httpx.AsyncClient(base_url=srv.http_url, headers=AUTH, timeout=30) as client:
            assert (await client.post("/v1/audio/speech", json=SPEECH)).status_code == 200
        assert metric(await get_metrics(srv), "qwen3tts_cancels_total", reason="disconnect") == 1
        sock.close()


# ---------------------------------------------------------------------- half-open HTTP connections
def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    sock.settimeout(limit_s)
    started = time.monotonic()
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received, time.monotonic() - started


def test_half_open_and_idle_http_connections_are_closed(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    config = make_config(tmp_path, http_read_timeout_s=0.5, keep_alive_timeout_s=0.5)
    with running_server(config, engine=server_engine) as srv:
        opened = time.monotonic()
        partial = socket.create_connection(("127.0.0.1", srv.port))
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        silent = socket.create_connection(("127.0.0.1", srv.port))  # sends nothing at all
        for sock in (partial, silent):
            answer, _ = read_until_closed(sock, 5)
            assert answer.startswith(b"HTTP/1.1 408") and b'"code": "request_timeout"' in answer
        assert 0.4 < time.monotonic() - opened < 3

        trickle = socket.create_connection(("127.0.0.1", srv.port))  # activity does not extend the deadline
        started = time.monotonic()
        trickle.settimeout(0.1)
        with pytest.raises(OSError):
            for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                trickle.send(bytes([byte]))
                time.sleep(0.05)
        assert time.monotonic() - started < 3

        keep_alive = socket.create_connection(("127.0.0.1", srv.port))
        for _ in range(2):  # two requests on one connection, then it idles out
            keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            response = b""
            while not response.endswith(b'{"status":"ok"}'):
                response += keep_alive.recv(4096)
            assert response.startswith(b"HTTP/1.1 200")
        answer, took = read_until_closed(keep_alive, 5)
        assert answer == b"" and 0.4 < took < 3

        slow_body = socket.create_connection(("127.0.0.1", srv.port))
        slow_body.sendall(
            f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"".encode()
        )
        answer, took = read_until_closed(slow_body, 5)
        assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer and took < 3
        for sock in (partial, silent, trickle, keep_alive, slow_body):
            sock.close()


def test_a_body_answered_early_must_still_arrive_in_time(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    """A request answered before its body was read (401: the route never reads it, so no body deadline starts)
    kept its connection for as long as the body trickled in: the rest must come within the read timeout."""
    config = make_config(tmp_path, http_read_timeout_s=0.5, keep_alive_timeout_s=5.0)
    head = (
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
        b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{"
    )
    with running_server(config, engine=server_engine) as srv:
        trickled = socket.create_connection(("127.0.0.1", srv.port))
        trickled.sendall(head)
        trickled.settimeout(5)
        answer = trickled.recv(4096)
        assert answer.startswith(b"HTTP/1.1 401"), answer
        answered, closed_after = time.monotonic(), None
        trickled.settimeout(0.05)
        while time.monotonic() - answered < 6:  # a byte every 0.1 s would take 20 s to finish the body
            try:
                trickled.send(b" ")
                if trickled.recv(4096) == b"":
                    closed_after = time.monotonic() - answered
                    break
            except TimeoutError:
                continue
            except OSError:
                closed_after = time.monotonic() - answered
                break
            time.sleep(0.1)
        assert closed_after is not None and closed_after < 3, closed_after

        prompt = socket.create_connection(("127.0.0.1", srv.port))  # the rest in time: the connection goes on
        prompt.settimeout(5)
        prompt.sendall(head)
        assert prompt.recv(4096).startswith(b"HTTP/1.1 401")
        prompt.sendall(b" " * 199)
        time.sleep(0.8)  # past the read timeout: its deadline ended with the body
        prompt.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = b""
        while not response.endswith(b'{"status":"ok"}'):
            response += prompt.recv(4096)
        assert b"HTTP/1.1 200" in response  # after what was left of the 401's answer
        for sock in (trickled, prompt):
            sock.close()


async def test_a_session_open_while_the_core_restarts_fails_that_utterance_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An utterance flushed while the engine restarts after a core death gets `not_ready` and its `done`, and the
    session speaks again once the engine is back (it was closed with internal_error and 1011)."""
    monkeypatch.setattr(engine_module, "RESTART_BACKOFF_S", (3.0, 3.0))  # time to speak while the core is down
    engine = engine_for("synthetic:tiny", max_streams=2)
    try:
        with running_server(make_config(tmp_path), engine=engine) as srv:
            async with ws_connect(srv) as ws:
                await start_session(ws, sampling=SHORT)
                runner = engine.core.runner

                def broken(*args: object, **kwargs: object) -> None:
                    raise RuntimeError("the device is gone")

                monkeypatch.setattr(runner, "frame_step", broken)  # three failed steps in a row: the core stops
                for _ in range(3):
                    await send_json(ws, {"type": "text", "text": "Hello there."})
                    await send_json(ws, {"type": "flush"})
                    msg = await recv_json(ws)
                    while msg["type"] != "done":
                        msg = await recv_json(ws)
                    if not engine.healthy:
                        break
                await async_wait_for(lambda: not engine.healthy, 10, "the core stopped")

                await send_json(ws, {"type": "text", "text": "Are you there?"})
                await send_json(ws, {"type": "flush"})
                refused = await expect_error(ws, "not_ready")
                done = await recv_json(ws)
                assert done["type"] == "done" and done["finish_reason"] == "error", done
                assert done["utterance_id"] == refused["utterance_id"]

                await async_wait_for(lambda: engine.healthy, 30, "the core restarted")
                await send_json(ws, {"type": "text", "text": "Now you are."})
                await send_json(ws, {"type": "flush"})
                heard = await listen(ws, 1)
                assert [h.done["finish_reason"] for h in heard.values() if h.done] == ["max_frames"]
    finally:
        engine.close()


# ---------------------------------------------------------------------- the contract, written down
def test_every_error_and_close_code_is_in_the_table_and_documented() -> None:
    sources = "".join(p.read_text() for p in (ROOT / "qwen3tts_agent" / "server").glob("*.py"))
    raised = set(re.findall(r'ApiError\(\s*"([a-z_]+)"', sources))  # literal codes
    raised |= set(re.findall(r'\d: "([a-z_]+)"', sources))  # routing's statuses mapped to codes
    raised |= {code for _, code in protocol._ENGINE_ERRORS} | {"invalid_request"}  # from_engine_error, fallbacks
    assert raised <= set(ERROR_STATUS), raised - set(ERROR_STATUS)
    docs = (ROOT / "docs" / "server.md").read_text()
    for code, status in ERROR_STATUS.items():
        assert re.search(rf"`{code}`\s*\|\s*{status}\b", docs), f"{code} ({status}) is not in docs/server.md"
    for name in dir(protocol):
        if name.startswith("CLOSE_"):
            assert f"`{getattr(protocol, name)}`" in docs, f"{name} is not in docs/server.md"
    # every reason a `busy` can carry has its label (the server's own limits, the engine's refusals)
    engine_sources = "".join(p.read_text() for p in (ROOT / "qwen3tts_agent" / "engine").rglob("*.py"))
    reasons = set(re.findall(r'reason="([a-z_]+)"', sources)) | set(REFUSAL_REASONS)
    reasons |= set(re.findall(r'reason="([a-z_]+)"', engine_sources))
    assert reasons | {"engine"} == set(protocol.BUSY_REASONS), reasons ^ set(protocol.BUSY_REASONS)
    assert all(f"`{reason}`" in docs for reason in protocol.BUSY_REASONS)


def test_serve_without_the_server_extra_prints_the_install_hint() -> None:
    blocker = (
        "import importlib.abc, sys\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('uvicorn', 'fastapi'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "from qwen3tts_agent.cli import main\n"
        "sys.exit(main(['serve', '--model', 'synthetic:tiny', '--port', '9']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert 'pip install "qwen3tts-agent[server]"' in proc.stderr
    assert "unrecognized" not in proc.stderr and "No module named" in proc.stderr


def test_the_uvicorn_settings_survive_pickling_for_worker_processes(tmp_path: Path) -> None:
    """uvicorn hands its config to worker processes by pickling it: the bounded protocols must come along."""
    config = uvicorn_config("qwen3tts_agent.server.app:create_app", make_config(tmp_path, send_timeout_s=3.0))
    copy = pickle.loads(pickle.dumps(config))
    assert copy.http.keywords["limits"].send_timeout_s == 3.0 and copy.ws.func is BoundedWebSocketProtocol
