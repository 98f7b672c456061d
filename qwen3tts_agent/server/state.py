"""The server's shared state: the engine, its startup (load, warm-up, voices), admission, auth and voice lookup."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.types import SamplingParams, Voice
from ..reference import demo_reference
from ..waits import cancel_and_wait
from .admission import Admission
from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import (
    DEFAULT_VOICE_ALIASES,
    ApiError,
    AudioFormat,
    SamplingOptions,
    from_engine_error,
)
from .voices import VoiceRegistry
from .workers import Count, Held, LocalCount, WorkerCell

if TYPE_CHECKING:
    from ..engine.frontend import EngineFrontend

logger = logging.getLogger(__name__)

# How long a server that stops waits for its start-up to end once cancelled (a load or warm-up on a thread goes
# on there regardless; the wait is for the start-up task's own awaits).
STARTUP_CANCEL_WAIT_S = 10.0


@dataclass(frozen=True)
class SynthesisSettings:
    """Everything an utterance needs besides its text, resolved and validated once per session or request."""

    voice: Voice
    voice_label: str
    language: str
    sampling: SamplingParams
    audio_format: AudioFormat
    chunk_schedule: tuple[int, ...] | None


T = TypeVar("T")


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread of its own. Unlike `asyncio.to_thread`, a call still blocked when its task is
    cancelled (an engine factory waiting for a core that never serves) does not hold up the process's exit:
    `asyncio.run` joins the default executor's threads, not this one."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            future.set_exception(exc)

    threading.Thread(target=run, name="qwen3tts-engine-start", daemon=True).start()
    return await asyncio.wrap_future(future)


class ServerState:
    """Owns what every request shares. Not ready until the engine is loaded, warmed up and voices are read."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        engine: EngineFrontend | None = None,
        engine_factory: Callable[[], EngineFrontend] | None = None,
        ready_wait_s: float = 0.0,
        worker: WorkerCell | None = None,
    ) -> None:
        """`worker`: this process is one of `serve`'s API workers, and its group's cell makes the session and
        queue limits, and the metrics, server-wide; None: this process is the whole server."""
        if (engine is None) == (engine_factory is None):
            raise ValueError("pass exactly one of engine or engine_factory")
        config.validate()
        self.config = config
        self._ready_wait_s = ready_wait_s
        self._engine = engine
        self._engine_factory = engine_factory
        self._worker = worker
        # WebSocket sessions open (against `max_sessions`) and utterances waiting for a slot (`max_queued`)
        self.open_sessions: Count = worker.count(Held.SESSIONS) if worker is not None else LocalCount()
        self.queued: Count = worker.count(Held.QUEUED) if worker is not None else LocalCount()
        self.metrics = ServerMetrics(
            lambda: self._engine.stats() if self.ready and self._engine is not None else None,
            sessions=self.open_sessions,
            queued=self.queued,
            multiprocess_dir=worker.group.metrics_dir if worker is not None else None,
        )
        self.voices = VoiceRegistry(config.voices_dir, max_voices=config.max_voices)
        self.admission: Admission | None = None
        self.ready = False
        self.failure: str | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._default_voice: str | None = config.default_voice
        self._builtin_voice: Voice | None = None  # Base models only, when no default is configured

    @property
    def sessions(self) -> int:
        """WebSocket sessions open: the whole server's under `serve --workers N`."""
        return self.open_sessions.total

    @property
    def engine(self) -> EngineFrontend:
        assert self._engine is not None, "engine used before startup finished"
        return self._engine

    @asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        """Start in the background so /health answers while the model loads; close an engine we loaded.

        With `ready_wait_s`, the app waits that long for readiness before it serves: uvicorn takes connections
        only once the lifespan has started, so a worker of several sharing a port (`serve --workers N`) is not
        handed clients while it is still starting, yet serves /health (and 503s) if its start takes longer.
        """
        startup = asyncio.create_task(self._start(), name="qwen3tts-startup")
        if self._ready_wait_s > 0:
            await asyncio.wait({startup}, timeout=self._ready_wait_s)
        try:
            yield
        finally:
            await cancel_and_wait(startup, STARTUP_CANCEL_WAIT_S, "the server's start-up")
            if self._engine_factory is not None and self._engine is not None:
                await asyncio.to_thread(self._engine.close)

    async def _start(self) -> None:
        try:
            if self._engine is None:
                assert self._engine_factory is not None
                self._engine = await _in_daemon_thread(self._engine_factory)
            engine = self._engine
            if self.config.warmup:
                await asyncio.to_thread(engine.warmup)
            await self.voices.load(type(engine).load_voice)
            if self.config.default_voice_audio is not None:
                self._default_voice = await self._register_default_voice()
            if self._default_voice is not None and self._lookup(self._default_voice) is None:
                raise ValueError(f"default voice {self._default_voice!r} is neither a registered voice nor a speaker")
            if self._default_voice is None and engine.model_type == "base":
                self._builtin_voice = await asyncio.to_thread(self._demo_voice)
            engine_slots = engine.stats().max_streams
            capacity = self.config.max_active_streams or engine_slots
            self.admission = Admission(
                capacity, max_queued=self.config.max_queued, timeout_s=self.config.queue_timeout_s, queue=self.queued
            )
            self.ready = True
            logger.info("ready: model %s; %s", self.config.model_name, self._limits(capacity, engine_slots))
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.exception("startup failed")
            if self.on_failure is not None:
                self.on_failure(exc)

    def _limits(self, capacity: int, engine_slots: int) -> str:
        """The effective limits, for the log: what holds server-wide and what per API worker."""
        config = self.config
        held = f"at most {config.max_sessions} WebSocket sessions and {config.max_queued} queued utterances"
        if self._worker is None:
            return f"{capacity} synthesis slots, {held}"
        workers = self._worker.group.size
        return (
            f"synthesis slots: {capacity} in this API worker, {capacity * workers} over the {workers} workers (the "
            f"engine core runs {engine_slots} streams at once and queues the rest); server-wide: {held}"
        )

    def _demo_voice(self) -> Voice:
        """Base models need a reference to speak at all; a synthetic one makes a bare request work out of the box."""
        return Voice(prompt=self.engine.create_voice(demo_reference(), x_vector_only=True))

    @property
    def max_text_chars(self) -> int:
        """The configured limit, never above what the engine itself accepts."""
        return min(self.config.max_text_chars, self.engine.max_text_chars)

    async def _register_default_voice(self) -> str:
        path = self.config.default_voice_audio
        assert path is not None
        text = self.config.default_voice_text
        engine = self.engine
        record, _ = await self.voices.register(
            lambda: engine.create_voice(path, ref_text=text, x_vector_only=text is None),
            type(engine).save_voice,
            name=None,
            ref_text=text,
            x_vector_only=text is None,
        )
        return record.voice_id

    # ------------------------------------------------------------------ request gates
    def authorize(self, header: str | None) -> None:
        """Constant-time bearer-token check; a no-op when the server runs without a key (loopback only)."""
        expected = self.config.api_key
        if not expected:
            return
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise ApiError("unauthorized", "missing or invalid bearer token (send 'Authorization: Bearer <key>')")

    def require_ready(self) -> Admission:
        if self.failure is not None:
            raise ApiError("not_ready", f"the server failed to start: {self.failure}")
        if not self.ready or self.admission is None:
            raise ApiError("not_ready", "the model is still loading or warming up; retry shortly")
        if not self.engine.healthy:
            raise ApiError("not_ready", "the engine is restarting after a failure; retry shortly")
        return self.admission

    @property
    def serving(self) -> bool:
        """Started, and the engine takes streams (its core is up): what /ready reports."""
        return self.ready and self._engine is not None and self._engine.healthy

    # ------------------------------------------------------------------ voices
    def _lookup(self, key: str) -> tuple[Voice, str] | None:
        found = self.voices.resolve(key)
        if found is not None:
            return Voice(prompt=found[1]), found[0].voice_id
        speaker = key.lower()
        if speaker in self.engine.speakers:
            return Voice(speaker=speaker), speaker
        return None

    def _default(self) -> tuple[Voice, str]:
        """The configured default, else the model's own: its first speaker, the built-in clone, or a bare design."""
        if self._default_voice is not None:
            found = self._lookup(self._default_voice)
            if found is None:
                raise ApiError("unknown_voice", f"the default voice {self._default_voice!r} no longer exists")
            return found
        if self.engine.model_type == "custom_voice":
            return Voice(speaker=self.engine.speakers[0]), self.engine.speakers[0]
        if self._builtin_voice is not None:
            return self._builtin_voice, "default"
        return Voice(), "voice-design"  # VoiceDesign: the instruction, if any, describes the voice

    @property
    def default_voice_label(self) -> str | None:
        try:
            return self._default()[1]
        except ApiError:
            return None

    def resolve_voice(self, name: str | None, instruct: str | None) -> tuple[Voice, str]:
        """A registered voice (id or name), a CustomVoice speaker, or the default for OpenAI names and None."""
        if instruct and not self.engine.supports_instruct:
            raise ApiError("unsupported_feature", "this model does not take instructions", param="instruct")
        key = (name or "").strip()
        found = self._lookup(key) if key else None  # a voice registered under an OpenAI name wins
        if found is None and key and key.lower() not in DEFAULT_VOICE_ALIASES:
            raise ApiError(
                "unknown_voice",
                f"unknown voice {key!r}: use a registered voice or speaker (GET /v1/voices) "
                "or register one (POST /v1/voices)",
                param="voice",
            )
        voice, label = found if found is not None else self._default()
        if instruct:
            voice = Voice(speaker=voice.speaker, prompt=voice.prompt, instruct=instruct)
        return voice, label

    def settings(
        self,
        *,
        voice: str | None,
        language: str,
        instruct: str | None,
        sampling: SamplingOptions,
        audio_format: AudioFormat,
        chunk_schedule: list[int] | None,
    ) -> SynthesisSettings:
        resolved, label = self.resolve_voice(voice, instruct)
        lang = language.strip().lower()
        if lang not in self.engine.languages:
            raise ApiError(
                "unsupported_language",
                f"unsupported language {language!r}; this model knows: {', '.join(self.engine.languages)}",
                param="language",
            )
        params = sampling.to_params(self.config.max_frames)
        try:
            self.engine.validate_sampling(params)  # every bound now, not as a failure of each utterance later
        except Exception as exc:
            raise from_engine_error(exc) from exc
        return SynthesisSettings(
            voice=resolved,
            voice_label=label,
            language=lang,
            sampling=params,
            audio_format=audio_format,
            chunk_schedule=tuple(chunk_schedule) if chunk_schedule else None,
        )

    def open_stream(self, settings: SynthesisSettings, text: str | None) -> Any:
        """`engine.open_stream` with the session's settings; typed engine errors become ApiErrors."""
        kwargs: dict[str, Any] = {}
        if settings.chunk_schedule is not None:
            kwargs["chunk_schedule"] = settings.chunk_schedule
        try:
            return self.engine.open_stream(
                text=text, voice=settings.voice, language=settings.language, sampling=settings.sampling, **kwargs
            )
        except Exception as exc:
            raise from_engine_error(exc) from exc

    def count_error(self, err: ApiError) -> None:
        self.metrics.errors.labels(err.code).inc()
        if err.code == "busy":
            self.metrics.busy.labels(err.reason or "engine").inc()
