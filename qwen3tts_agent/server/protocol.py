"""Wire formats: client messages and request bodies (strict schemas), and the one error type both transports render."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.frontend import validate_text
from ..engine.types import SamplingParams
from ..errors import (
    EngineClosedError,
    EngineNotReadyError,
    EngineOverloadedError,
    InvalidReferenceAudioError,
    InvalidRequestError,
    InvalidTextError,
    UnknownVoiceError,
    UnsupportedFeatureError,
    UnsupportedLanguageError,
)
from .config import MAX_CHUNK_FRAMES, MAX_SCHEDULE_CHUNKS

# One table so a WebSocket error and an HTTP response for the same failure agree; the WebSocket error
# message carries the status too, so clients (the LiveKit plugin) map both transports the same way.
# Every code the server can send is here (tests check it against docs/server.md).
ERROR_STATUS: dict[str, int] = {
    "invalid_json": 400,
    "invalid_message": 400,
    "unknown_type": 400,
    "not_started": 400,
    "already_started": 400,
    "invalid_request": 400,
    "invalid_text": 400,
    "text_too_long": 400,
    "unsupported_format": 400,
    "unsupported_parameter": 400,
    "unknown_voice": 400,
    "unsupported_language": 400,
    "unsupported_feature": 400,
    "invalid_reference_audio": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "idle_timeout": 408,
    "request_timeout": 408,
    "send_timeout": 408,
    "conflict": 409,
    "message_too_large": 413,
    "engine_error": 500,
    "internal_error": 500,
    "busy": 503,
    "not_ready": 503,
}

# What refused a `busy` (`ApiError.reason`, the label of the `qwen3tts_busy` metric): the server's own limits
# (its admission queue full, a wait for a slot past --queue-timeout, --max-sessions, a session's pending
# utterances), the engine's stream limit, and the engine running behind real time, by its rule
# (`engine/scheduler/scheduler.py`, REFUSAL_REASONS; "engine" where an engine gave none).
BUSY_REASONS = (
    "queue_full", "queue_timeout", "sessions", "session_pending", "streams", "slow_steps", "late_chunks", "slot_wait",
    "engine",
)

# WebSocket close codes the server uses (4000-4999 is the application's range; 4xxx mirrors HTTP 4xx).
CLOSE_NORMAL = 1000  # after the client's `close`, once everything queued was spoken
CLOSE_TOO_LARGE = 1009  # a message over max_message_bytes
CLOSE_INTERNAL = 1011  # a server fault; an `internal_error` message precedes it
CLOSE_IDLE = 4008  # idle_timeout: nothing queued and no message for idle_timeout_s
CLOSE_SEND_TIMEOUT = 4010  # send_timeout: the client left our audio unread for send_timeout_s

# Far deeper than any message of this protocol (3 levels), far shallower than what recursion can survive.
MAX_JSON_DEPTH = 32

# OpenAI's voice names: requests naming one of these get the default voice, so stock clients work as they are.
OPENAI_VOICES = frozenset(
    {"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse"}
)
DEFAULT_VOICE_ALIASES = OPENAI_VOICES | {"default"}

VOICE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class ApiError(Exception):
    """A failure with a stable `code` (see ERROR_STATUS) and a message meant for the client."""

    def __init__(self, code: str, message: str, *, param: str | None = None, reason: str | None = None) -> None:
        """`reason`: for `busy`, the limit that refused (`BUSY_REASONS`), counted in the server's metrics."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.reason = reason

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's error body, so OpenAI clients raise their usual exception types."""
        if self.status == 401:
            kind = "authentication_error"
        elif self.status >= 500:
            kind = "server_error"
        else:
            kind = "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# Most specific first: the typed engine errors subclass InvalidRequestError.
_ENGINE_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (InvalidTextError, "invalid_text"),
    (UnsupportedLanguageError, "unsupported_language"),
    (UnknownVoiceError, "unknown_voice"),
    (UnsupportedFeatureError, "unsupported_feature"),
    (InvalidReferenceAudioError, "invalid_reference_audio"),
    (InvalidRequestError, "invalid_request"),
    (EngineOverloadedError, "busy"),
    (EngineClosedError, "not_ready"),
    (EngineNotReadyError, "not_ready"),
)


def from_engine_error(exc: Exception) -> ApiError:
    """Map a typed engine error to its protocol code; anything untyped is an engine fault (500)."""
    for kind, code in _ENGINE_ERRORS:
        if isinstance(exc, kind):
            reason = exc.reason if isinstance(exc, EngineOverloadedError) else None
            return ApiError(code, str(exc) or code, reason=reason)
    return ApiError("engine_error", f"synthesis failed: {type(exc).__name__}: {exc}")


class _Strict(BaseModel):
    # Unknown fields are errors, and "1" is not a number: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SamplingOptions(_Strict):
    """Per-session decoding settings; omitted fields keep the engine's defaults."""

    do_sample: bool | None = None
    temperature: float | None = Field(None, gt=0, le=10)
    top_k: int | None = Field(None, ge=0, le=4096)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    max_frames: int | None = Field(None, ge=1)
    ignore_eos: bool | None = None

    def to_params(self, max_frames_cap: int) -> SamplingParams:
        values = self.model_dump(exclude_none=True)
        requested = values.get("max_frames", max_frames_cap)  # the engine's runaway guard bounds it further
        if requested > max_frames_cap:
            raise ApiError(
                "invalid_message", f"sampling.max_frames must be at most {max_frames_cap}", param="max_frames"
            )
        values["max_frames"] = requested
        return SamplingParams(**values)


