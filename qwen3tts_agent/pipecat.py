"""Pipecat TTS service on the qwen3tts-agent engine: streamed LLM text in, audio out, barge-in stops the model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import EngineFrontend, SamplingParams, SpeechStream, StreamResult, Voice, VoicePrompt
from .errors import (
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    InvalidTextError,
    Qwen3TTSAgentError,
    UnknownVoiceError,
)
from .waits import bounded

try:
    from loguru import logger
    from pipecat.audio.resamplers.soxr_stream_resampler import SOXRStreamAudioResampler
    from pipecat.frames.frames import Frame, InterruptionFrame, TTSAudioRawFrame
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TTSService
    from pipecat.transcriptions.language import Language, resolve_language
    from pipecat.utils.errors import ErrorCategory
    from pipecat.utils.tracing.service_decorators import traced_tts
    from pipecat.utils.types import NOT_GIVEN, NotGiven, assert_given
except ModuleNotFoundError as e:
    raise ImportError(f'{e}. The Pipecat integration needs: pip install "qwen3tts-agent[pipecat]"') from e

# How long the service waits for what it cancelled: an utterance's pump at teardown (it ends at its next await, so
# this bounds only one that ignores its cancel, left behind rather than holding the pipeline), and the engine's
# drop of a barged-in utterance before its report goes out anyway.
TEARDOWN_WAIT_S = 5.0

# Qwen3-TTS names its languages in English words; regional variants fall back to the base language.
_LANGUAGES: dict[Language, str] = {
    Language.ZH: "chinese",
    Language.EN: "english",
    Language.JA: "japanese",
    Language.KO: "korean",
    Language.DE: "german",
    Language.FR: "french",
    Language.RU: "russian",
    Language.PT: "portuguese",
    Language.ES: "spanish",
    Language.IT: "italian",
}


def language_to_qwen3tts_language(language: Language) -> str:
    """Map a Pipecat language to the engine's name for it (unknown ones pass through and fail at synthesis)."""
    return resolve_language(language, _LANGUAGES, use_base_code=True)


@dataclass
class Qwen3TTSSettings(TTSSettings):
    """Runtime-updatable settings; every utterance snapshots them when it starts.

    Parameters:
        voice: Cloned voice for Base models: a name from the service's ``voices`` or a file
            written by ``Engine.save_voice``.
        speaker: Named speaker for CustomVoice models.
        instruct: Speaking-style instruction (1.7B CustomVoice) or voice description (VoiceDesign).
        sampling: Decoding parameters (``max_frames`` caps an utterance); None for the engine defaults.
        icl_early_start: In-context clones in TOKEN mode start speaking on the first words instead of
            waiting for text covering the reference (``Voice.icl_early_start``: not the official prompt,
            speech quality not judged; off by default).
    """

    speaker: str | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)
    instruct: str | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)
    sampling: SamplingParams | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)
    icl_early_start: bool | NotGiven = field(default_factory=lambda: NOT_GIVEN)


@dataclass(frozen=True)
class UtteranceReport:
    """What one engine stream did, passed to the ``on_utterance_finished`` event.

    Parameters:
        context_id: The Pipecat audio context the audio went to.
        text: The text pushed to the stream.
        result: The engine's summary: frames, finish_reason, first_audio_latency, cancel_latency, ... A barged-in
            utterance the engine had not dropped within ``TEARDOWN_WAIT_S`` (its loop held up) is reported then,
            with finish_reason None (not known yet) and no cancel_latency.
        first_audio: Seconds from opening the stream to its first chunk reaching the service.
    """

    context_id: str
    text: str
    result: StreamResult
    first_audio: float | None


@dataclass(eq=False)
class _Utterance:
    """One engine stream and where its audio goes."""

    context_id: str
    stream: SpeechStream
    opened: float
    text: list[str] = field(default_factory=list)
    first_audio: float | None = None
    flushed: bool = False  # the turn's text is complete: the stream's end closes the audio context
    aborted: bool = False
    pump: asyncio.Task | None = None


