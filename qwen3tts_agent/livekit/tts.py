"""The LiveKit `TTS` factory and its two stream classes, over a pool of server sessions."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import weakref

from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    NOT_GIVEN,
    APIConnectOptions,
    APIError,
    APIStatusError,
    NotGivenOr,
    tts,
    utils,
)

from ..waits import cancel_all_and_wait
from . import protocol
from .connection import Connection, server_error
from .protocol import SessionOptions

# How long a stream, or the TTS closing, waits for the tasks it cancelled to end: they end at their next await,
# so this bounds only a task that ignores its cancel, which is then left behind rather than holding the agent.
TEARDOWN_WAIT_S = 5.0


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
        """Streaming TTS through a qwen3tts-agent server, over a pool of reused WebSocket sessions.

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
        if sample_rate not in protocol.SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {protocol.SAMPLE_RATES}")
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True), sample_rate=sample_rate, num_channels=1
        )
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "max_frames": max_frames}
        if ignore_eos:
            sampling["ignore_eos"] = True
        self._opts = SessionOptions(
            url=protocol.stream_url(base_url or os.environ.get(protocol.URL_ENV, protocol.DEFAULT_URL)),
            api_key=api_key or os.environ.get(protocol.API_KEY_ENV),
            voice=voice,
            language=protocol.language_name(language),
            instruct=instruct,
            sample_rate=sample_rate,
            sampling={k: v for k, v in sampling.items() if v is not None},
            chunk_schedule=chunk_schedule,
        )
        self._pool = utils.ConnectionPool[Connection](
            connect_cb=self._connect,
            close_cb=self._close_connection,
            connect_timeout=DEFAULT_API_CONNECT_OPTIONS.timeout,
        )
        self._streams: weakref.WeakSet[ChunkedStream | SynthesizeStream] = weakref.WeakSet()
        self._recycling: set[asyncio.Task[None]] = set()

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
        """Change the voice for streams created from now on; streams already created keep theirs.

        A server session's voice is fixed when it starts, so the pooled sessions are retired: idle ones close,
        busy ones close when their stream ends.
        """
        previous = self._opts
        if utils.is_given(voice):
            self._opts.voice = voice
        if utils.is_given(language):
            self._opts.language = protocol.language_name(language)
        if utils.is_given(instruct):
            self._opts.instruct = instruct
        if self._opts != previous:
            self._pool.invalidate()

    def prewarm(self) -> None:
        """Open one server session in the background, so the first stream does not wait for the handshake."""
        self._pool.prewarm()

    async def aclose(self) -> None:
        """Close every stream and every server session of this TTS."""
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        await cancel_all_and_wait(tuple(self._recycling), TEARDOWN_WAIT_S, "the interrupted sessions' recycling")
        await self._pool.aclose()

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        stream = ChunkedStream(tts=self, input_text=text, conn_options=conn_options, opts=self._snapshot())
        self._streams.add(stream)
        return stream

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options, opts=self._snapshot())
        self._streams.add(stream)
        return stream

    # ------------------------------------------------------------------ the pool
    def _snapshot(self) -> SessionOptions:
        # each stream keeps the options it was created with, whatever update_options does later
        return dataclasses.replace(self._opts, sampling=dict(self._opts.sampling))

    async def _connect(self, timeout: float) -> Connection:
        return await Connection.open(self._snapshot(), timeout)

    @staticmethod
    async def _close_connection(conn: Connection) -> None:
        await conn.aclose(cancel=True)

    async def _acquire(self, opts: SessionOptions, timeout: float) -> tuple[Connection, bool]:
        """A session started with `opts`, and whether it came from the pool (else it is the stream's own)."""
        while True:
            conn = await self._pool.get(timeout=timeout)
            if not conn.reusable():
                self._pool.remove(conn)  # closed by the server or the network, or near its idle timeout
                continue
            if conn.opts != opts:
                # the options changed after this stream was created: it gets a session of its own
                self._pool.put(conn)
                own = await Connection.open(opts, timeout)
                own.timeout = timeout
                return own, False
            conn.timeout = timeout
            return conn, True

    def _release(self, conn: Connection, pooled: bool, *, finished: bool) -> None:
        """Hand a stream's session back: to the pool when it owes nothing, after a cancel and drain when it
        was interrupted, else closed (the server then cancels whatever it still had)."""
        if finished and pooled and conn.reusable():
            conn.mark_idle()
            self._pool.put(conn)
            return
        task = asyncio.create_task(self._recycle(conn, pooled, finished=finished))
        self._recycling.add(task)
        task.add_done_callback(self._recycling.discard)

    async def _recycle(self, conn: Connection, pooled: bool, *, finished: bool) -> None:
        reusable = False
        try:
            reusable = pooled and not finished and await conn.cancel_and_drain()
        finally:
            if reusable:
                conn.mark_idle()
                self._pool.put(conn)
            else:
                if pooled:
                    self._pool.remove(conn)
                await conn.aclose(cancel=True)


