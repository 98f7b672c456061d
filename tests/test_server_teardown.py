"""Sessions end, and give back their count and their slots, however the client leaves (issue 42).

A client that closed the socket the instant its `done` arrived left its session counted forever: the reader's
teardown cancelled the runner just as the runner's send of the `done` completed, Python 3.11's
`asyncio.wait_for` returned instead of raising, and the runner waited for more utterances while the teardown
waited for the runner. The first tests drive the real app through its ASGI interface with a scripted peer that
leaves in exactly that tick, and with peers that swallow or ignore the cancel; the last ones run real
websockets and HTTP clients against a real server on uvloop (what `serve` runs on), where the leak showed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from qwen3tts_agent import Engine, waits
from qwen3tts_agent.server import create_app, session
from tests.server_fixtures import (
    API_KEY,
    AUTH,
    RunningServer,
    async_wait_for,
    make_config,
    metric,
    recv_json,
    running_server,
    send_json,
    server_engine,  # noqa: F401  (fixture)
    start_session,
    ws_connect,
)

SAY = [
    {"type": "start", "sampling": {"seed": 1, "max_frames": 4}},
    {"type": "text", "text": "Hello there."},
    {"type": "flush"},
]
# How long a session may take to end once its client left, far below any bound the teardown has
ENDS_WITHIN_S = 5.0


@pytest.fixture(params=["asyncio.timeout", "task"])
def wait_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The in-process tests run with both of `waits.bounded`'s ways: Python 3.11+'s, and 3.10's (a task of its
    own under asyncio.wait), which CI's 3.11 would otherwise never run."""
    if request.param == "task":
        monkeypatch.setattr(waits, "_timeout", None)
    return str(request.param)


class Peer:
    """An ASGI server's side of one WebSocket: hands the app `messages`, records what the app sends, and
    leaves (`websocket.disconnect`) when told to or once the app's send of a `done` returns.

    `on_done` runs inside the app's send of the `done`, after the peer has left: what the ASGI server does
    with that send (return at once, swallow a cancel, ignore cancels).
    """

    def __init__(self, messages: list[dict[str, Any]], on_done: Callable[[], Any] | None = None) -> None:
        self._incoming = deque(
            [{"type": "websocket.connect"}, *({"type": "websocket.receive", "text": json.dumps(m)} for m in messages)]
        )
        self._on_done = on_done
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if self._incoming:
            return self._incoming.popleft()
        await self.gone.wait()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "websocket.send" and json.loads(message.get("text") or "{}").get("type") == "done":
            # the reader wakes before the send returns to the runner: its teardown cancels the runner while
            # the runner's send is done but the runner has not resumed (what wait_for swallowed on 3.11)
            self.gone.set()
            if self._on_done is not None:
                await self._on_done()

    def received(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(m["text"]) for m in self.sent if m.get("text") and json.loads(m["text"])["type"] == kind]


def ws_scope() -> dict[str, Any]:
    return {
        "type": "websocket",
        "asgi": {"version": "3.0"},
        "scheme": "ws",
        "http_version": "1.1",
        "path": "/v1/stream",
        "raw_path": b"/v1/stream",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {API_KEY}".encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "subprotocols": [],
        "state": {},
    }


@asynccontextmanager
async def started(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running and ready, and an HTTP client that calls it in process."""
    async with app.router.lifespan_context(app):
        state = app.state.server
        await async_wait_for(lambda: state.ready or state.failure is not None, 30, "ready")
        assert state.failure is None, state.failure
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            yield http


async def active_sessions(http: httpx.AsyncClient) -> float:
    return metric((await http.get("/metrics", headers=AUTH)).text, "qwen3tts_active_sessions")


async def serve_until_gone(app: FastAPI, peer: Peer) -> float:
    """Run the WebSocket route for `peer`; the seconds its session took to end after the peer left."""
    route = asyncio.create_task(app(ws_scope(), peer.receive, peer.send))
    gone = asyncio.create_task(peer.gone.wait())
    try:
        await asyncio.wait({route, gone}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert gone.done(), f"the peer never got its done: {peer.sent}"
        left = asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({route}, timeout=ENDS_WITHIN_S)
        assert done, f"the session did not end within {ENDS_WITHIN_S}s of its client leaving"
        route.result()
        return asyncio.get_running_loop().time() - left
    finally:
        gone.cancel()
        route.cancel()  # only still running when an assertion failed: the leak, ended for the next test
        await asyncio.wait({route}, timeout=ENDS_WITHIN_S)


async def speaks(app: FastAPI) -> None:
    """A new session is accepted and gets its audio (no session and no synthesis slot leaked)."""
    peer = Peer(SAY)
    await serve_until_gone(app, peer)
    assert peer.sent[0]["type"] == "websocket.accept", peer.sent[0]
    assert [d["finish_reason"] for d in peer.received("done")] == ["max_frames"], peer.received("error")


# ---------------------------------------------------------------------- the exact interleaving, in process
@pytest.mark.usefixtures("wait_kind")
async def test_a_client_leaving_as_its_done_is_sent_releases_the_session(
    server_engine: Engine, tmp_path: Path  # noqa: F811
) -> None:
    """The peer leaves in the step where the app's send of `done` returns: the reader's teardown cancels the
    runner before the runner resumes. Before the fix, on Python 3.11, the session never ended."""
    app = create_app(make_config(tmp_path, max_sessions=1), engine=server_engine)
    async with started(app) as http:
        for _ in range(3):
            peer = Peer(SAY)
            await serve_until_gone(app, peer)
            assert [d["finish_reason"] for d in peer.received("done")] == ["max_frames"]
            assert await active_sessions(http) == 0
        await speaks(app)  # max_sessions is 1: a leaked session would refuse this one


@pytest.mark.usefixtures("wait_kind")
async def test_the_runner_stops_even_when_its_cancel_is_swallowed(
    server_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """An ASGI server whose send swallows the cancel: the runner goes on, and stops at the teardown's flag,
    not at the teardown's bound (set far above the time allowed here)."""

    async def swallow_cancel() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)

    monkeypatch.setattr(session, "TEARDOWN_WAIT_S", 60.0)
    app = create_app(make_config(tmp_path, max_sessions=1), engine=server_engine)
    async with started(app) as http:
        await serve_until_gone(app, Peer(SAY, on_done=swallow_cancel))
        assert await active_sessions(http) == 0
        await speaks(app)


