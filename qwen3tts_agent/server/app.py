"""The FastAPI app: WebSocket streaming, OpenAI-compatible speech, voices, health, readiness and metrics."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.types import Receive, Scope, Send

from ..errors import Qwen3TTSAgentError
from ..waits import bounded
from .admission import Admission
from .audio import PcmEncoder, streaming_wav_header
from .config import ServerConfig
from .protocol import (
    OPENAI_VOICES,
    ApiError,
    AudioFormat,
    SpeechRequest,
    VoiceCreateRequest,
    decode_json,
    from_engine_error,
    require_text,
    validate_body,
)
from .session import StreamSession, first_chunk_stages
from .state import ServerState

if TYPE_CHECKING:
    from ..engine.frontend import EngineFrontend
    from .workers import WorkerCell

logger = logging.getLogger(__name__)

_AUDIO_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav"}
# Where a speech response's first chunk spent its time, in ms: the request (its body, checks and slot), then the
# stages the WebSocket reports in `done` (handoff, admission, prompt, first frame, decode, delivery to the
# response's start).
FIRST_CHUNK_STAGES_HEADER = "X-First-Chunk-Stages"


def error_response(err: ApiError) -> JSONResponse:
    headers = {}
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif err.status == 503:
        headers["Retry-After"] = "1"
    elif err.code == "request_timeout":
        headers["Connection"] = "close"  # the rest of a body that came too slowly is not worth waiting for
    return JSONResponse(err.to_openai(), status_code=err.status, headers=headers)


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The body as JSON, refusing (413) anything over `limit` bytes before reading it all into memory,
    and (408) a body that trickles in slower than `timeout_s` allows."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError("message_too_large", f"request body exceeds {limit} bytes")
    body = bytearray()

    async def receive_all() -> None:
        async for piece in request.stream():
            body.extend(piece)
            if len(body) > limit:
                raise ApiError("message_too_large", f"request body exceeds {limit} bytes")

    try:
        await bounded(receive_all(), timeout_s)  # not asyncio.wait_for, which can swallow a cancel (waits.py)
    except TimeoutError:
        raise ApiError("request_timeout", f"request body not received within {timeout_s:g}s") from None
    return decode_json(bytes(body))


class _SpeechResponse(StreamingResponse):
    """Streams one utterance; `cleanup` runs however the response ends (done, error, client gone, never started)."""

    def __init__(
        self, content: AsyncIterator[bytes], media_type: str, cleanup: Callable[[], None], headers: dict[str, str]
    ) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-store", **headers})
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def _speech(state: ServerState, admission: Admission, req: SpeechRequest, received: float) -> Response:
    """The OpenAI speech endpoint; `received`: when the request came in (time.perf_counter), for its stages."""
    fmt = req.response_format.lower()
    if fmt not in _AUDIO_TYPES:
        raise ApiError(
            "unsupported_format",
            f"response_format {req.response_format!r} is not supported; use 'pcm' or 'wav'",
            param="response_format",
        )
    if req.speed is not None and req.speed != 1.0:
        raise ApiError("unsupported_parameter", "speed must be 1.0: this server cannot change speed", param="speed")
    if req.stream_format not in (None, "audio"):
        raise ApiError("unsupported_parameter", "only stream_format 'audio' is supported", param="stream_format")
    require_text(req.input, "input")
    if len(req.input) > state.max_text_chars:
        raise ApiError("text_too_long", f"input exceeds {state.max_text_chars} characters", param="input")
    settings = state.settings(
        voice=req.voice,
        language=req.language,
        instruct=req.instructions,
        sampling=req.sampling,
        audio_format=AudioFormat(),
        chunk_schedule=None,
    )
    started = time.perf_counter()
    queue_wait = await admission.acquire()
    state.metrics.queue_wait.observe(queue_wait)
    active = state.metrics.active_streams.labels("http")
    active.inc()
    stream: Any = None
    released = False

    def cleanup() -> None:
        nonlocal released
        if released:
            return
        released = True
        if stream is not None and not stream.done:
            stream.cancel()  # sync on purpose: this may run in a cancelled task, where an await would not
            state.metrics.cancels.labels("disconnect").inc()
            state.metrics.utterances.labels("http", "cancelled").inc()
        active.dec()
        admission.release()

    try:
        stream = state.open_stream(settings, req.input)
        chunks = stream.__aiter__()
        # Wait for the first chunk before answering, so early engine failures still get a status code.
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException as exc:
        cleanup()
        if isinstance(exc, Exception) and not isinstance(exc, ApiError):
            state.metrics.utterances.labels("http", "error").inc()
            raise from_engine_error(exc) from exc
        raise
    answered = time.perf_counter()
    state.metrics.first_audio.labels("http").observe(answered - started)
    headers = {}
    if first is not None:  # where the first chunk's time went, as the WebSocket's `done` says (docs/server.md)
        stages = {"request": 1000 * (first.timings.submitted - received), **first_chunk_stages(first.timings, answered)}
        headers[FIRST_CHUNK_STAGES_HEADER] = json.dumps({k: round(v, 3) for k, v in stages.items()}, separators=(",", ":"))
    rate = state.engine.sample_rate  # OpenAI's pcm is 24 kHz s16le, which is the engine's native rate
    encoder = PcmEncoder("pcm_s16le", rate, rate)

    async def body() -> AsyncIterator[bytes]:
        clock = state.metrics.playback("http")
        try:
            if fmt == "wav":
                yield streaming_wav_header(rate)
            if first is not None:
                yield encoder.encode(first.pcm, last=first.is_last)
                clock.sent(time.perf_counter(), first.duration)
                async for chunk in chunks:
                    yield encoder.encode(chunk.pcm, last=chunk.is_last)
                    clock.sent(time.perf_counter(), chunk.duration)
        except Exception as exc:
            # headers are gone: all we can do is log, count, and cut the body short so the client notices
            err = from_engine_error(exc)
            logger.error("speech request failed mid-stream: %s", err.message)
            state.count_error(err)
            state.metrics.utterances.labels("http", "error").inc()
            raise
        result = stream.result
        state.metrics.utterances.labels("http", result.finish_reason).inc()
        state.metrics.audio_seconds.inc(result.audio_seconds)
        state.metrics.real_time_factor.observe(result.real_time_factor)

    return _SpeechResponse(body(), _AUDIO_TYPES[fmt], cleanup, headers)


def create_app(
    config: ServerConfig,
    *,
    engine: EngineFrontend | None = None,
    engine_factory: Callable[[], EngineFrontend] | None = None,
    ready_wait_s: float = 0.0,
    worker: WorkerCell | None = None,
) -> FastAPI:
    """Build the app around one engine: an instance the caller owns, or a factory run (and closed) by the app.

    With a factory the server answers /health at once and /ready only after load and warm-up; with
    `ready_wait_s` it first waits up to that long for readiness before taking connections (`ServerState.lifespan`).
    `worker`: the app is one of `serve`'s API workers, whose limits and metrics are server-wide (`server/workers.py`).
    """
    state = ServerState(
        config, engine=engine, engine_factory=engine_factory, ready_wait_s=ready_wait_s, worker=worker
    )
    app = FastAPI(title="qwen3tts-agent", lifespan=state.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    # async, so FastAPI runs them on the event loop rather than in its thread pool
    async def authorized(connection: HTTPConnection) -> None:
        state.authorize(connection.headers.get("authorization"))

    async def ready() -> Admission:
        return state.require_ready()

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError) -> JSONResponse:
        state.count_error(err)
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        # routing's own answers (unknown path, wrong method) in the same shape as every other error
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        err = ApiError(code, str(exc.detail))
        state.count_error(err)
        return JSONResponse(err.to_openai(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # a bug, not the client's fault: logged with its traceback (by the server), answered in OpenAI's shape
        err = ApiError("internal_error", f"internal server error ({type(exc).__name__})")
        state.count_error(err)
        response = error_response(err)
        response.headers["Connection"] = "close"  # the server drops the connection after an unhandled error
        return response

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def readiness() -> JSONResponse:
        if state.serving:
            return JSONResponse({"status": "ready", "model": config.model_name})
        status = "failed" if state.failure else "restarting" if state.ready else "starting"
        return JSONResponse({"status": status, "error": state.failure}, status_code=503)

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # auth first (401 says nothing about the server's state), then readiness (503)
    api = APIRouter(dependencies=[Depends(authorized)])

    @api.post("/v1/audio/speech")
    async def speech(request: Request, admission: Admission = Depends(ready)) -> Response:  # noqa: B008
        received = time.perf_counter()
        body = await read_json(request, config.max_message_bytes, config.http_read_timeout_s)
        return await _speech(state, admission, validate_body(SpeechRequest, body), received)

    @api.get("/v1/voices", dependencies=[Depends(ready)])
    async def list_voices() -> dict[str, Any]:
        return {
            "voices": [record.to_json() for record in state.voices.records()],
            "speakers": list(state.engine.speakers),
            "default_voice": state.default_voice_label,
            "openai_voices": sorted(OPENAI_VOICES),
        }

    @api.post("/v1/voices", status_code=201, dependencies=[Depends(ready)])
    async def create_voice(request: Request) -> JSONResponse:
        body = await read_json(request, config.max_upload_bytes, config.http_read_timeout_s)
        req = validate_body(VoiceCreateRequest, body)
        if not req.x_vector_only and not (req.ref_text or "").strip():
            raise ApiError("invalid_message", "ref_text is required unless x_vector_only is true", param="ref_text")
        try:
            audio = base64.b64decode(req.audio, validate=True)
        except binascii.Error:
            raise ApiError("invalid_message", "audio must be base64 of a WAV or FLAC file", param="audio") from None
        engine = state.engine

        def create() -> Any:
            return engine.create_voice(audio, ref_text=req.ref_text, x_vector_only=req.x_vector_only)

        try:
            record, created = await state.voices.register(
                create, type(engine).save_voice, name=req.name, ref_text=req.ref_text, x_vector_only=req.x_vector_only
            )
        except Qwen3TTSAgentError as exc:
            raise from_engine_error(exc) from exc
        return JSONResponse(record.to_json(), status_code=201 if created else 200)

    @api.get("/v1/voices/{key}", dependencies=[Depends(ready)])
    async def get_voice(key: str) -> dict[str, Any]:
        found = state.voices.resolve(key)
        if found is None:
            raise ApiError("not_found", f"no registered voice {key!r}")
        return found[0].to_json()

    @api.delete("/v1/voices/{key}", status_code=204, dependencies=[Depends(ready)])
    async def delete_voice(key: str) -> Response:
        if await state.voices.delete(key) is None:
            raise ApiError("not_found", f"no registered voice {key!r}")
        return Response(status_code=204)

    app.include_router(api)

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket) -> None:
        try:
            # the same gates as the HTTP routes, called directly: a WebSocket dependency that raises cannot
            # answer with a status code, and refusing the upgrade with one is what clients can act on
            await authorized(ws)
            await ready()
            if not state.open_sessions.try_add(config.max_sessions):  # server-wide: every API worker's sessions
                raise ApiError("busy", f"too many sessions ({config.max_sessions}); retry shortly", reason="sessions")
        except ApiError as err:
            state.count_error(err)
            await ws.send_denial_response(error_response(err))
            return
        try:
            await ws.accept()
            await StreamSession(ws, state).run()
        finally:
            state.open_sessions.remove()

    return app
