"""The LiveKit plugin against a real server, driven through LiveKit's own TTS stream API."""

from __future__ import annotations

import asyncio
import socket
import typing
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from livekit.agents import APIConnectionError, APIConnectOptions, APIStatusError
from livekit.agents.metrics import TTSMetrics
from livekit.agents.tts import TTSError

from qwen3tts_agent import Engine
from qwen3tts_agent.livekit import TTS, protocol
from qwen3tts_agent.server.protocol import AudioFormat
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


def plugin(server: RunningServer, **kwargs: typing.Any) -> TTS:
    options: dict[str, typing.Any] = dict(base_url=server.http_url, api_key=API_KEY, seed=1, max_frames=10)
    options.update(kwargs)
    return TTS(**options)


class CountingProxy:
    """A TCP relay in front of the server that counts the connections clients open and can cut them all.

    It shows from outside the plugin how many server sessions it opened, and breaks a pooled connection the
    way a network failure or a server restart does.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.accepted = 0
        self._links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"ws://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._links.append((client_w, server_w))

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))

    def cut(self) -> None:
        """Drop every relayed connection at once, without a WebSocket close handshake."""
        for client_w, server_w in self._links:
            client_w.transport.abort()
            server_w.transport.abort()

    async def aclose(self) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
async def proxy(server: RunningServer) -> AsyncIterator[CountingProxy]:
    relay = CountingProxy(server.port)
    await relay.start()
    yield relay
    await relay.aclose()


async def speak(tts: TTS, text: str) -> int:
    """Stream `text` as two deltas through `tts.stream()`; the samples received."""
    async with tts.stream(conn_options=NO_RETRY) as stream:
        stream.push_text(text[: len(text) // 2])
        stream.push_text(text[len(text) // 2 :])
        stream.end_input()
        return sum([ev.frame.samples_per_channel async for ev in stream])


Closing = typing.Callable[[TTS], TTS]


@pytest.fixture
async def closing() -> AsyncIterator[Closing]:
    """Registers TTS objects to close (their pooled server sessions with them) when the test ends."""
    made: list[TTS] = []

    def register(tts: TTS) -> TTS:
        made.append(tts)
        return tts

    yield register
    for tts in made:
        await tts.aclose()


async def cancels(server: RunningServer, reason: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{server.http_url}/metrics", headers=AUTH)).text
    return metric(text, "qwen3tts_cancels_total", reason=reason)


async def test_stream_forwards_deltas_as_they_come_and_emits_metrics(server: RunningServer, closing: Closing) -> None:
    tts = closing(plugin(server, language="en"))
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


async def test_synthesize_whole_text_resampled(server: RunningServer, closing: Closing) -> None:
    tts = closing(plugin(server, sample_rate=16000, max_frames=6))
    async with tts.synthesize("The whole sentence at once.", conn_options=NO_RETRY) as stream:
        frame = await stream.collect()
    assert frame.sample_rate == 16000 and frame.num_channels == 1
    assert 0 < frame.samples_per_channel <= 6 * 1280 and frame.samples_per_channel % 1280 == 0  # whole frames


async def test_interruption_cancels_the_server_utterance_and_keeps_the_session(
    server: RunningServer, server_engine: Engine, proxy: CountingProxy, closing: Closing  # noqa: F811
) -> None:
    before = await cancels(server, "client")
    tts = closing(plugin(server, base_url=proxy.url, max_frames=300, ignore_eos=True))
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text("A long answer the user is about to interrupt.")
    stream.flush()
    await asyncio.wait_for(stream.__anext__(), 15)
    assert server_engine.stats().active_streams == 1
    await stream.aclose()  # what the agent session does on barge-in
    await async_wait_for(lambda: server_engine.stats().active_streams == 0, 3, "server utterance stopped")
    assert await cancels(server, "client") == before + 1
    # the interrupted session is drained (its utterance's done read) in the background, then serves the next turn
    await async_wait_for(lambda: not tts._recycling, 3, "the interrupted session back in the pool")
    tts.update_options(language="auto")  # unchanged options: the pool keeps its sessions
    assert await speak(tts, "The next turn, on the same session.") > 0
    assert proxy.accepted == 1


async def test_a_stream_cancelled_again_while_it_tears_down_still_hands_its_session_back(
    server: RunningServer, server_engine: Engine, proxy: CountingProxy, closing: Closing  # noqa: F811
) -> None:
    """A barge-in cancels the stream's task; a second cancel (the agent closing too) that lands while the stream
    waits for its sender and receiver to end must not skip handing its session back: else the session stays open
    on the server, out of the pool, until the server's idle timeout. The second cancel comes 1, 2, ... turns of
    the event loop after the first; some of those land inside that wait (with this LiveKit, the third and the
    fourth did, and the session was left behind before the fix)."""
    tts = closing(plugin(server, base_url=proxy.url, max_frames=300, ignore_eos=True))
    for turns in range(1, 7):
        stream = tts.stream(conn_options=NO_RETRY)
        stream.push_text("A long answer the user is about to interrupt.")
        stream.flush()
        await asyncio.wait_for(stream.__anext__(), 15)
        stream._task.cancel()  # LiveKit's own main task, as its aclose cancels it
        for _ in range(turns):
            await asyncio.sleep(0)
        stream._task.cancel()
        await stream.aclose()
        await async_wait_for(lambda: server_engine.stats().active_streams == 0, 3, "server utterance stopped")
        await async_wait_for(lambda: not tts._recycling, 3, "the interrupted session back in the pool")
        assert proxy.accepted == 1, f"a session was left behind (seen with the second cancel {turns} turns late)"
    assert await speak(tts, "The next turn, on the same session.") > 0
    assert proxy.accepted == 1


async def test_errors_map_to_livekit_api_errors(server: RunningServer, closing: Closing) -> None:
    errors: list[TTSError] = []

    async def failure(tts: TTS) -> BaseException:
        closing(tts)
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


async def test_busy_server_is_retried_by_the_framework(
    server_engine: Engine, tmp_path: Path, closing: Closing  # noqa: F811
) -> None:
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
            await tts.aclose()
        assert frame.samples_per_channel > 0
        first = errors[0]
        assert first.recoverable and isinstance(first.error, APIStatusError)
        assert first.error.status_code == 503 and first.error.retryable


# ---------------------------------------------------------------------- the session pool
async def test_sessions_are_reused_across_streams(
    server: RunningServer, proxy: CountingProxy, closing: Closing
) -> None:
    tts = closing(plugin(server, base_url=proxy.url))
    assert await speak(tts, "First turn of the call.") > 0
    async with tts.synthesize("Second turn, whole text.", conn_options=NO_RETRY) as chunked:
        assert (await chunked.collect()).samples_per_channel > 0
    assert await speak(tts, "Third turn of the call.") > 0
    assert proxy.accepted == 1
    # two streams at once need two sessions; both stay in the pool for later turns
    both = await asyncio.gather(speak(tts, "One at a time?"), speak(tts, "No, two together."))
    assert all(both) and proxy.accepted == 2
    assert await speak(tts, "And back to one.") > 0
    assert proxy.accepted == 2


async def test_prewarm_opens_one_session_and_aclose_closes_them(
    server: RunningServer, proxy: CountingProxy
) -> None:
    # the earlier tests' plugins are closed, but their sessions end on the server a moment later
    await async_wait_for(lambda: server.state.sessions == 0, 10, "the earlier tests' sessions closed")
    before = server.state.sessions
    tts = plugin(server, base_url=proxy.url)
    tts.prewarm()
    await async_wait_for(lambda: server.state.sessions == before + 1, 10, "the prewarmed session")
    tts.prewarm()  # one is there already: nothing more opens
    assert await speak(tts, "The first turn starts on the prewarmed session.") > 0
    assert proxy.accepted == 1
    await asyncio.gather(speak(tts, "Turn A."), speak(tts, "Turn B."))
    assert server.state.sessions == before + 2
    await tts.aclose()
    await async_wait_for(lambda: server.state.sessions == before, 5, "every pooled session closed")


async def test_a_broken_pooled_session_is_replaced(
    server: RunningServer, proxy: CountingProxy, closing: Closing
) -> None:
    tts = closing(plugin(server, base_url=proxy.url))
    assert await speak(tts, "Before the network drops.") > 0
    proxy.cut()  # the pooled session's TCP connection is gone, with no close handshake
    await asyncio.sleep(0.1)
    assert await speak(tts, "After it, on a new session.") > 0
    assert proxy.accepted == 2


async def test_a_session_the_server_closed_for_idleness_is_replaced(
    server_engine: Engine, tmp_path: Path, closing: Closing  # noqa: F811
) -> None:
    with running_server(make_config(tmp_path, idle_timeout_s=0.5), engine=server_engine) as srv:
        tts = closing(plugin(srv))
        assert await speak(tts, "Then the caller goes quiet.") > 0
        await async_wait_for(lambda: srv.state.sessions == 0, 5, "the server closing the idle session")
        assert await speak(tts, "And comes back.") > 0
        await tts.aclose()


async def test_options_are_snapshotted_per_stream(
    server: RunningServer, proxy: CountingProxy, closing: Closing
) -> None:
    tts = closing(plugin(server, base_url=proxy.url))
    assert await speak(tts, "Warm the pool with the default voice.") > 0
    earlier = tts.stream(conn_options=NO_RETRY)
    tts.update_options(voice="nobody")  # pooled sessions carry the old voice: retired
    earlier.push_text("Created before the change, so spoken with the old voice.")
    earlier.end_input()
    assert sum([ev.frame.samples_per_channel async for ev in earlier]) > 0
    await earlier.aclose()
    with pytest.raises(APIStatusError) as caught:
        await speak(tts, "Created after it, with the unknown voice.")
    assert caught.value.status_code == 400 and "nobody" in caught.value.message
    tts.update_options(voice=None)
    assert await speak(tts, "The default voice again.") > 0


def test_wire_constants_match_the_server(server_engine: Engine) -> None:  # noqa: F811
    server_rates = typing.get_args(AudioFormat.model_fields["sample_rate"].annotation)
    assert server_rates == protocol.SAMPLE_RATES
    assert protocol.ENCODING in typing.get_args(AudioFormat.model_fields["encoding"].annotation)
    assert set(protocol.ISO_LANGUAGES.values()) <= set(server_engine.languages)
    assert protocol.language_name("en-US") == protocol.language_name("English") == "english"
    assert protocol.stream_url("https://tts.example:8443/") == "wss://tts.example:8443/v1/stream"
