"""Streaming TTS server: one engine, many clients (WebSocket streaming, OpenAI-compatible HTTP, voices).

`create_app` (FastAPI and the app) is imported on first use, so that `serve`'s supervisor can start its
engine core before it loads the web stack (`launcher.serve`).
"""

from typing import TYPE_CHECKING, Any

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]

if TYPE_CHECKING:
    from .app import create_app


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
