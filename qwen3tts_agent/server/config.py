"""Server settings: one frozen dataclass so every limit is visible in one place and fixed for the process."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A chunk schedule's bounds: a session's `start` (server/protocol.py), `serve --chunk-schedule` (server/cli.py)
# and `serve-ray`'s (ray/settings.py).
MAX_CHUNK_FRAMES = 64
MAX_SCHEDULE_CHUNKS = 8
# The engine's scheduling options (and its positions a stream) `serve` and `serve-ray` share, by name (a `RayServeSettings` field; on the
# command line `--codec-hold-ms` and so on): the `Engine` keyword each sets, and what to divide by for its units
# (1000: milliseconds to seconds; None: a count, as given). `chunk_schedule` is the one more (`check_chunk_schedule`).
ENGINE_TUNING: dict[str, tuple[str, int | None]] = {
    "codec_hold_ms": ("codec_hold_s", 1000),
    "step_period_ms": ("step_period_s", 1000),
    "first_frame_step_load": ("first_frame_step_load", None),
    "clock_first_frame_load": ("clock_first_frame_load", None),
    "shed_lateness_ms": ("shed_lateness_s", 1000),
    "max_seq_len": ("max_seq_len", None),
}


def check_chunk_schedule(schedule: Sequence[int]) -> tuple[int, ...]:
    """A chunk schedule as the engine takes it (frames per chunk, the last repeating), or ValueError when it has
    more chunks or longer ones than a session's `start` may ask for."""
    if not 1 <= len(schedule) <= MAX_SCHEDULE_CHUNKS or not all(
        isinstance(n, int) and 1 <= n <= MAX_CHUNK_FRAMES for n in schedule
    ):
        raise ValueError(f"a chunk schedule is 1 to {MAX_SCHEDULE_CHUNKS} chunks of 1 to {MAX_CHUNK_FRAMES} frames "
                         f"each, got {list(schedule)}")
    return tuple(schedule)


def engine_tuning(values: Mapping[str, Any]) -> dict[str, Any]:
    """The `Engine` keywords of the scheduling options set in `values` (`ENGINE_TUNING`'s names and
    `chunk_schedule`; None or absent: the engine's default), in the engine's units. A negative value is a
    ValueError that names the option both ways (`codec_hold_ms`, `--codec-hold-ms`)."""
    kwargs: dict[str, Any] = {}
    for name, (keyword, divisor) in ENGINE_TUNING.items():
        value = values.get(name)
        if value is None:
            continue
        if value < 0:
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must not be negative, got {value}")
        kwargs[keyword] = value / divisor if divisor is not None else value
    if values.get("chunk_schedule") is not None:
        kwargs["chunk_schedule"] = check_chunk_schedule(values["chunk_schedule"])
    return kwargs


def default_voices_dir() -> Path:
    """Where registered voices live unless told otherwise (XDG data dir, so they survive reinstalls)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "qwen3tts-agent" / "voices"


def is_loopback(host: str) -> bool:
    """True when only this machine can reach `host`; anything else must carry a bearer token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Everything `create_app` needs besides the engine.

    Args:
        host: Bind address; a non-loopback host requires `api_key`.
        port: TCP port.
        api_key: Bearer token every request must carry (None: no auth, loopback only).
        model_name: Name reported to clients (the model spec the engine was loaded from).
        voices_dir: Folder of registered voices, one sub-folder per voice.
        default_voice: Voice used for OpenAI voice names (alloy, ...) and sessions that name none:
            a registered voice id/name or a CustomVoice speaker. None: the model's own default.
        default_voice_audio: Reference audio registered at startup as the default voice (Base models).
        default_voice_text: Transcript of `default_voice_audio` (None: x-vector-only cloning).
        max_sessions: Concurrent WebSocket sessions; more are refused with 503. Server-wide: under
            `serve --workers N`, all API workers together (`server/workers.py`).
        max_active_streams: Engine streams synthesizing at once (None: the engine's own `max_streams`);
            per API worker under `serve --workers N`.
        max_queued: Utterances waiting for a stream slot; beyond that requests fail at once with "busy".
            Server-wide, as `max_sessions`.
        queue_timeout_s: Longest wait for a slot before failing with "busy".
        max_text_chars: Characters per utterance (WebSocket) or per `input` (HTTP).
        max_message_bytes: Largest WebSocket message and JSON request body.
        max_upload_bytes: Largest voice-registration body (base64 audio).
        max_voices: Registered voices kept (each holds its prompt tensors in memory).
        max_pending_utterances: Flushed utterances one session may queue behind the one playing.
        max_frames: Ceiling on `max_frames` a client may ask for (80 ms each).
        idle_timeout_s: A session with nothing to say and no message for this long is closed.
        send_timeout_s: A client that leaves more than `send_buffer_bytes` unread for this long is too slow:
            its utterances are cancelled (freeing their slots) and the connection closed (WebSocket: 4010).
        send_buffer_bytes: Bytes queued per connection in the server before a send waits for the client
            (the transport's write-buffer high-water mark; the kernel's socket buffer comes on top).
        http_read_timeout_s: An HTTP request's head, and then its body, must each arrive within this long;
            a connection that sends a partial head (or nothing) and falls silent is closed.
        keep_alive_timeout_s: An idle keep-alive HTTP connection is closed after this long.
        warmup: Run `engine.warmup()` before reporting ready.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "qwen3-tts"
    voices_dir: Path = field(default_factory=default_voices_dir)
    default_voice: str | None = None
    default_voice_audio: Path | None = None
    default_voice_text: str | None = None
    max_sessions: int = 64
    max_active_streams: int | None = None
    max_queued: int = 64
    queue_timeout_s: float = 10.0
    max_text_chars: int = 4096
    max_message_bytes: int = 64 * 1024
    max_upload_bytes: int = 16 * 1024 * 1024
    max_voices: int = 1000
    max_pending_utterances: int = 8
    max_frames: int = 2047
    idle_timeout_s: float = 60.0
    send_timeout_s: float = 10.0
    send_buffer_bytes: int = 256 * 1024
    http_read_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0
    warmup: bool = True

    def validate(self) -> None:
        """Refuse settings that would expose an unauthenticated server or make no sense."""
        if not self.api_key and not is_loopback(self.host):
            raise ValueError(
                f"binding to {self.host} (not loopback) requires a bearer token: "
                "pass --api-key or set QWEN3TTS_API_KEY"
            )
        positive = {
            "max_sessions": self.max_sessions,
            "max_text_chars": self.max_text_chars,
            "max_message_bytes": self.max_message_bytes,
            "max_upload_bytes": self.max_upload_bytes,
            "max_voices": self.max_voices,
            "max_pending_utterances": self.max_pending_utterances,
            "max_frames": self.max_frames,
            "idle_timeout_s": self.idle_timeout_s,
            "send_timeout_s": self.send_timeout_s,
            "send_buffer_bytes": self.send_buffer_bytes,
            "http_read_timeout_s": self.http_read_timeout_s,
            "keep_alive_timeout_s": self.keep_alive_timeout_s,
        }
        if self.max_active_streams is not None:
            positive["max_active_streams"] = self.max_active_streams
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_queued < 0 or self.queue_timeout_s < 0:
            raise ValueError("max_queued and queue_timeout_s must not be negative")
