"""The engine's public side: what a caller holds (`Engine`, `SpeechStream`) and what it checks before a request
reaches a core.

`EngineFrontend` validates, tokenizes text as it arrives (`text.py`) and turns the core's outputs into stream
chunks and endings; reference voices are validated and encoded here (`voices.py`). `Engine` is that front end
with its core on a thread of this process; `process.EngineClient` is the same front end for a core in
another process. Changes here are changes to what callers see. `Engine` loads torch, so it is imported on first
use: the processes that only talk to a core (`EngineClient`) never load torch.
"""

from typing import TYPE_CHECKING, Any

from .frontend import EngineFrontend, EngineStats, ModelInfo, error_from_info
from .stream import SpeechStream
from .text import IncrementalText, TextTokenizer, validate_text
from .voices import AudioInput, load_voice, prepare_reference, save_voice, trim_reference

__all__ = [
    "AudioInput",
    "Engine",
    "EngineFrontend",
    "EngineStats",
    "IncrementalText",
    "ModelInfo",
    "SpeechStream",
    "TextTokenizer",
    "error_from_info",
    "load_voice",
    "prepare_reference",
    "save_voice",
    "trim_reference",
    "validate_text",
]

if TYPE_CHECKING:
    from .engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
