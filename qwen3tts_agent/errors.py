"""Typed errors: every bad input maps to one of these, so integrations can turn them into protocol errors."""

from __future__ import annotations


class Qwen3TTSAgentError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(Qwen3TTSAgentError, ValueError):
    """The request itself is malformed (bad text, bad parameter)."""


class InvalidTextError(InvalidRequestError):
    """Empty, whitespace-only or over-long text."""


class UnsupportedLanguageError(InvalidRequestError):
    """The model does not know this language."""


class UnknownVoiceError(InvalidRequestError):
    """Unknown named speaker or voice id."""


class UnsupportedFeatureError(InvalidRequestError):
    """The loaded model type cannot do what was asked (e.g. instruct on 0.6B, cloning on CustomVoice)."""


class InvalidReferenceAudioError(InvalidRequestError):
    """Reference audio is unreadable, too short, silent, non-finite or otherwise unusable."""


class ModelLoadError(Qwen3TTSAgentError):
    """A model spec, folder or hub id could not be loaded."""


class EngineOverloadedError(Qwen3TTSAgentError):
    """Admission control refused the request: too many streams are active or queued, or the engine runs behind.

    `reason` names the rule that refused (`REFUSAL_REASONS` in `engine/scheduler/scheduler.py` for an engine
    behind real time, "streams" for its stream limit), so that operators can count refusals by cause."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class EngineClosedError(Qwen3TTSAgentError):
    """The engine was shut down."""


class StreamCancelledError(Qwen3TTSAgentError):
    """Text was pushed to, or audio awaited from, a stream that was cancelled."""


class EngineError(Qwen3TTSAgentError):
    """A failure inside the engine, not the caller's fault (reported across a process boundary by type name)."""


class EngineDeadError(Qwen3TTSAgentError):
    """The engine's core stopped (a crash, a device fault): streams it held end with this error."""


class DeviceMemoryError(Qwen3TTSAgentError):
    """The device ran out of memory setting an engine up (its stream slots' CUDA graphs); the message says what
    to start it with instead."""


class EngineNotReadyError(Qwen3TTSAgentError):
    """The engine cannot take requests right now (its core is starting or restarting); retry shortly."""
