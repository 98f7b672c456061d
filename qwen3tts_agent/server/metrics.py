"""Prometheus metrics of one server (own registry, so several apps in one process never collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_RTF_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)


class _EngineCollector(Collector):
    """Reads `engine.stats()` at scrape time, so the engine's own counters need no bookkeeping here."""

    def __init__(self, stats: Callable[[], Any | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        for field in ("active_streams", "queued_streams", "max_streams", "frames_generated", "cancels", "errors"):
            yield GaugeMetricFamily(
                f"qwen3tts_engine_{field}", f"engine.stats().{field}", value=float(getattr(stats, field))
            )


class ServerMetrics:
    """The server's counters; `endpoint` is "ws" or "http"."""

    def __init__(self, engine_stats: Callable[[], Any | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.first_audio = Histogram(
            "qwen3tts_first_audio_seconds",
            "Utterance start (incl. queue wait) to its first audio sent",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "qwen3tts_queue_wait_seconds", "Wait for a synthesis slot", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.real_time_factor = Histogram(
            "qwen3tts_real_time_factor",
            "Audio seconds per wall second of finished utterances (>1 is faster than real time)",
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.active_streams = Gauge("qwen3tts_active_streams", "Engine streams open", ["endpoint"], registry=r)
        self.queued = Gauge("qwen3tts_queued_requests", "Utterances waiting for a synthesis slot", registry=r)
        self.active_sessions = Gauge("qwen3tts_active_sessions", "WebSocket sessions open", registry=r)
        self.utterances = Counter(
            "qwen3tts_utterances", "Finished utterances", ["endpoint", "finish_reason"], registry=r
        )
        self.audio_seconds = Counter("qwen3tts_audio_seconds", "Audio seconds synthesized", registry=r)
        self.cancels = Counter(
            "qwen3tts_cancels", "Utterances stopped early (client = cancel message, disconnect)", ["reason"], registry=r
        )
        self.errors = Counter("qwen3tts_errors", "Errors returned to clients", ["code"], registry=r)
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
