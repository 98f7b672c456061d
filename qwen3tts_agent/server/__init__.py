"""Streaming TTS server: one engine, many clients (WebSocket streaming, OpenAI-compatible HTTP, voices)."""

from .app import create_app
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
