"""The LiveKit plugin against a real server, driven through LiveKit's own TTS stream API."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest
from livekit.agents import APIConnectionError, APIConnectOptions, APIStatusError
from livekit.agents.metrics import TTSMetrics
from livekit.agents.tts import TTSError

from qwen3tts_agent import Engine
from qwen3tts_agent.livekit import TTS
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

NO_RETRY = APIConnectOptions(max_retry=0, timeout=10)
FRAME = 1920


@pytest.fixture(scope="module")
def server(server_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:  # noqa: F811
    with running_server(make_config(tmp_path_factory.mktemp("voices")), engine=server_engine) as srv:
        yield srv


def plugin(server: RunningServer, **kwargs: object) -> TTS:
    options: dict[str, object] = dict(base_url=server.http_url, api_key=API_KEY, seed=1, max_frames=10)
    options.update(kwargs)
    return TTS(**options)  # type: ignore[arg-type]


async def cancels(server: RunningServer, reason: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{server.http_url}/metrics", headers=AUTH)).text
    return metric(text, "qwen3tts_cancels_total", reason=reason)


async def test_stream_forwards_deltas_as_they_come_and_emits_metrics(server: RunningServer) -> None:
    tts = plugin(server, language="en")
    collected: list[TTSMetrics] = []
    tts.on("metrics_collected", collected.append)
    words = ["Hello", "from", "a", "LiveKit", "agent,", "speaking", "as", "the", "model", "writes."]
    async with tts.stream(conn_options=NO_RETRY) as stream:
        for word in words[:3]:
            stream.push_text(word + " ")
        # audio starts while the "LLM" is still writing: deltas are not held back for the whole text
        first = await asyncio.wait_for(stream.__anext__(), 15)
        for word in words[3:]:
            stream.push_text(word + " ")
        stream.end_input()
        events = [first] + [ev async for ev in stream]

    frames = [ev.frame for ev in events]
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in frames)
    samples = sum(f.samples_per_channel for f in frames)
    assert 0 < samples <= 10 * FRAME and samples % FRAME == 0
    assert [ev.is_final for ev in events] == [False] * (len(events) - 1) + [True]
    assert len({ev.segment_id for ev in events}) == 1 and len({ev.request_id for ev in events}) == 1
    assert len(collected) == 1
    m = collected[0]
    assert m.streamed and 0 < m.ttfb < m.duration
    assert m.audio_duration == pytest.approx(samples / 24000)
    assert m.characters_count == sum(len(w) + 1 for w in words)


async def test_synthesize_whole_text_resampled(server: RunningServer) -> None:
    tts = plugin(server, sample_rate=16000, max_frames=6)
    async with tts.synthesize("The whole sentence at once.", conn_options=NO_RETRY) as stream:
        frame = await stream.collect()
    assert frame.sample_rate == 16000 and frame.num_channels == 1
    assert 0 < frame.samples_per_channel <= 6 * 1280 and frame.samples_per_channel % 1280 == 0  # whole frames


async def test_interruption_cancels_the_server_utterance(
    server: RunningServer, server_engine: Engine  # noqa: F811
) -> None:
    before = await cancels(server, "client")
    tts = plugin(server, max_frames=300, ignore_eos=True)
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("A long answer the user is about to interrupt.")
    stream.flush()
    await asyncio.wait_for(stream.__anext__(), 15)
    assert server_engine.stats().active_streams == 1
    await stream.aclose()  # what the agent session does on barge-in
    await async_wait_for(lambda: server_engine.stats().active_streams == 0, 3, "server utterance stopped")
    assert await cancels(server, "client") == before + 1


async def test_errors_map_to_livekit_api_errors(server: RunningServer) -> None:
    errors: list[TTSError] = []

    async def failure(tts: TTS) -> BaseException:
        tts.on("error", errors.append)
        with pytest.raises((APIStatusError, APIConnectionError)) as caught:
            async with tts.synthesize("Hello?", conn_options=NO_RETRY) as stream:
                await stream.collect()
        return caught.value

    unauthorized = await failure(plugin(server, api_key="wrong"))
    assert isinstance(unauthorized, APIStatusError) and unauthorized.status_code == 401
    assert not unauthorized.retryable
    unknown = await failure(plugin(server, voice="nobody"))
    assert isinstance(unknown, APIStatusError) and unknown.status_code == 400 and not unknown.retryable
    assert "nobody" in unknown.message

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    unreachable = await failure(TTS(base_url=f"ws://127.0.0.1:{closed_port}"))
    assert type(unreachable) is APIConnectionError and unreachable.retryable
    assert len(errors) == 3 and not any(e.recoverable for e in errors)


async def test_busy_server_is_retried_by_the_framework(server_engine: Engine, tmp_path: Path) -> None:  # noqa: F811
    config = make_config(tmp_path, max_active_streams=1, max_queued=0)
    with running_server(config, engine=server_engine) as srv:
        async with ws_connect(srv) as hog:
            await start_session(hog, sampling={"max_frames": 300, "ignore_eos": True, "seed": 1})
            await send_json(hog, {"type": "text", "text": "I hold the only slot."})
            assert (await recv_json(hog))["type"] == "audio"

            tts = plugin(srv)
            errors: list[TTSError] = []
            released = asyncio.Event()

            def on_error(err: TTSError) -> None:
                errors.append(err)
                released.set()

            tts.on("error", on_error)

            async def release_after_first_failure() -> None:
                await released.wait()
                await send_json(hog, {"type": "cancel"})

            releaser = asyncio.create_task(release_after_first_failure())
            retrying = APIConnectOptions(max_retry=3, retry_interval=0.3, timeout=10)
            async with tts.synthesize("Second try works.", conn_options=retrying) as stream:
                frame = await stream.collect()
            await releaser
        assert frame.samples_per_channel > 0
        first = errors[0]
        assert first.recoverable and isinstance(first.error, APIStatusError)
        assert first.error.status_code == 503 and first.error.retryable
