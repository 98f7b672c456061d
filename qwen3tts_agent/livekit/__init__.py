"""LiveKit Agents TTS plugin: a thin client of `qwen3tts-agent serve`, so every agent job shares one engine.

LiveKit runs each job in its own process; loading the model per job would multiply GPU memory. The server
holds the weights once and this plugin streams to it over the WebSocket protocol (docs/server.md), keeping
its sessions in a pool as LiveKit's own plugins do (`TTS.prewarm()`, `TTS.aclose()`); see docs/livekit.md.
"""

from __future__ import annotations

import logging

try:
    from .tts import TTS, ChunkedStream, SynthesizeStream
except ImportError:
    logging.getLogger(__name__).error('The LiveKit plugin needs its extra: pip install "qwen3tts-agent[livekit]"')
    raise

__all__ = ["TTS", "ChunkedStream", "SynthesizeStream"]
