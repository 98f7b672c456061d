"""The server's WebSocket protocol as the plugin speaks it: URLs, message bodies, rates and language names.

Plain data and functions, no LiveKit or network imports, so the wire format lives in one place and can be
checked against the server's own schema (`tests/test_livekit_plugin.py`). The protocol itself is described
in docs/server.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STREAM_PATH = "/v1/stream"
DEFAULT_URL = "ws://127.0.0.1:8000"
URL_ENV = "QWEN3TTS_URL"
API_KEY_ENV = "QWEN3TTS_API_KEY"

ENCODING = "pcm_s16le"  # what LiveKit's AudioEmitter takes as "audio/pcm"
SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)  # the server resamples from the model's 24 kHz
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # largest server message accepted: one audio chunk at 48 kHz is far below

# Messages without fields; text deltas and `start` are built below.
FLUSH = {"type": "flush"}
CANCEL = {"type": "cancel"}

# What a server waits before closing a session that sends nothing, when its `ready` does not say.
DEFAULT_IDLE_TIMEOUT_S = 60.0

# LiveKit and most STT stacks speak ISO 639-1 codes; the model's language ids are English names.
ISO_LANGUAGES = {
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


def language_name(language: str) -> str:
    """'en', 'en-US' and 'English' all mean english; unknown values go to the server, which names what it knows."""
    code = language.strip().lower()
    return ISO_LANGUAGES.get(code.split("-")[0], code)


def stream_url(base_url: str) -> str:
    """The streaming endpoint of a server given as ws(s):// or http(s)://, with or without the path."""
    url = base_url.rstrip("/")
    if url.startswith("http"):  # http -> ws, https -> wss
        url = "ws" + url[4:]
    return url if url.endswith(STREAM_PATH) else f"{url}{STREAM_PATH}"


def text_message(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


@dataclass
class SessionOptions:
    """Everything a server session fixes at its `start`: a connection serves only streams with equal options."""

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
            "audio_format": {"encoding": ENCODING, "sample_rate": self.sample_rate},
            "sampling": self.sampling,
        }
        if self.voice:
            msg["voice"] = self.voice
        if self.instruct:
            msg["instruct"] = self.instruct
        if self.chunk_schedule:
            msg["chunk_schedule"] = self.chunk_schedule
        return msg

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
