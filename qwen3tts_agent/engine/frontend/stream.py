"""The caller's side of one utterance: push text in, iterate audio out, cancel — from any thread or event loop."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Protocol

from ...errors import InvalidTextError, Qwen3TTSAgentError, StreamCancelledError
from ..types import (
    FIRST_FRAME_TEXT_TOKENS,
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    AudioChunk,
    FinishReason,
    StreamResult,
)
from .text import IncrementalText, validate_text


class StreamOwner(Protocol):
    """The front end a stream belongs to (`EngineFrontend`): where the stream's text, its end and its cancel go.

    Only a stream calls these, hence their leading underscores: they are no part of the front end's API."""

    def _stream_text(self, stream: SpeechStream, ids: list[int], tentative: list[int]) -> None: ...

    def _stream_close(self, stream: SpeechStream, ids: list[int]) -> None: ...

    def _stream_cancel(self, stream: SpeechStream) -> None: ...

    def _stream_fail(self, stream: SpeechStream, error: Qwen3TTSAgentError) -> None: ...


class SpeechStream:
    """One utterance. Chunks arrive from the engine's core; text and cancel go to it as messages.

    Iterate it with `async for` (event loops) or `chunks()` (threads). After `cancel()`/`acancel()` returns,
    no further chunk is yielded, including chunks already produced but not yet consumed. Text is tokenized
    here, in the caller's thread, as it arrives.
    """

    def __init__(self, owner: StreamOwner, stream_id: str, text: IncrementalText, max_text_chars: int) -> None:
        self.id = stream_id
        self.result = StreamResult()
        self.submitted = time.perf_counter()
        self._owner = owner
        self._text = text
        self._text_lock = threading.Lock()
        self._max_text_chars = max_text_chars
        self._input_closed = False
        self._lock = threading.Condition()
        self._chunks: collections.deque[AudioChunk] = collections.deque()
        self._done = False
        self._cancelled = False
        self._error: BaseException | None = None
        self._wakers: list[Callable[[], None]] = []
        self._cancel_ack = threading.Event()
        self._ack_callbacks: list[Callable[[], None]] = []
        self._cancel_requested_at = 0.0

    # ----------------------------------------------------------------- input
    def push_text(self, delta: str) -> None:
        """Append text (any granularity, e.g. LLM tokens). Thread-safe and non-blocking.

        Invalid text (not a str, invalid Unicode) raises InvalidTextError and is dropped; the stream goes on.
        Text pushed after the stream has ended on its own (end of speech, max_frames) is ignored.
        """
        if self._cancelled:
            raise StreamCancelledError(f"stream {self.id} was cancelled")
        if self._input_closed:
            raise InvalidTextError("text pushed after close_input()")
        validate_text(delta)
        if not delta:
            return
        with self._text_lock:
            if self._text.chars + len(delta) > self._max_text_chars:
                self.cancel()
                raise InvalidTextError(f"text longer than {self._max_text_chars} characters")
            ids = self._text.push(delta)
            # Until the first frame's text is final, the core may start that frame on the text as it stands. A
            # delta of letters only is not tokenized (see IncrementalText), nor is the tail here: a word typed
            # letter by letter would cost O(word) each; the core learns of the change with the next delta.
            early = self._text.committed < FIRST_FRAME_TEXT_TOKENS and not delta.isalpha()
            tentative = self._text.tentative() if early else []
            self._owner._stream_text(self, ids, tentative)

    def _push_whole(self, text: str) -> None:
        """The whole text, checked by `open_stream`, as ONE message that also closes the input: the core never
        sees a part of it, so a whole text always gets the prompt of the whole text (`Voice.icl_early_start`
        starts on partial text)."""
        with self._text_lock:
            self._input_closed = True
            ids = self._text.push(text)
            self._owner._stream_close(self, ids + self._text.close())

    def close_input(self) -> None:
        """No more text: the utterance ends at the model's end token after the text.

        A text that is empty or only whitespace ends the stream with InvalidTextError (the same rule as for
        a whole text given to `open_stream`).
        """
        with self._text_lock:
            if self._input_closed or self._cancelled:
                return
            self._input_closed = True
            if self._text.blank:
                self._owner._stream_fail(self, InvalidTextError("text is empty"))
                return
            self._owner._stream_close(self, self._text.close())

    # ----------------------------------------------------------------- cancel
    def cancel(self) -> None:
        """Stop at the next frame boundary (fire and forget). Undelivered chunks are dropped at once."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            self._cancel_requested_at = time.perf_counter()
            self._chunks.clear()
            already_done = self._done
            self._lock.notify_all()
        self._wake()
        if already_done:
            self._cancel_ack.set()
        else:
            self._owner._stream_cancel(self)

    async def acancel(self) -> float:
        """Cancel and wait until the engine has dropped the request; returns that latency in seconds."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        dropped = loop.create_future()

        def ack() -> None:
            loop.call_soon_threadsafe(_settle, dropped)

        with self._lock:
            self._ack_callbacks.append(ack)
        self.cancel()
        if self._cancel_ack.is_set():
            ack()
        await dropped
        return time.perf_counter() - started

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def done(self) -> bool:
        return self._done

    # ----------------------------------------------------------------- output (engine thread side)
    def _deliver(self, chunk: AudioChunk) -> None:
        with self._lock:
            if self._cancelled or self._done:
                return
            result = self.result
            if result.first_audio_latency is None:
                result.first_audio_latency = chunk.timings.ready - chunk.timings.submitted
            result.frames = chunk.frame_end
            result.audio_seconds = chunk.frame_end * SAMPLES_PER_FRAME / SAMPLE_RATE
            self._chunks.append(chunk)
            self._lock.notify_all()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done:
                return
            if error is not None:
                self.result.finish_reason = FinishReason.ERROR
            self._done = True
            self._error = error
            self._lock.notify_all()
        if self._cancelled:
            self.result.cancel_latency = time.perf_counter() - self._cancel_requested_at
        self._cancel_ack.set()
        with self._lock:
            callbacks, self._ack_callbacks = self._ack_callbacks, []
        for callback in callbacks:
            callback()
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    # ----------------------------------------------------------------- output (consumer side)
    def _pop(self) -> AudioChunk | None:
        """Next chunk, None at the end; raises the stream's error. Caller holds the lock."""
        if self._chunks:
            return self._chunks.popleft()
        if self._cancelled or self._done:
            if self._error is not None and not self._cancelled:
                raise self._error
            return None
        raise BlockingIOError

    def chunks(self, timeout: float | None = None) -> Iterator[AudioChunk]:
        """Blocking iterator over the audio chunks."""
        while True:
            with self._lock:
                while True:
                    try:
                        chunk = self._pop()
                        break
                    except BlockingIOError:
                        if not self._lock.wait(timeout):
                            raise TimeoutError(f"no audio from stream {self.id} within {timeout}s") from None
            if chunk is None:
                return
            yield chunk

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        with self._lock:
            self._wakers.append(wake)
        try:
            while True:
                ready.clear()
                with self._lock:
                    try:
                        chunk = self._pop()
                    except BlockingIOError:
                        waiting = True
                    else:
                        waiting = False
                if waiting:
                    await ready.wait()
                    continue
                if chunk is None:
                    return
                yield chunk
        finally:
            with self._lock:
                self._wakers.remove(wake)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