@pytest.mark.usefixtures("wait_kind")
async def test_a_runner_that_cannot_be_stopped_does_not_keep_the_session(
    server_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """An ASGI server whose send never returns, cancel or not: the teardown gives up on the runner after its
    bound, says so, and the session's count is released all the same."""
    released = asyncio.Event()

    async def ignore_cancels() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    monkeypatch.setattr(session, "TEARDOWN_WAIT_S", 0.3)
    app = create_app(make_config(tmp_path, max_sessions=1), engine=server_engine)
    async with started(app) as http:
        try:
            with caplog.at_level(logging.WARNING, logger="qwen3tts_agent.waits"):
                took = await serve_until_gone(app, Peer(SAY, on_done=ignore_cancels))
            assert took >= 0.3
            assert "did not end within 0.3s of its cancel" in caplog.text
            assert await active_sessions(http) == 0
        finally:
            released.set()  # the runner's send returns: it ends
        await speaks(app)


@pytest.mark.usefixtures("wait_kind")
async def test_a_runner_cancelled_as_its_slot_is_granted_gives_the_slot_back(
    server_engine: Engine, tmp_path: Path  # noqa: F811
) -> None:
    """One synthesis slot, held by the test; the session's runner waits for it. The test frees it and the
    client leaves in the same tick: the wait for the slot ends with the slot, then the teardown cancels the
    runner before it resumes. The slot must go back, or every later utterance waits in vain (busy)."""
    app = create_app(make_config(tmp_path, max_active_streams=1, queue_timeout_s=2.0), engine=server_engine)
    async with started(app):
        admission = app.state.server.admission
        await admission.acquire()
        peer = Peer(SAY)
        route = asyncio.create_task(app(ws_scope(), peer.receive, peer.send))
        try:
            await async_wait_for(lambda: admission.waiting == 1, 10, "the runner waiting for the slot")
            admission.release()
            peer.gone.set()
            done, _ = await asyncio.wait({route}, timeout=ENDS_WITHIN_S)
            assert done, "the session did not end"
        finally:
            route.cancel()
        assert peer.received("done") == []  # it left before its utterance started
        await speaks(app)  # needs the one slot


async def test_a_cancel_the_engine_cannot_answer_yet_does_not_hold_the_sessions_messages(
    server_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """A client's `cancel` waits for the engine to drop its streams, at most `TEARDOWN_WAIT_S`: with the engine's
    core held up (here by a call on its own thread), the session answers the client's next message after that
    bound, not once the engine is back; the utterance still ends with its `done`."""
    monkeypatch.setattr(session, "TEARDOWN_WAIT_S", 0.3)
    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return await incoming.get()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    def received(kind: str) -> list[dict[str, Any]]:
        return [json.loads(m["text"]) for m in sent if m.get("text") and json.loads(m["text"])["type"] == kind]

    def say(message: dict[str, Any]) -> None:
        incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(message)})

    app = create_app(make_config(tmp_path, max_sessions=1), engine=server_engine)
    release = threading.Event()
    async with started(app):
        route = asyncio.create_task(app(ws_scope(), receive, send))
        try:
            incoming.put_nowait({"type": "websocket.connect"})
            for message in ({"type": "start", "sampling": {"max_frames": 400, "ignore_eos": True}},
                            {"type": "text", "text": "A long answer."}, {"type": "flush"}):
                say(message)
            await async_wait_for(lambda: any(m["type"] == "websocket.send" and m.get("bytes") for m in sent), 30, "audio")
            held = server_engine.core.call(lambda: release.wait(20))  # the core's loop held: no cancel is taken
            say({"type": "cancel"})
            say({"type": "bogus"})
            with caplog.at_level(logging.WARNING, logger="qwen3tts_agent.server.session"):
                started_at = asyncio.get_running_loop().time()
                await async_wait_for(lambda: received("error"), 5, "the answer to the next message")
                took = asyncio.get_running_loop().time() - started_at
            assert 0.3 <= took < 3.0 and received("error")[0]["code"] == "unknown_type"
            assert "cancelling utterance 1 took over 0.3s; going on" in caplog.text
            release.set()
            held.result(timeout=10)
            await async_wait_for(lambda: received("done"), 10, "the cancelled utterance's done")
            assert received("done")[0]["finish_reason"] == "cancelled"
            incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
            done, _ = await asyncio.wait({route}, timeout=ENDS_WITHIN_S)
            assert done, "the session did not end"
        finally:
            release.set()
            route.cancel()
            await asyncio.wait({route}, timeout=ENDS_WITHIN_S)
        await speaks(app)


