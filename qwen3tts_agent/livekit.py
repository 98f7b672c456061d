"""LiveKit Agents TTS plugin: a thin client of `qwen3tts-agent serve`, so every agent job shares one engine.

LiveKit runs each job in its own process; loading the model per job would multiply GPU memory. The server
holds the weights once and this plugin streams to it over the WebSocket protocol (docs/server.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

try:
    from livekit.agents import (
        DEFAULT_API_CONNECT_OPTIONS,
        NOT_GIVEN,
        APIConnectionError,
        APIConnectOptions,
        APIError,
        APIStatusError,
        APITimeoutError,
        NotGivenOr,
        tts,
        utils,
    )
    from websockets.asyncio.client import ClientConnection, connect
    from websockets.exceptions import (
        ConnectionClosed,
        ConnectionClosedOK,
        InvalidHandshake,
        InvalidStatus,
        InvalidURI,
    )
except ImportError:
    logger.error('The LiveKit plugin needs its extra: pip install "qwen3tts-agent[livekit]"')
    raise

SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)

# LiveKit and most STT stacks speak ISO 639-1 codes; the model's language ids are English names.
_ISO_LANGUAGES = {
    "en": "english",
    "zh": "chinese",
    "de": "german",
    "es": "spanish",
    "fr": "french",
    "it": "italian",
    "ja": "japanese",
    "ko": "korean",
    "pt": "portuguese",
    "ru": "russian",
}


def _language_name(language: str) -> str:
    """'en', 'en-US' and 'English' all mean english; unknown values go to the server, which names what it knows."""
    code = language.strip().lower()
    return _ISO_LANGUAGES.get(code.split("-")[0], code)


def _stream_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    if url.startswith("http"):  # http -> ws, https -> wss
        url = "ws" + url[4:]
    return url if url.endswith("/v1/stream") else f"{url}/v1/stream"


@dataclass
class _Options:
    url: str
    api_key: str | None
    voice: str | None
    language: str
    instruct: str | None
    sample_rate: int
    sampling: dict[str, Any] = field(default_factory=dict)
    chunk_schedule: list[int] | None = None

    def start_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "type": "start",
            "language": self.language,
            "audio_format": {"encoding": "pcm_s16le", "sample_rate": self.sample_rate},
            "sampling": self.sampling,
        }
        if self.voice:
            msg["voice"] = self.voice
        if self.instruct:
            msg["instruct"] = self.instruct
        if self.chunk_schedule:
            msg["chunk_schedule"] = self.chunk_schedule
        return msg


class TTS(tts.TTS):
    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        voice: str | None = None,
        language: str = "auto",
        instruct: str | None = None,
        sample_rate: int = 24000,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        max_frames: int | None = None,
        ignore_eos: bool = False,
        chunk_schedule: list[int] | None = None,
    ) -> None:
        """Streaming TTS through a qwen3tts-agent server.

        Args:
            base_url: Server address, e.g. ``ws://tts-host:8000`` (default: ``$QWEN3TTS_URL`` or loopback).
            api_key: Bearer token (default: ``$QWEN3TTS_API_KEY``).
            voice: Registered voice id/name or CustomVoice speaker (default: the server's default voice).
            language: Model language name or ISO code (``"en"``), or ``"auto"``.
            instruct: Style instruction (VoiceDesign and 1.7B CustomVoice models).
            sample_rate: Output rate; the server resamples from 24 kHz.
            temperature: Sampling temperature (server default when None); likewise top_k, top_p, seed.
            max_frames: Cap on each utterance's length in 80 ms frames.
            ignore_eos: Always generate `max_frames` frames (fixed-length runs for benchmarks and tests).
            chunk_schedule: Frames per audio chunk, e.g. ``[1, 2, 4, 8]``: small first chunks start playback sooner.
        """
        if sample_rate not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {SAMPLE_RATES}")
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True), sample_rate=sample_rate, num_channels=1
        )
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "max_frames": max_frames}
        if ignore_eos:
            sampling["ignore_eos"] = True
        self._opts = _Options(
            url=_stream_url(base_url or os.environ.get("QWEN3TTS_URL", "ws://127.0.0.1:8000")),
            api_key=api_key or os.environ.get("QWEN3TTS_API_KEY"),
            voice=voice,
            language=_language_name(language),
            instruct=instruct,
            sample_rate=sample_rate,
            sampling={k: v for k, v in sampling.items() if v is not None},
            chunk_schedule=chunk_schedule,
        )

    @property
    def model(self) -> str:
        return "qwen3-tts"

    @property
    def provider(self) -> str:
        return "qwen3tts-agent"

    def update_options(
        self,
        *,
        voice: NotGivenOr[str | None] = NOT_GIVEN,
        language: NotGivenOr[str] = NOT_GIVEN,
        instruct: NotGivenOr[str | None] = NOT_GIVEN,
    ) -> None:
        """Change the voice for streams created from now on; streams already running keep theirs."""
        if utils.is_given(voice):
            self._opts.voice = voice
        if utils.is_given(language):
            self._opts.language = _language_name(language)
        if utils.is_given(instruct):
            self._opts.instruct = instruct

    def _snapshot(self) -> _Options:
        return dataclasses.replace(self._opts, sampling=dict(self._opts.sampling))

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options, opts=self._snapshot())

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        return SynthesizeStream(tts=self, conn_options=conn_options, opts=self._snapshot())


class _Session:
    """One server session: connect, `start`, then the server's messages in order, as LiveKit API errors."""

    def __init__(self, ws: ClientConnection, timeout: float) -> None:
        self._ws = ws
        self._timeout = timeout
        self.open_utterances = 0  # utterances with text sent and no `done` yet: only then is silence a timeout

    @classmethod
    async def open(cls, opts: _Options, timeout: float) -> _Session:
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        try:
            ws = await connect(
                opts.url,
                additional_headers=headers,
                open_timeout=timeout,
                close_timeout=1,
                max_size=8 * 1024 * 1024,
                proxy=None,
            )
        except InvalidStatus as exc:
            raise _handshake_error(exc) from exc
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise APITimeoutError(f"connecting to {opts.url} timed out") from exc
        except (OSError, InvalidHandshake, InvalidURI) as exc:
            raise APIConnectionError(f"cannot connect to the TTS server at {opts.url}") from exc
        session = cls(ws, timeout)
        try:
            await session.send(opts.start_message())
            ready = await session._recv_json(expected=True)
            if ready.get("type") == "error":
                raise _server_error(ready)
            if ready.get("type") != "ready":
                raise APIError(f"unexpected first message from the TTS server: {ready}")
        except BaseException:
            await session.aclose(cancel=False)
            raise
        return session

    async def send(self, body: dict[str, Any]) -> None:
        try:
            await self._ws.send(json.dumps(body))
        except ConnectionClosed as exc:
            raise APIConnectionError("the TTS server closed the connection") from exc

    async def _recv(self, *, expected: bool = False) -> str | bytes:
        """The next message. Silence is a timeout only when an answer is due (`expected`, or audio owed)."""
        while True:
            try:
                return await asyncio.wait_for(self._ws.recv(), self._timeout)
            except (asyncio.TimeoutError, TimeoutError):
                if expected or self.open_utterances > 0:
                    raise APITimeoutError(f"no answer from the TTS server for {self._timeout:g}s") from None
                # waiting for our own text (an LLM still thinking) is not the server's fault

    async def _recv_json(self, *, expected: bool = False) -> dict[str, Any]:
        message = await self._recv(expected=expected)
        if not isinstance(message, str):
            raise APIError("protocol error: audio without its header")
        return json.loads(message)

    async def messages(self) -> AsyncIterator[tuple[dict[str, Any], bytes]]:
        """(header, payload) per audio chunk, (message, b"") otherwise; ends when the server closes normally."""
        try:
            while True:
                msg = await self._recv_json()
                if msg.get("type") == "audio":
                    payload = await self._recv(expected=True)
                    if not isinstance(payload, bytes):
                        raise APIError("protocol error: audio header without its payload")
                    yield msg, payload
                else:
                    if msg.get("type") == "done":
                        self.open_utterances -= 1
                    yield msg, b""
        except ConnectionClosedOK:
            return
        except ConnectionClosed as exc:
            raise APIConnectionError("lost the connection to the TTS server") from exc

    async def aclose(self, *, cancel: bool) -> None:
        """Close; with `cancel`, first tell the server to stop the utterance so its GPU slot frees at once."""
        try:
            if cancel:
                await asyncio.wait_for(self._ws.send(json.dumps({"type": "cancel"})), 1.0)
            await asyncio.wait_for(self._ws.close(), 2.0)
        except (ConnectionClosed, OSError, asyncio.TimeoutError, TimeoutError):
            pass  # the connection is already gone: the server cancels on disconnect anyway


def _server_error(msg: dict[str, Any]) -> APIStatusError:
    # APIStatusError marks 4xx (except 408/429) non-retryable and 5xx (busy = 503) retryable
    return APIStatusError(
        f"TTS server error {msg.get('code')}: {msg.get('message')}", status_code=int(msg.get("status", 500)), body=msg
    )


def _handshake_error(exc: InvalidStatus) -> APIStatusError:
    response = exc.response
    try:
        body = json.loads(response.body or b"{}")
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        body, message = None, f"HTTP {response.status_code}"
    return APIStatusError(f"TTS server refused the connection: {message}", status_code=response.status_code, body=body)


class ChunkedStream(tts.ChunkedStream):
    """Whole text in one utterance."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions, opts: _Options) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._opts = opts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(
            request_id=utils.shortuuid(),
            sample_rate=self._opts.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
        )
        session = await _Session.open(self._opts, self._conn_options.timeout)
        finished = False
        try:
            if self._input_text.strip():
                await session.send({"type": "text", "text": self._input_text})
                session.open_utterances += 1
            await session.send({"type": "close"})
            failure: APIStatusError | None = None
            async for msg, payload in session.messages():
                if msg["type"] == "audio":
                    output_emitter.push(payload)
                elif msg["type"] == "error":
                    failure = _server_error(msg)
                    if "utterance_id" not in msg:
                        raise failure
                elif msg["type"] == "done" and msg["finish_reason"] == "error":
                    raise failure or APIError("synthesis failed")
            finished = True
        finally:
            await session.aclose(cancel=not finished)


class SynthesizeStream(tts.SynthesizeStream):
    """Text deltas go to the server as they arrive; each flush ends one utterance (one LiveKit segment)."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions, opts: _Options) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._opts = opts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = utils.shortuuid()
        output_emitter.initialize(
            request_id=request_id,
            sample_rate=self._opts.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        session = await _Session.open(self._opts, self._conn_options.timeout)
        finished = False

        async def send_input() -> None:
            has_text = False
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if has_text:
                        await session.send({"type": "flush"})
                        has_text = False
                    continue
                if not has_text:
                    session.open_utterances += 1
                    has_text = True
                self._mark_started()
                await session.send({"type": "text", "text": data})
            await session.send({"type": "close"})  # flushes the last utterance; the server closes when done

        async def receive() -> None:
            segment: int | None = None
            failure: APIStatusError | None = None
            async for msg, payload in session.messages():
                kind = msg["type"]
                if kind == "error":
                    failure = _server_error(msg)
                    if "utterance_id" not in msg:
                        raise failure
                    continue
                if segment != msg["utterance_id"]:
                    segment = msg["utterance_id"]
                    output_emitter.start_segment(segment_id=f"{request_id}-{segment}")
                if kind == "audio":
                    output_emitter.push(payload)
                elif kind == "done":
                    if msg["finish_reason"] == "error":
                        raise failure or APIError("synthesis failed")
                    output_emitter.end_segment()
                    segment = None

        tasks = [asyncio.create_task(send_input()), asyncio.create_task(receive())]
        try:
            await asyncio.gather(*tasks)
            finished = True
        finally:
            await utils.aio.cancel_and_wait(*tasks)
            # interrupted (the agent was barged in on) or failed: stop the server's utterance right away
            await session.aclose(cancel=not finished)
