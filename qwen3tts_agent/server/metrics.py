"""Prometheus metrics of one server (own registry, so several apps in one process never collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_RTF_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
_LATENESS_BUCKETS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)
# engine.stats() fields exported as qwen3tts_engine_<field>
_ENGINE_FIELDS = (
    "active_streams", "queued_streams", "max_streams", "frames_generated", "streams_started", "cancels", "errors",
    "steps", "first_frame_steps", "steps_deferred", "clock_releases", "first_audio_holds", "speculations",
    "speculation_misses", "codec_decodes", "codec_chunks", "early_codec_decodes", "late_chunks",
    "underrun_seconds", "overloaded", "healthy", "restarts",
    "device_memory_bytes", "core_rss_bytes",
)


class _EngineCollector(Collector):
    """Reads `engine.stats()` at scrape time, so the engine's own counters need no bookkeeping here."""

    def __init__(self, stats: Callable[[], Any | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        for field in _ENGINE_FIELDS:
            yield GaugeMetricFamily(
                f"qwen3tts_engine_{field}", f"engine.stats().{field}", value=float(getattr(stats, field))
            )
        loop = GaugeMetricFamily(
            "qwen3tts_engine_loop_seconds", "Seconds the engine's step loop spent per part of its turn", labels=["phase"]
        )
        for phase, seconds in stats.loop_seconds.items():
            loop.add_metric([phase], float(seconds))
        yield loop


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
        self.late_chunks = Counter(
            "qwen3tts_late_chunks", "Audio chunks sent after a client playing from the first chunk needed them",
            ["endpoint"], registry=r,
        )
        self.underrun_seconds = Counter(
            "qwen3tts_underrun_seconds", "How late those chunks left, summed (the playback starvation)",
            ["endpoint"], registry=r,
        )
        self.chunk_lateness = Histogram(
            "qwen3tts_chunk_lateness_seconds", "Each chunk after the first: how late it left (0 when on time)",
            ["endpoint"], buckets=_LATENESS_BUCKETS, registry=r,
        )
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def playback(self, endpoint: str) -> PlaybackClock:
        return PlaybackClock(self, endpoint)


class PlaybackClock:
    """One stream's real-time schedule as it leaves the server: a client that starts playing the first chunk
    when it is sent needs each later chunk by then plus the audio sent before it. Counts the chunks that miss."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._first: float | None = None
        self._audio_s = 0.0

    def sent(self, now: float, seconds: float) -> None:
        """A chunk of `seconds` of audio left at `now` (time.perf_counter())."""
        if self._first is None:
            self._first = now
        else:
            late = max(0.0, now - (self._first + self._audio_s))
            self._metrics.chunk_lateness.labels(self._endpoint).observe(late)
            if late > 0.0:
                self._metrics.late_chunks.labels(self._endpoint).inc()
                self._metrics.underrun_seconds.labels(self._endpoint).inc(late)
        self._audio_s += seconds