class ChunkedStream(tts.ChunkedStream):
    """Whole text in one utterance."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions, opts: SessionOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = opts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(
            request_id=utils.shortuuid(),
            sample_rate=self._opts.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
        )
        if not self._input_text.strip():
            return
        conn, pooled = await self._tts._acquire(self._opts, self._conn_options.timeout)
        finished = False
        try:
            conn.open_utterances += 1
            await conn.send(protocol.text_message(self._input_text))
            await conn.send(protocol.FLUSH)
            failure: APIStatusError | None = None
            while conn.open_utterances > 0:
                msg, payload = await conn.next_message()
                if msg["type"] == "audio":
                    output_emitter.push(payload)
                elif msg["type"] == "error":
                    failure = server_error(msg)
                    if "utterance_id" not in msg:
                        raise failure
                elif msg["type"] == "done" and msg["finish_reason"] == "error":
                    raise failure or APIError("synthesis failed")
            finished = True
        finally:
            self._tts._release(conn, pooled, finished=finished)


class SynthesizeStream(tts.SynthesizeStream):
    """Text deltas go to the server as they arrive; each flush ends one utterance (one LiveKit segment)."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions, opts: SessionOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
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
        conn, pooled = await self._tts._acquire(self._opts, self._conn_options.timeout)
        input_ended = False

        async def send_input() -> None:
            nonlocal input_ended
            has_text = False
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if has_text:
                        await conn.send(protocol.FLUSH)
                        has_text = False
                    continue
                if not has_text:
                    conn.open_utterances += 1  # counted before the send: a done can follow at once
                    has_text = True
                self._mark_started()
                await conn.send(protocol.text_message(data))
            if has_text:
                await conn.send(protocol.FLUSH)
            input_ended = True
            if conn.open_utterances == 0:
                receiver.cancel()  # it waits for a message that will not come; nothing is owed

        async def receive() -> None:
            segment: int | None = None
            failure: APIStatusError | None = None
            while not (input_ended and conn.open_utterances == 0):
                try:
                    msg, payload = await conn.next_message()
                except asyncio.CancelledError:
                    if input_ended and conn.open_utterances == 0:
                        return  # stopped by send_input: the stream is complete
                    raise
                kind = msg["type"]
                if kind == "error":
                    failure = server_error(msg)
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

        receiver = asyncio.create_task(receive())
        sender = asyncio.create_task(send_input())
        finished = False
        try:
            await asyncio.gather(sender, receiver)
            finished = True
        finally:
            try:
                await cancel_all_and_wait((sender, receiver), TEARDOWN_WAIT_S, "a stream's sender and receiver")
            finally:
                # interrupted (the agent was barged in on) or failed: the server's utterances stop right away. Also
                # when a second cancel (the agent closing too) ended the wait above: else the session would stay
                # open on the server, out of the pool
                self._tts._release(conn, pooled, finished=finished)
