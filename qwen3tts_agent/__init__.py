"""qwen3tts-agent: a real-time streaming Qwen3-TTS engine for voice agents.

`Engine` (which loads torch and the model code) is imported on first use, so the processes that only talk
to an engine core (`EngineClient`: the server's supervisor and API workers, Pipecat bots) never load torch.
"""

from typing import TYPE_CHECKING, Any

from .engine.frontend import EngineFrontend, EngineStats, SpeechStream
from .engine.process import EngineClient
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

if TYPE_CHECKING:
    from .engine.frontend import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from .engine.frontend import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
