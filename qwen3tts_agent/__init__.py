"""qwen3tts-agent: a real-time streaming Qwen3-TTS engine for voice agents."""

from .engine.engine import Engine
from .engine.frontend import EngineStats
from .engine.stream import SpeechStream
from .engine.types import (
    SAMPLE_RATE,
    AudioChunk,
    ChunkTimings,
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
    "EngineStats",
    "SamplingParams",
    "SpeechStream",
    "StreamResult",
    "TextLayout",
    "Voice",
    "VoicePrompt",
]
__version__ = "0.1.0"