# ---------------------------------------------------------------------- real clients, a real server
@pytest.fixture(scope="module")
def auto_loop_server(server_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:  # noqa: F811
    """Few sessions and one synthesis slot, so a leaked one shows at once; uvicorn's "auto" loop, as `serve`
    runs (uvloop where installed: the leak showed there on the first attempt, and not in 150 on asyncio's)."""
    config = make_config(
        tmp_path_factory.mktemp("voices"), max_sessions=2, max_active_streams=1, queue_timeout_s=5.0, idle_timeout_s=4.0
    )
    with running_server(config, engine=server_engine, loop="auto") as srv:
        yield srv


async def server_metrics(server: RunningServer) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{server.http_url}/metrics", headers=AUTH)).text


# what a WebSocket session and an HTTP request hold while open, as /metrics shows it
WS_HELD = [("qwen3tts_active_sessions", {}), ("qwen3tts_active_streams", {"endpoint": "ws"})]
HTTP_HELD = [("qwen3tts_active_streams", {"endpoint": "http"})]


async def all_released(server: RunningServer, held: list[tuple[str, dict[str, str]]]) -> None:
    """All of `held` is back to zero within a bound once the clients left."""
    deadline = asyncio.get_running_loop().time() + ENDS_WITHIN_S
    while True:
        text = await server_metrics(server)
        still_open = {f"{name}{labels or ''}": metric(text, name, **labels) for name, labels in held}
        if not any(still_open.values()):
            return
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"still open {ENDS_WITHIN_S}s after the clients left: {still_open}")
        await asyncio.sleep(0.05)


async def test_websocket_clients_closing_the_instant_done_arrives_leave_nothing_behind(
    auto_loop_server: RunningServer,
) -> None:
    """Issue 42's reproduction, bounded: each client reads until its `done`, then closes (or drops the TCP
    connection) at once. With `max_sessions` 2, two leaked sessions would refuse every later client."""
    for attempt in range(40):
        async with ws_connect(auto_loop_server) as ws:
            await start_session(ws, sampling={"seed": 1, "max_frames": 4})
            await send_json(ws, {"type": "text", "text": "Hello there."})
            await send_json(ws, {"type": "flush"})
            while True:
                message = await asyncio.wait_for(ws.recv(), 15)
                if isinstance(message, str) and json.loads(message)["type"] == "done":
                    break
            if attempt % 4 == 3:
                ws.transport.abort()  # no close handshake at all
            else:
                await ws.close()
    await all_released(auto_loop_server, WS_HELD)
    async with ws_connect(auto_loop_server) as ws:  # still accepted, and speaks
        await start_session(ws, sampling={"seed": 1, "max_frames": 4})
        await send_json(ws, {"type": "text", "text": "Still here."})
        await send_json(ws, {"type": "flush"})
        while (msg := await recv_json(ws))["type"] != "done":
            if msg["type"] == "audio":
                await ws.recv()
        assert msg["finish_reason"] == "max_frames", msg


async def test_http_clients_dropping_the_response_early_or_at_its_end_free_the_slot(
    auto_loop_server: RunningServer,
) -> None:
    """The one synthesis slot goes back however the response is left: after its first bytes, or the moment
    its last byte arrives. A leaked slot would make the next request wait out `queue_timeout_s`, then 503."""
    sampling = {"seed": 1, "max_frames": 12, "ignore_eos": True}
    body = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm", "sampling": sampling}
    url = f"{auto_loop_server.http_url}/v1/audio/speech"
    for attempt in range(16):
        async with (
            httpx.AsyncClient(timeout=15) as client,
            client.stream("POST", url, headers=AUTH, json=body) as response,
        ):
            assert response.status_code == 200, await response.aread()
            if attempt % 2 == 0:
                async for _ in response.aiter_raw():
                    break  # leaves after the first bytes: the connection closes mid-stream
            else:
                received = b"".join([chunk async for chunk in response.aiter_raw()])
                assert len(received) == 12 * 1920 * 2
    await all_released(auto_loop_server, HTTP_HELD)
