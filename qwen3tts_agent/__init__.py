"""qwen3tts-agent: a real-time streaming Qwen3-TTS engine for voice agents."""

from .engine.client import EngineClient
from .engine.engine import Engine
from .engine.frontend import EngineFrontend, EngineStats
from .engine.stream import SpeechStream
from .engine.types import (
    SAMPLE_RATE,
    AudioChunk,
    ChunkTimings,
    FinishReason,
    SamplingParams,
    StreamResult,
    TextLayout,
    Voice,
    VoicePrompt,
)

__all__ = [
    "SAMPLE_RATE",
    "AudioChunk",
    "ChunkTimings",
    "Engine",
    "EngineClient",
    "EngineFrontend",
    "EngineStats",
    "FinishReason",
    "SamplingParams",
    "SpeechStream",
    "StreamResult",
    "TextLayout",
    "Voice",
    "VoicePrompt",
]
__version__ = "0.1.0"
