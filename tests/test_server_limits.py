"""Bad input, auth and overload against a real server: clear errors or clean closes, never a stuck server."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from qwen3tts_agent import Engine
from qwen3tts_agent.server import ServerConfig, create_app
from qwen3tts_agent.server.cli import add_serve_command, run_serve
from qwen3tts_agent.server.config import is_loopback
from tests.server_fixtures import (
    AUTH,
    ENGINE_SPEC,
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

SHORT = {"max_frames": 8, "seed": 3}
LONG = {"max_frames": 300, "ignore_eos": True, "seed": 4}


@pytest.fixture(scope="module")
def server(server_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:  # noqa: F811
    with running_server(make_config(tmp_path_factory.mktemp("voices")), engine=server_engine) as srv:
        yield srv


async def expect_error(ws, code: str) -> dict:
    msg = await recv_json(ws)
    assert msg["type"] == "error" and msg["code"] == code, msg
    assert msg["message"] and msg["status"] >= 400
    return msg


async def test_missing_or_wrong_token_is_refused(server: RunningServer) -> None:
    for token in (None, "wrong-key"):
        with pytest.raises(InvalidStatus) as refused:
            async with ws_connect(server, token=token):
                pass
        response = refused.value.response
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(response.body)["error"]["code"] == "unauthorized"
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        for path in ("/v1/voices", "/metrics"):
            assert (await client.get(path)).status_code == 401
        speech = await client.post("/v1/audio/speech", json={"model": "m", "input": "hi"})
        assert speech.status_code == 401 and speech.json()["error"]["type"] == "authentication_error"
        assert (await client.get("/health")).status_code == 200  # probes need no token


async def test_bad_messages_get_clear_errors_and_the_session_survives(server: RunningServer) -> None:
    async with ws_connect(server) as ws:
        await send_json(ws, {"type": "text", "text": "too early"})
        await expect_error(ws, "not_started")
        await ws.send("{not json")
        await expect_error(ws, "invalid_json")
        await ws.send("[1, 2]")
        await expect_error(ws, "invalid_message")
        await send_json(ws, {"type": "sing"})
        assert "sing" in (await expect_error(ws, "unknown_type"))["message"]
        await send_json(ws, {"text": "no type"})
        await expect_error(ws, "unknown_type")
        await ws.send(b"\x00\x01 binary")
        await expect_error(ws, "invalid_message")
        bad_starts = [
            ({"sampling": {"top_q": 0.5}}, "invalid_message", "sampling.top_q"),
            ({"sampling": {"temperature": "hot"}}, "invalid_message", "sampling.temperature"),
            ({"sampling": {"max_frames": 401}}, "invalid_message", "max_frames"),
            ({"audio_format": {"sample_rate": 11025}}, "invalid_message", "audio_format.sample_rate"),
            ({"chunk_schedule": [0]}, "invalid_message", "chunk_schedule"),
            ({"voice_id": "x"}, "invalid_message", "voice_id"),
            ({"voice": "nobody"}, "unknown_voice", "nobody"),
            ({"language": "klingon"}, "unsupported_language", "klingon"),
            ({"instruct": "whisper"}, "unsupported_feature", "instruction"),
        ]
        for extra, code, mentioned in bad_starts:
            await send_json(ws, {"type": "start", **extra})
            assert mentioned in (await expect_error(ws, code))["message"]

        await start_session(ws, sampling=SHORT)
        await send_json(ws, {"type": "start"})
        await expect_error(ws, "already_started")
        await send_json(ws, {"type": "text", "text": "x" * 501})  # the server's limit is 500 per utterance
        await expect_error(ws, "text_too_long")
        await send_json(ws, {"type": "flush", "extra": True})
        await expect_error(ws, "invalid_message")
        await send_json(ws, {"type": "text", "text": "Still alive after all that."})
        await send_json(ws, {"type": "flush"})
        heard = (await listen(ws, 1))[1]
        assert heard.done["utterance_id"] == 1 and heard.done["finish_reason"] in ("eos", "max_frames")
        assert len(heard.audio) > 0 and heard.errors == []
    text = await _metrics(server)
    assert metric(text, "qwen3tts_errors_total", code="invalid_message") >= 8


async def test_oversize_messages_close_the_session_with_1009(server: RunningServer) -> None:
    limit = server.state.config.max_message_bytes
    for size, explained in ((limit + limit // 2, True), (3 * limit, False)):
        async with ws_connect(server) as ws:
            await start_session(ws)
            await send_json(ws, {"type": "text", "text": "x" * size})
            if explained:  # within the protocol cap the app explains; beyond it the protocol layer just closes
                await expect_error(ws, "message_too_large")
            with pytest.raises(ConnectionClosedError) as closed:
                await recv_json(ws)
            assert closed.value.rcvd.code == 1009


async def test_http_bad_requests_get_openai_style_errors(server: RunningServer) -> None:
    ok = {"model": "tts-1", "input": "Hello.", "voice": "alloy"}
    cases = [
        (b"{broken", 400, "invalid_json"),
        ({**ok, "colour": "blue"}, 400, "invalid_message"),
        ({"model": "tts-1", "voice": "alloy"}, 400, "invalid_message"),
        ({**ok, "response_format": "mp3"}, 400, "unsupported_format"),
        ({**ok, "speed": 2.0}, 400, "unsupported_parameter"),
        ({**ok, "stream_format": "sse"}, 400, "unsupported_parameter"),
        ({**ok, "input": "   "}, 400, "invalid_text"),
        ({**ok, "input": "x" * 501}, 400, "text_too_long"),
        ({**ok, "voice": "nobody"}, 400, "unknown_voice"),
        ({**ok, "language": "klingon"}, 400, "unsupported_language"),
        ({**ok, "sampling": {"seed": -1}}, 400, "invalid_message"),
        ({**ok, "input": "y" * 9000}, 413, "message_too_large"),
    ]
    async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH) as client:
        for body, status, code in cases:
            if isinstance(body, bytes):
                response = await client.post("/v1/audio/speech", content=body)
            else:
                response = await client.post("/v1/audio/speech", json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["code"] == code and error["message"], response.text
            assert error["type"] == "invalid_request_error"
        assert (await client.get("/v1/voices/nobody")).status_code == 404


async def test_idle_sessions_are_closed_but_speaking_ones_are_not(
    server_engine: Engine, tmp_path: Path  # noqa: F811
) -> None:
    with running_server(make_config(tmp_path, idle_timeout_s=0.4), engine=server_engine) as srv:
        async with ws_connect(srv) as ws:
            await start_session(ws, sampling={"max_frames": 12, "ignore_eos": True, "seed": 1})
            await send_json(ws, {"type": "text", "text": "Longer than the idle timeout."})
            await send_json(ws, {"type": "flush"})
            heard = (await listen(ws, 1))[1]
            assert heard.done["finish_reason"] == "max_frames"  # streaming is not idling
            started = time.perf_counter()
            await expect_error(ws, "idle_timeout")
            assert time.perf_counter() - started < 2.0
            with pytest.raises(ConnectionClosedError) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 4008


async def test_session_limit_refuses_with_503_until_one_leaves(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    with running_server(make_config(tmp_path, max_sessions=2), engine=server_engine) as srv:
        async with ws_connect(srv) as first, ws_connect(srv):
            with pytest.raises(InvalidStatus) as refused:
                async with ws_connect(srv):
                    pass
            response = refused.value.response
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            assert json.loads(response.body)["error"]["code"] == "busy"
            assert metric(await _metrics(srv), "qwen3tts_busy_total", reason="sessions") == 1
            await first.close()
            await async_wait_for(lambda: srv.state.sessions == 1, 2, "session slot freed")
            async with ws_connect(srv) as third:
                await start_session(third)


async def test_overload_queues_boundedly_then_answers_busy(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    config = make_config(tmp_path, max_active_streams=1, max_queued=1, queue_timeout_s=2.0)
    with running_server(config, engine=server_engine) as srv:
        async with ws_connect(srv) as a, ws_connect(srv) as b, ws_connect(srv) as c, httpx.AsyncClient(
            base_url=srv.http_url, headers=AUTH
        ) as client:
            for ws in (a, b, c):
                await start_session(ws, sampling=LONG)
            await send_json(a, {"type": "text", "text": "I hold the only slot."})
            assert (await recv_json(a))["type"] == "audio"
            await a.recv()

            queued_at = time.perf_counter()
            await send_json(b, {"type": "text", "text": "I wait in the queue."})
            await async_wait_for(lambda: srv.state.admission.waiting == 1, 2, "b queued")
            assert metric(await _metrics(srv), "qwen3tts_queued_requests") == 1

            await send_json(c, {"type": "text", "text": "No room for me."})
            started = time.perf_counter()
            error = await expect_error(c, "busy")
            assert error["status"] == 503 and error["utterance_id"] == 1
            assert time.perf_counter() - started < 1.0  # refused at once, not after the queue timeout
            done = await recv_json(c)
            assert done["type"] == "done" and done["finish_reason"] == "error"

            speech = await client.post("/v1/audio/speech", json={"model": "m", "input": "Me neither."})
            assert speech.status_code == 503 and speech.headers["Retry-After"] == "1"
            assert speech.json()["error"]["code"] == "busy"
            health_started = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            assert time.perf_counter() - health_started < 1.0  # the event loop keeps answering

            error = await expect_error(b, "busy")  # the queue wait is bounded too
            assert time.perf_counter() - queued_at >= config.queue_timeout_s * 0.9
            assert "within" in error["message"]
            assert (await recv_json(b))["finish_reason"] == "error"

            await send_json(a, {"type": "cancel"})
            while (msg := await recv_json(a))["type"] == "audio":
                await a.recv()
            assert msg["type"] == "done" and msg["finish_reason"] == "cancelled"
            # text after an utterance's done belongs to it until the flush; then the freed slot serves b
            await send_json(b, {"type": "flush"})
            await send_json(b, {"type": "text", "text": "My turn now."})
            assert (await recv_json(b))["type"] == "audio"
            await send_json(b, {"type": "cancel"})
        text = await _metrics(srv)
        assert metric(text, "qwen3tts_errors_total", code="busy") == 3
        assert metric(text, "qwen3tts_busy_total", reason="queue_full") == 2  # c's utterance and the speech
        assert metric(text, "qwen3tts_busy_total", reason="queue_timeout") == 1  # b's
        await async_wait_for(lambda: server_engine.stats().active_streams == 0, 3, "engine idle")


async def test_pending_utterances_per_session_are_bounded(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    config = make_config(tmp_path, max_pending_utterances=2)
    with running_server(config, engine=server_engine) as srv:
        async with ws_connect(srv) as ws:
            await start_session(ws, sampling=LONG)
            for n in range(2):
                await send_json(ws, {"type": "text", "text": f"Utterance {n}."})
                await send_json(ws, {"type": "flush"})
            await send_json(ws, {"type": "text", "text": "One too many."})
            while (msg := await recv_json(ws))["type"] == "audio":
                await ws.recv()
            assert msg["type"] == "error" and msg["code"] == "busy" and "pending" in msg["message"]
            assert metric(await _metrics(srv), "qwen3tts_busy_total", reason="session_pending") == 1
            await send_json(ws, {"type": "cancel"})
            reasons = []
            while len(reasons) < 2:
                msg = await recv_json(ws)
                if msg["type"] == "audio":
                    await ws.recv()
                elif msg["type"] == "done":
                    reasons.append((msg["utterance_id"], msg["finish_reason"]))
            assert reasons == [(1, "cancelled"), (2, "cancelled")]


async def _metrics(server: RunningServer) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{server.http_url}/metrics", headers=AUTH)).text


async def test_concurrent_garbage_does_not_disturb_a_streaming_session(server: RunningServer) -> None:
    async def vandal() -> None:
        async with ws_connect(server) as ws:
            for raw in ("{", '{"type": "start", "sampling": 5}', '"x"', "null"):
                await ws.send(raw)
                assert (await recv_json(ws))["type"] == "error"
            ws.transport.abort()

    async with ws_connect(server) as ws:
        await start_session(ws, sampling={"max_frames": 16, "ignore_eos": True, "seed": 9})
        await send_json(ws, {"type": "text", "text": "Undisturbed."})
        await send_json(ws, {"type": "flush"})
        heard, _ = await asyncio.gather(listen(ws, 1), asyncio.gather(*(vandal() for _ in range(3))))
    assert heard[1].done["metrics"]["frames"] == 16 and len(heard[1].audio) == 16 * 1920 * 2


def test_serving_beyond_loopback_requires_a_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", ENGINE_SPEC, "--host", "0.0.0.0", "--voices-dir", str(tmp_path)])
    args.api_key = None  # whatever the environment says
    assert run_serve(args) == 2
    assert "requires a bearer token" in capsys.readouterr().err
    with pytest.raises(ValueError, match="bearer token"):
        create_app(ServerConfig(host="192.0.2.1", voices_dir=tmp_path), engine_factory=lambda: None)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("tts.example.com")
