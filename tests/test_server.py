"""The streaming server end to end: real uvicorn on loopback, the tiny engine, real WebSocket and HTTP clients."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import struct
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosedOK, InvalidStatus

from qwen3tts_agent import Engine
from qwen3tts_agent.errors import ModelLoadError
from tests.server_fixtures import (
    API_KEY,
    AUTH,
    ENGINE_SPEC,
    RunningServer,
    async_wait_for,
    listen,
    make_config,
    metric,
    recv_json,
    reference_wav,
    running_server,
    send_json,
    server_engine,  # noqa: F401  (fixture)
    shared_engine,
    start_session,
    ws_connect,
)

SHORT = {"max_frames": 8, "seed": 7}
LONG = {"max_frames": 300, "ignore_eos": True, "seed": 11}  # ~20 s of work: only ever cancelled
FRAME = 1920  # samples per 80 ms frame at 24 kHz


@pytest.fixture(scope="module")
def server(server_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:  # noqa: F811
    with running_server(make_config(tmp_path_factory.mktemp("voices")), engine=server_engine) as srv:
        yield srv


async def get_metrics(server: RunningServer) -> str:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{server.http_url}/metrics", headers=AUTH)
    assert response.status_code == 200
    return response.text


async def speak(ws, text: str) -> None:
    for word in text.split(" "):
        await send_json(ws, {"type": "text", "text": word + " "})
    await send_json(ws, {"type": "flush"})


async def test_text_deltas_stream_back_framed_audio_with_metrics(server: RunningServer) -> None:
    before = metric(await get_metrics(server), "qwen3tts_first_audio_seconds_count", endpoint="ws")
    async with ws_connect(server) as ws:
        ready = await start_session(ws, language="English", sampling=SHORT)
        assert ready["sample_rate"] == 24000 and ready["encoding"] == "pcm_s16le"
        assert ready["voice"] == "default" and ready["language"] == "english" and ready["session_id"]
        text = "Hello there, this arrives word by word."
        await speak(ws, text)
        heard = (await listen(ws, 1))[1]

    done = heard.done
    assert done is not None and done["finish_reason"] in ("eos", "max_frames")
    m = done["metrics"]
    assert [h["seq"] for h in heard.headers] == list(range(len(heard.headers)))
    assert heard.headers[0]["frame_start"] == 0 and heard.headers[0]["frame_end"] == 1  # first chunk: one frame
    for prev, nxt in itertools.pairwise(heard.headers):
        assert nxt["frame_start"] == prev["frame_end"]
    assert [h["is_last"] for h in heard.headers] == [False] * (len(heard.headers) - 1) + [True]
    assert 1 <= m["frames"] == heard.headers[-1]["frame_end"] <= SHORT["max_frames"]
    assert sum(h["samples"] for h in heard.headers) == m["frames"] * FRAME == len(heard.audio) // 2
    assert m["audio_seconds"] == pytest.approx(m["frames"] * 0.08)
    assert 0 < m["first_audio_latency_s"] <= m["wall_seconds"]
    assert m["real_time_factor"] > 0 and m["queue_wait_s"] >= 0 and m["chunks"] == len(heard.headers)
    assert m["text_chars"] == len(text) + 1  # the client sent "word " deltas
    after = metric(await get_metrics(server), "qwen3tts_first_audio_seconds_count", endpoint="ws")
    assert after == before + 1


async def test_utterances_play_in_order_in_the_requested_format_then_close(server: RunningServer) -> None:
    async with ws_connect(server) as ws:
        await start_session(
            ws,
            sampling=SHORT,
            chunk_schedule=[2],
            audio_format={"encoding": "pcm_f32le", "sample_rate": 16000},
        )
        await speak(ws, "First sentence.")
        await speak(ws, "Second sentence.")
        await send_json(ws, {"type": "close"})
        order: list[tuple[str, int]] = []
        totals = {1: 0, 2: 0}
        frames = {}
        while len(frames) < 2:
            msg = await recv_json(ws)
            order.append((msg["type"], msg["utterance_id"]))
            if msg["type"] == "audio":
                payload = await ws.recv()
                assert len(payload) == 4 * msg["samples"]
                assert msg["frame_end"] - msg["frame_start"] <= 2
                totals[msg["utterance_id"]] += msg["samples"]
            else:
                assert msg["type"] == "done", msg
                frames[msg["utterance_id"]] = msg["metrics"]["frames"]
        with pytest.raises(ConnectionClosedOK) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1000

    first_done = order.index(("done", 1))
    assert all(uid == 1 for _, uid in order[:first_done]) and all(uid == 2 for _, uid in order[first_done + 1 :])
    for uid in (1, 2):  # 24 kHz -> 16 kHz: two thirds of the samples, resampler flushed at the end
        assert abs(totals[uid] - frames[uid] * FRAME * 2 // 3) <= 2


async def test_concurrent_sessions_share_the_engine(server: RunningServer) -> None:
    async def one(seed: int) -> dict:
        async with ws_connect(server) as ws:
            await start_session(ws, sampling={"max_frames": 8, "seed": seed})
            await speak(ws, f"Session number {seed} speaking.")
            return (await listen(ws, 1))[1]

    results = await asyncio.gather(*(one(seed) for seed in range(4)))
    for heard in results:
        assert heard.done["finish_reason"] in ("eos", "max_frames")
        assert len(heard.audio) == heard.done["metrics"]["frames"] * FRAME * 2 > 0


async def test_audio_goes_uncompressed_to_a_client_offering_permessage_deflate(server: RunningServer) -> None:
    # the websockets client offers permessage-deflate by default, as browsers do; the server declines it
    async with ws_connect(server) as ws:
        assert ws.request is not None and "permessage-deflate" in ws.request.headers["Sec-WebSocket-Extensions"]
        assert ws.response is not None and "Sec-WebSocket-Extensions" not in ws.response.headers
        assert ws.protocol.extensions == []
        await start_session(ws, sampling=SHORT)
        await speak(ws, "Plain audio frames.")
        heard = (await listen(ws, 1))[1]
    assert len(heard.audio) == heard.done["metrics"]["frames"] * FRAME * 2 > 0


async def test_cancel_stops_the_utterance_promptly_and_the_session_goes_on(
    server: RunningServer, server_engine: Engine  # noqa: F811
) -> None:
    before = metric(await get_metrics(server), "qwen3tts_cancels_total", reason="client")
    async with ws_connect(server) as ws:
        await start_session(ws, sampling=LONG)
        await speak(ws, "This would go on for a very long time.")
        first = await recv_json(ws)
        assert first["type"] == "audio"
        await ws.recv()
        sent = time.perf_counter()
        await send_json(ws, {"type": "cancel"})
        late_audio = 0
        while (msg := await recv_json(ws))["type"] != "done":
            assert msg["type"] == "audio"
            await ws.recv()
            late_audio += 1
        elapsed = time.perf_counter() - sent
        assert msg["finish_reason"] == "cancelled"
        assert msg["metrics"]["cancel_latency_s"] < 0.5 and elapsed < 1.0
        assert msg["metrics"]["frames"] < LONG["max_frames"] and late_audio <= 2
        await async_wait_for(lambda: server_engine.stats().active_streams == 0, 2, "engine stream released")

        await send_json(ws, {"type": "text", "text": "And now something short."})
        await send_json(ws, {"type": "flush"})
        # the session's sampling is LONG, so this one is cut short too; it must start as utterance 2
        audio = await recv_json(ws)
        assert audio["type"] == "audio" and audio["utterance_id"] == 2
        await ws.recv()
        await send_json(ws, {"type": "cancel"})
        while (msg := await recv_json(ws))["type"] != "done":
            await ws.recv()
        assert msg["utterance_id"] == 2 and msg["finish_reason"] == "cancelled"
    after = metric(await get_metrics(server), "qwen3tts_cancels_total", reason="client")
    assert after == before + 2


DOOMED = 4


async def test_abrupt_disconnect_cancels_the_engine_request_and_spares_others(
    server: RunningServer, server_engine: Engine  # noqa: F811
) -> None:
    before = metric(await get_metrics(server), "qwen3tts_cancels_total", reason="disconnect")
    engine_cancels = server_engine.stats().cancels
    async with ws_connect(server) as other:
        await start_session(other, sampling={"max_frames": 30, "ignore_eos": True, "seed": 5})
        await speak(other, "I keep talking while the other client vanishes.")
        # Several, while their audio flows: the server may learn of a departure from the reader or from a
        # failed send; either way each counts once as a cancel by disconnect.
        for _ in range(DOOMED):
            async with ws_connect(server) as doomed:
                await start_session(doomed, sampling=LONG)
                await speak(doomed, "Nobody will hear the end of this.")
                assert (await recv_json(doomed))["type"] == "audio"
                doomed.transport.abort()  # no close frame: the TCP connection just drops
        await async_wait_for(lambda: server_engine.stats().cancels >= engine_cancels + DOOMED, 5, "engine cancels")
        heard = (await listen(other, 1))[1]
    assert heard.done["finish_reason"] == "max_frames" and heard.done["metrics"]["frames"] == 30
    assert len(heard.audio) == 30 * FRAME * 2
    await async_wait_for(lambda: server_engine.stats().active_streams == 0, 2, "engine idle")
    assert metric(await get_metrics(server), "qwen3tts_cancels_total", reason="disconnect") == before + DOOMED


async def test_openai_speech_streams_pcm_and_wav(server: RunningServer) -> None:
    body = {"model": "tts-1", "input": "Streaming over plain HTTP.", "voice": "alloy", "sampling": {"max_frames": 24}}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream(
            "POST", f"{server.http_url}/v1/audio/speech", headers=AUTH, json={**body, "response_format": "pcm"}
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "audio/pcm"
            assert "content-length" not in response.headers  # chunked: audio leaves as it is made
            stages = json.loads(response.headers["x-first-chunk-stages"])
            pieces = [piece async for piece in response.aiter_raw()]
        pcm = b"".join(pieces)
        assert len(pieces) >= 2 and len(pcm) > 0 and len(pcm) % (FRAME * 2) == 0
        # where the first chunk's time went, in order, each stage a real span
        assert list(stages) == ["request", "handoff", "admission", "prompt", "first_frame", "decode", "delivery"]
        assert all(v >= 0 for v in stages.values()) and stages["first_frame"] > 0

        response = await client.post(
            f"{server.http_url}/v1/audio/speech", headers=AUTH, json={**body, "response_format": "wav"}
        )
        assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
        wav = response.content
        assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
        channels, rate, _, _, bits = struct.unpack("<HIIHH", wav[22:36])
        assert (channels, rate, bits) == (1, 24000, 16)
        assert wav[36:40] == b"data" and len(wav[44:]) > 0 and len(wav[44:]) % (FRAME * 2) == 0


async def test_openai_client_works_unchanged(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    # a bare request (no extension fields) on a server whose frame cap keeps random weights short
    with running_server(make_config(tmp_path, max_frames=10), engine=server_engine) as srv:
        base_url = f"{srv.http_url}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as client:
            async with client.audio.speech.with_streaming_response.create(
                model="gpt-4o-mini-tts", voice="alloy", input="Existing clients work unchanged.", response_format="pcm"
            ) as response:
                pcm = await response.read()
            assert 0 < len(pcm) <= 10 * FRAME * 2 and len(pcm) % (FRAME * 2) == 0

            with pytest.raises(openai.BadRequestError) as bad:
                await client.audio.speech.create(model="tts-1", voice="alloy", input="Faster!", speed=1.5)
            assert bad.value.code == "unsupported_parameter" and bad.value.param == "speed"
            with pytest.raises(openai.BadRequestError) as unknown:
                await client.audio.speech.create(model="tts-1", voice="nobody", input="Who?")
            assert unknown.value.code == "unknown_voice"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as wrong_key:
            with pytest.raises(openai.AuthenticationError):
                await wrong_key.audio.speech.create(model="tts-1", voice="alloy", input="Let me in.")


async def test_http_client_leaving_mid_stream_cancels_the_engine_request(
    server: RunningServer, server_engine: Engine  # noqa: F811
) -> None:
    before = metric(await get_metrics(server), "qwen3tts_cancels_total", reason="disconnect")
    body = {"model": "tts-1", "input": "A very long answer.", "response_format": "pcm", "sampling": LONG}
    url = f"{server.http_url}/v1/audio/speech"
    async with httpx.AsyncClient(timeout=30) as client, client.stream("POST", url, headers=AUTH, json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_raw():
            break
    await async_wait_for(lambda: server_engine.stats().active_streams == 0, 3, "engine stream cancelled")
    after = metric(await get_metrics(server), "qwen3tts_cancels_total", reason="disconnect")
    assert after == before + 1


async def test_registered_voices_survive_a_restart(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    config = make_config(tmp_path / "voices")
    registration = {"audio": base64.b64encode(reference_wav()).decode(), "ref_text": "A reference.", "name": "alice"}
    with running_server(config, engine=server_engine) as srv:
        async with httpx.AsyncClient(base_url=srv.http_url, headers=AUTH, timeout=30) as client:
            created = await client.post("/v1/voices", json=registration)
            assert created.status_code == 201, created.text
            alice = created.json()
            assert alice["name"] == "alice" and alice["ref_text"] == "A reference." and not alice["x_vector_only"]
            again = await client.post("/v1/voices", json=registration)  # same reference: same voice
            assert again.status_code == 200 and again.json() == alice
            other = {**registration, "audio": base64.b64encode(reference_wav(pitch=200.0)).decode()}
            clash = await client.post("/v1/voices", json=other)
            assert clash.status_code == 409 and clash.json()["error"]["code"] == "conflict"
            listed = (await client.get("/v1/voices")).json()
            assert listed["voices"] == [alice] and listed["default_voice"] == "default"
            assert "alloy" in listed["openai_voices"] and listed["speakers"] == []
        async with ws_connect(srv) as ws:
            ready = await start_session(ws, voice="alice", sampling=SHORT)
            assert ready["voice"] == alice["voice_id"]
            await speak(ws, "Speaking with a cloned voice.")
            assert (await listen(ws, 1))[1].done["finish_reason"] in ("eos", "max_frames")

    with running_server(config, engine=server_engine) as srv:
        async with httpx.AsyncClient(base_url=srv.http_url, headers=AUTH, timeout=30) as client:
            assert (await client.get("/v1/voices")).json()["voices"] == [alice]
            assert (await client.get(f"/v1/voices/{alice['voice_id']}")).json() == alice
            speech = {"model": "tts-1", "input": "Still here.", "voice": "ALICE", "sampling": SHORT}
            response = await client.post("/v1/audio/speech", json=speech)
            assert response.status_code == 200 and len(response.content) > 44
            assert (await client.delete("/v1/voices/alice")).status_code == 204
            assert (await client.get("/v1/voices/alice")).status_code == 404
            assert (await client.delete("/v1/voices/alice")).status_code == 404
            gone = await client.post("/v1/audio/speech", json=speech)
            assert gone.status_code == 400 and gone.json()["error"]["code"] == "unknown_voice"

    with running_server(config, engine=server_engine) as srv:
        async with httpx.AsyncClient(base_url=srv.http_url, headers=AUTH) as client:
            assert (await client.get("/v1/voices")).json()["voices"] == []
    assert [p.name for p in config.voices_dir.iterdir()] == []  # no staging or trash folders left behind


async def test_default_voice_from_a_reference_file_or_a_name(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    reference = tmp_path / "me.wav"
    reference.write_bytes(reference_wav(pitch=180.0))
    config = make_config(tmp_path / "voices", default_voice_audio=reference, default_voice_text="It is me.")
    with running_server(config, engine=server_engine) as srv:
        async with httpx.AsyncClient(base_url=srv.http_url, headers=AUTH) as client:
            listed = (await client.get("/v1/voices")).json()
        (record,) = listed["voices"]
        assert listed["default_voice"] == record["voice_id"] and record["ref_text"] == "It is me."
        async with ws_connect(srv) as ws:  # OpenAI names and sessions naming no voice get it
            assert (await start_session(ws, voice="nova"))["voice"] == record["voice_id"]

    named = make_config(tmp_path / "voices", default_voice=record["voice_id"])
    with running_server(named, engine=server_engine) as srv:
        async with ws_connect(srv) as ws:
            assert (await start_session(ws))["voice"] == record["voice_id"]

    missing = make_config(tmp_path / "voices", default_voice="nobody")
    with running_server(missing, engine=server_engine, wait_ready=False) as srv:
        await async_wait_for(lambda: srv.state.failure is not None, 5, "startup failure")
        assert "nobody" in srv.state.failure


async def test_voice_registration_rejects_bad_references(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH, timeout=30) as client:
        cases = [
            ({"audio": "%%% not base64 %%%", "ref_text": "x"}, "invalid_message"),
            ({"audio": base64.b64encode(b"not a sound file").decode(), "ref_text": "x"}, "invalid_reference_audio"),
            ({"audio": base64.b64encode(reference_wav()).decode()}, "invalid_message"),  # no ref_text
            ({"audio": "", "ref_text": "x", "name": "../../etc"}, "invalid_message"),
            ({"audio": "", "ref_text": "x", "colour": "blue"}, "invalid_message"),
        ]
        for body, code in cases:
            response = await client.post("/v1/voices", json=body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["code"] == code, response.text
        assert (await client.get("/v1/voices")).json()["voices"] == []


async def test_health_ready_and_metrics_follow_startup(tmp_path: Path) -> None:
    gate = threading.Event()

    def load() -> Engine:
        assert gate.wait(30)
        return Engine.load(ENGINE_SPEC, device="cpu", progress=False)

    server = RunningServer(make_config(tmp_path, warmup=True), engine_factory=load)
    server.start(wait_ready=False)
    try:
        async with httpx.AsyncClient(base_url=server.http_url, headers=AUTH, timeout=30) as client:
            assert (await client.get("/health")).json() == {"status": "ok"}
            starting = await client.get("/ready")
            assert starting.status_code == 503 and starting.json()["status"] == "starting"
            busy = await client.post("/v1/audio/speech", json={"model": "m", "input": "Too early."})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "not_ready"
            assert busy.headers["retry-after"] == "1"
            with pytest.raises(InvalidStatus) as refused:
                async with ws_connect(server):
                    pass
            assert refused.value.response.status_code == 503
            gate.set()
            await async_wait_for(lambda: server.state.ready, 60, "load and warm-up")
            ready = await client.get("/ready")
            assert ready.status_code == 200 and ready.json() == {"status": "ready", "model": ENGINE_SPEC}
            text = (await client.get("/metrics")).text
            assert metric(text, "qwen3tts_engine_max_streams") == 16
            assert metric(text, "qwen3tts_engine_frames_generated") >= 4  # the warm-up utterance
            # the warm-up's chunks went through the codec; a CPU has no early lane
            assert metric(text, "qwen3tts_engine_codec_decodes") >= 1
            assert metric(text, "qwen3tts_engine_early_codec_decodes") == 0
            late = [metric(text, "qwen3tts_engine_late_chunks_by_index", index=i) for i in ("1", "2", "3", "4+")]
            assert "qwen3tts_engine_late_chunks_by_index" in text
            assert sum(late) == metric(text, "qwen3tts_engine_late_chunks")
            causes = [metric(text, "qwen3tts_engine_late_chunks_by_cause", cause=c) for c in ("frames", "decode")]
            assert sum(causes) == metric(text, "qwen3tts_engine_late_chunks")
            assert metric(text, "qwen3tts_errors_total", code="not_ready") == 2
            assert (await client.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
    finally:
        server.stop()


async def test_a_failed_model_load_reports_not_ready(tmp_path: Path) -> None:
    def load() -> Engine:
        raise ModelLoadError("no such checkpoint")

    with running_server(make_config(tmp_path), engine_factory=load, wait_ready=False) as srv:
        await async_wait_for(lambda: srv.state.failure is not None, 5, "startup failure")
        async with httpx.AsyncClient(base_url=srv.http_url, headers=AUTH) as client:
            assert (await client.get("/health")).status_code == 200
            ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "failed"
            assert "no such checkpoint" in ready.json()["error"]


async def test_customvoice_speakers_are_voices(pytestconfig: pytest.Config, tmp_path: Path) -> None:
    engine = shared_engine(pytestconfig, "synthetic:tiny-customvoice")
    speakers = engine.speakers
    assert len(speakers) >= 2
    with running_server(make_config(tmp_path), engine=engine) as srv:
        async with httpx.AsyncClient(base_url=srv.http_url, headers=AUTH, timeout=30) as client:
            listed = (await client.get("/v1/voices")).json()
            assert listed["speakers"] == speakers and listed["default_voice"] == speakers[0]
            for voice in (speakers[1].upper(), "alloy"):  # a speaker by name, and OpenAI's name -> the default
                body = {"model": "tts-1", "input": "Named speakers.", "voice": voice, "sampling": SHORT}
                response = await client.post("/v1/audio/speech", json=body)
                assert response.status_code == 200 and len(response.content) > 44, response.text
            cloning = await client.post("/v1/voices", json={"audio": "", "ref_text": "x", "x_vector_only": True})
            assert cloning.status_code == 400 and cloning.json()["error"]["code"] == "unsupported_feature"
        async with ws_connect(srv) as ws:
            assert (await start_session(ws, voice=speakers[1], sampling=SHORT))["voice"] == speakers[1]
            await speak(ws, "A named speaker over the socket.")
            assert (await listen(ws, 1))[1].done["finish_reason"] in ("eos", "max_frames")