class Qwen3TTSService(TTSService):
    """Streams speech from a shared qwen3tts-agent engine (an ``Engine`` in this process, or an ``EngineClient``
    of an engine-core process), one engine stream per utterance.

    In ``TextAggregationMode.TOKEN`` the LLM's text deltas go into ONE engine stream per turn as
    they arrive, so speech starts on the first words and prosody runs on across sentences; in
    sentence mode each sentence is its own stream. Audio frames are pushed as the engine produces
    them. On an interruption the engine stream is cancelled at its next frame boundary, so the
    model stops working on speech nobody will hear. One engine serves any number of services.

    Event handlers:
        on_utterance_finished: Called with an :class:`UtteranceReport` when an engine stream ends
            (completed, cancelled or failed).
    """

    Settings = Qwen3TTSSettings
    _settings: Qwen3TTSSettings

    def __init__(
        self,
        *,
        engine: EngineFrontend,
        voices: Mapping[str, VoicePrompt] | None = None,
        chunk_schedule: Sequence[int] | None = None,
        settings: Qwen3TTSSettings | None = None,
        **kwargs: Any,
    ) -> None:
        """Initialize the service.

        Args:
            engine: A loaded engine (`Engine`, shared by every service in the process) or an `EngineClient`
                of an engine-core process (shared by bots in many processes).
            voices: Cloned voices that ``Settings.voice`` can name.
            chunk_schedule: Frames (80 ms each) per audio chunk, first to last; None for the engine's.
            settings: Runtime-updatable settings; defaults to no voice, "auto" language, engine sampling.
            **kwargs: Passed to ``TTSService`` (``text_aggregation_mode``, ``sample_rate``, ...).
        """
        default_settings = self.Settings(
            model=None, voice=None, language="auto", speaker=None, instruct=None, sampling=None,
            icl_early_start=False,
        )
        if settings is not None:
            default_settings.apply_update(settings)
        super().__init__(push_start_frame=True, push_stop_frames=True, settings=default_settings, **kwargs)
        self._engine = engine
        self._voices: dict[str, VoicePrompt] = dict(voices or {})
        self._chunk_schedule = tuple(chunk_schedule) if chunk_schedule else None
        # Live token-mode streams by audio context; None marks a turn whose stream failed or ended
        # early, so the rest of its text is dropped instead of opening a stream per token.
        self._streams: dict[str, _Utterance | None] = {}
        self._register_event_handler("on_utterance_finished")

    def can_generate_metrics(self) -> bool:
        """TTFB, TTFA, processing and usage metrics are all meaningful for this service."""
        return True

    def language_to_service_language(self, language: Language) -> str:
        """Convert a Pipecat language to the engine's language name."""
        return language_to_qwen3tts_language(language)

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:  # type: ignore[override]  # as TTSService itself narrows AIService
        """Apply a delta; it takes effect from the next utterance. The model is fixed by the engine."""
        changed = await super()._update_settings(delta)
        if "model" in changed:
            self._warn_unhandled_updated_settings({"model": changed["model"]})
        return changed

    def _classify_error(self, exception: Exception) -> ErrorCategory | None:
        """Map engine errors to Pipecat's categories, which decide whether the service stays usable."""
        if isinstance(exception, InvalidTextError):
            # Bad text says nothing about the service: the next text may be fine.
            return ErrorCategory.APPLICATION
        if isinstance(exception, InvalidRequestError):
            # Voice, language or feature the model lacks: fails until the settings change.
            return ErrorCategory.INVALID_REQUEST
        if isinstance(exception, EngineOverloadedError):
            return ErrorCategory.RATE_LIMIT
        if isinstance(exception, Qwen3TTSAgentError):
            return ErrorCategory.SERVER
        return None

    # ------------------------------------------------------------------ synthesis

    @traced_tts
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Feed text to the engine; audio reaches the audio context as the engine produces it.

        Yields only None: audio is appended to the context directly so that a token-mode turn,
        which spans many calls, and a sentence, which spans one, take the same path.
        """
        standalone = context_id != self._turn_context_id  # no turn end will flush it
        if self._is_streaming_tokens:
            await self._push_token(text, context_id)
            if standalone:
                await self.flush_audio(context_id)
        else:
            await self.start_tts_usage_metrics(text)
            utterance = await self._open(context_id, text)
            if utterance:
                await self._pump(utterance)
            if standalone:
                await self._close_context(context_id)
        yield None

    async def flush_audio(self, context_id: str | None = None) -> None:
        """End of the turn's text: close the stream's input; the audio context closes after its audio."""
        context_id = context_id or self.get_active_audio_context_id()
        if not context_id:
            return
        utterance = self._streams.get(context_id)
        if utterance is not None:
            utterance.flushed = True
            utterance.stream.close_input()
        else:
            self._streams.pop(context_id, None)
            await self._close_context(context_id)

    async def _push_token(self, text: str, context_id: str) -> None:
        """Append an LLM delta to the turn's stream, opening it on the turn's first text."""
        if context_id not in self._streams:
            utterance = await self._open(context_id, None)
            self._streams[context_id] = utterance
            if utterance:
                utterance.pump = self.create_task(self._pump_turn(utterance), name="qwen3tts_pump")
        utterance = self._streams[context_id]
        if utterance is None:
            return
        try:
            utterance.stream.push_text(text)
        except Qwen3TTSAgentError as e:
            self._streams[context_id] = None
            self._abort(utterance)
            await self._report_error(e)
            return
        utterance.text.append(text)

    async def _open(self, context_id: str, text: str | None) -> _Utterance | None:
        """Open an engine stream with a snapshot of the settings; errors become ErrorFrames."""
        s = self._settings  # the service's own settings: every field is given
        try:
            voice = Voice(
                speaker=assert_given(s.speaker),
                instruct=assert_given(s.instruct),
                prompt=await self._voice_prompt(assert_given(s.voice)),
                icl_early_start=assert_given(s.icl_early_start),
            )
            stream = self._engine.open_stream(
                text,
                voice=voice,
                language=s.language or "auto",
                sampling=assert_given(s.sampling),
                chunk_schedule=self._chunk_schedule,
            )
        except Qwen3TTSAgentError as e:
            await self._report_error(e)
            return None
        utterance = _Utterance(context_id, stream, time.perf_counter())
        if text is not None:
            utterance.text.append(text)
            utterance.flushed = True
        return utterance

    async def _voice_prompt(self, voice: str | None) -> VoicePrompt | None:
        """Resolve ``Settings.voice``: a registered name, else a saved voice file (loaded once)."""
        if not voice:
            return None
        if voice not in self._voices:
            if not Path(voice).is_file():
                raise UnknownVoiceError(
                    f"unknown voice {voice!r}: not a registered name nor a saved voice file"
                )
            self._voices[voice] = await asyncio.to_thread(EngineFrontend.load_voice, voice)
        return self._voices[voice]

    async def _pump(self, utterance: _Utterance) -> None:
        """Move the stream's chunks into its audio context as the engine produces them."""
        context_id = utterance.context_id
        in_rate, out_rate = self._engine.sample_rate, self.sample_rate
        # One resampler per stream carries its filter state across chunk joins (no clicks) and
        # never leaks one utterance's tail into the next.
        resampler = SOXRStreamAudioResampler(clear_after_secs=None) if in_rate != out_rate else None
        try:
            async for chunk in utterance.stream:
                if utterance.first_audio is None:
                    utterance.first_audio = time.perf_counter() - utterance.opened
                audio = chunk.pcm16
                if resampler:
                    audio = await resampler.resample(audio, in_rate, out_rate)
                await self._push_audio(context_id, audio)
            if resampler:
                await self._push_audio(context_id, await resampler.flush())
        except asyncio.CancelledError:
            self._abort(utterance)
            raise
        except Exception as e:  # the engine raises a failed step's own error, typed or not
            await self._report_error(e)
        await self._finished(utterance)

    async def _push_audio(self, context_id: str, audio: bytes) -> None:
        if audio:  # a resampler may hold back all of a short chunk
            await self.append_to_audio_context(
                context_id, TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=context_id)
            )

    async def _pump_turn(self, utterance: _Utterance) -> None:
        """Pump a token-mode stream, then close the turn's audio context if its text is complete."""
        await self._pump(utterance)
        context_id = utterance.context_id
        if self._streams.get(context_id) is not utterance:
            return
        if utterance.flushed:
            del self._streams[context_id]
            await self._close_context(context_id)
        else:
            # The model ended (end token, max_frames or an error) before the turn's text did.
            self._streams[context_id] = None

    async def _close_context(self, context_id: str) -> None:
        if self.audio_context_available(context_id):
            await self.remove_audio_context(context_id)

    async def _report_error(self, error: Exception) -> None:
        await self.push_error(
            error_msg=f"Qwen3-TTS error: {error}",
            exception=error,
            force_treat_as_permanent=isinstance(error, EngineClosedError),
        )

    async def _finished(self, utterance: _Utterance) -> None:
        """Log the utterance's latencies and emit its report."""
        result = utterance.stream.result
        first_audio = (
            f"{utterance.first_audio * 1000:.0f} ms" if utterance.first_audio is not None else "none"
        )
        cancel = (
            f", engine stopped {result.cancel_latency * 1000:.1f} ms after cancel"
            if result.cancel_latency
            else ""
        )
        logger.info(
            f"{self}: utterance {result.finish_reason} after {result.frames} frames "
            f"({result.audio_seconds:.2f} s of audio), first audio {first_audio}{cancel}"
        )
        report = UtteranceReport(utterance.context_id, "".join(utterance.text), result, utterance.first_audio)
        await self._call_event_handler("on_utterance_finished", report)

    # ------------------------------------------------------------------ barge-in

    def _abort(self, utterance: _Utterance) -> None:
        """Cancel the engine stream now (the engine drops it at its next frame) and report the latency."""
        if utterance.aborted:
            return
        utterance.aborted = True
        utterance.stream.cancel()
        if utterance.pump and utterance.pump is not asyncio.current_task():
            utterance.pump.cancel()
        self.create_task(self._report_cancel(utterance), name="qwen3tts_cancel")

    async def _report_cancel(self, utterance: _Utterance) -> None:
        try:
            await bounded(utterance.stream.acancel(), TEARDOWN_WAIT_S)  # once the engine has dropped the request
        except TimeoutError:
            logger.warning(f"{self}: the engine did not drop a cancelled utterance within {TEARDOWN_WAIT_S:g} s")
        await self._finished(utterance)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        """After the base class drops interrupted audio contexts, stop the engine streams behind them."""
        await super().process_frame(frame, direction)
        if isinstance(frame, InterruptionFrame):
            for context_id, utterance in list(self._streams.items()):
                if self.audio_context_available(context_id):
                    continue  # uninterruptible speech plays on
                del self._streams[context_id]
                if utterance:
                    self._abort(utterance)

    async def _stop_streams(self) -> None:
        for utterance in filter(None, self._streams.values()):
            utterance.aborted = True  # teardown: nothing left to report to
            utterance.stream.cancel()
            if utterance.pump:
                await self.cancel_task(utterance.pump, TEARDOWN_WAIT_S)
        self._streams.clear()

    async def cancel(self, frame: Any) -> None:
        """Stop synthesis at once when the pipeline is cancelled."""
        await super().cancel(frame)
        await self._stop_streams()

    async def cleanup(self) -> None:
        """Release engine streams at teardown."""
        await super().cleanup()
        await self._stop_streams()