class AudioFormat(_Strict):
    """What audio frames carry: little-endian PCM, mono, at one of the common rates (resampled from 24 kHz)."""

    encoding: Literal["pcm_s16le", "pcm_f32le"] = "pcm_s16le"
    sample_rate: Literal[8000, 16000, 22050, 24000, 44100, 48000] = 24000


class StartMessage(_Strict):
    type: Literal["start"]
    voice: str | None = Field(None, max_length=128)
    language: str = Field("auto", max_length=32)
    instruct: str | None = Field(None, max_length=2000)
    sampling: SamplingOptions = SamplingOptions()
    audio_format: AudioFormat = AudioFormat()
    chunk_schedule: list[Annotated[int, Field(ge=1, le=MAX_CHUNK_FRAMES)]] | None = Field(
        None, min_length=1, max_length=MAX_SCHEDULE_CHUNKS
    )


class TextMessage(_Strict):
    type: Literal["text"]
    text: str


class FlushMessage(_Strict):
    type: Literal["flush"]


class CancelMessage(_Strict):
    type: Literal["cancel"]


class CloseMessage(_Strict):
    type: Literal["close"]


ClientMessage = StartMessage | TextMessage | FlushMessage | CancelMessage | CloseMessage

_MESSAGE_TYPES: dict[str, type[_Strict]] = {
    "start": StartMessage,
    "text": TextMessage,
    "flush": FlushMessage,
    "cancel": CancelMessage,
    "close": CloseMessage,
}


class SpeechRequest(_Strict):
    """`POST /v1/audio/speech` body: OpenAI's fields plus `language` and `sampling`."""

    model: str = Field(..., max_length=256)
    input: str
    voice: str | None = Field(None, max_length=128)
    response_format: str = "wav"
    speed: float | None = None
    instructions: str | None = Field(None, max_length=2000)
    stream_format: str | None = None
    language: str = Field("auto", max_length=32)
    sampling: SamplingOptions = SamplingOptions()


class VoiceCreateRequest(_Strict):
    """`POST /v1/voices` body: reference audio (base64 of a WAV/FLAC file) and its transcript."""

    audio: str
    ref_text: str | None = Field(None, max_length=2000)
    name: str | None = Field(None, pattern=VOICE_NAME_PATTERN)
    x_vector_only: bool = False


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, with the dotted path of the field, e.g. `sampling.top_q: Extra inputs are not permitted`."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "message"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


# A JSON string (escapes included) or one bracket; brackets inside strings are thus skipped whole.
_STR_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_BYTES_OR_BRACKET = re.compile(_STR_OR_BRACKET.pattern.encode())


def json_depth_exceeds(raw: str | bytes, limit: int) -> bool:
    """True when `raw` nests arrays/objects deeper than `limit`, found without parsing it.

    Counting brackets is enough for almost every message (fewer brackets than the limit cannot nest
    deeper); only then are strings skipped by one regex scan, so the cost stays linear and in C.
    """
    scan: re.Pattern[Any]
    bracket: tuple[Any, Any]
    if isinstance(raw, str):
        opening, scan, bracket = raw.count("[") + raw.count("{"), _STR_OR_BRACKET, ("[", "{")
    else:
        opening, scan, bracket = raw.count(b"[") + raw.count(b"{"), _BYTES_OR_BRACKET, (b"[", b"{")
    if opening <= limit:
        return False
    depth = 0
    for match in scan.finditer(raw):  # type: ignore[arg-type]
        token = match.group()
        if len(token) != 1:
            continue  # a string
        if token in bracket:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _check_strings(data: Any) -> None:
    """Every string of a message, keys included, must pass the engine's text rule (valid Unicode).

    JSON escapes such as `\\ud800` decode to lone surrogates, which no tokenizer can encode: refused here,
    with the field's path, so one rule holds for the Python API, the WebSocket and HTTP.
    """
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            _validate(value, path or "message")
        elif isinstance(value, dict):
            for key, item in value.items():
                _validate(key, f"a key of {path or 'the message'}")
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _validate(text: str, what: str) -> None:
    try:
        validate_text(text, what=what)
    except InvalidTextError as exc:
        raise ApiError("invalid_text", str(exc), param=what) from None


def decode_json(raw: str | bytes) -> Any:
    """Parse a message or body: bounded nesting, valid JSON, valid Unicode in every string."""
    if json_depth_exceeds(raw, MAX_JSON_DEPTH):
        raise ApiError("invalid_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError("invalid_json", f"not valid JSON: {exc}") from None
    _check_strings(data)
    return data


def require_text(text: str, what: str) -> str:
    """The text of a whole utterance: valid Unicode and something to say (not empty or whitespace-only)."""
    _validate(text, what)
    if not text.strip():
        raise ApiError("invalid_text", f"{what} is empty or whitespace-only: there is nothing to say", param=what)
    return text


_M = TypeVar("_M", bound=BaseModel)


def validate_body(model: type[_M], data: Any) -> _M:
    if not isinstance(data, dict):
        raise ApiError("invalid_message", "expected a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError("invalid_message", describe_validation_error(exc)) from None


def parse_client_message(raw: str) -> ClientMessage:
    """Decode and validate one WebSocket text message; every failure is an ApiError with a precise message."""
    data = decode_json(raw)
    if not isinstance(data, dict):
        raise ApiError("invalid_message", "a message must be a JSON object with a 'type' field")
    kind = data.get("type")
    model = _MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        expected = ", ".join(_MESSAGE_TYPES)
        raise ApiError("unknown_type", f"unknown message type {kind!r}; expected one of: {expected}")
    return validate_body(model, data)  # type: ignore[return-value]
