"""Prometheus metrics of one server: its own registry, so several apps in one process never collide.

Under `serve --workers N` each worker counts its own share in prometheus_client's multiprocess files
(`server/workers.py`), and every worker's `/metrics` answers with the sum over all of them: counters and
histograms of every worker that ever ran, `qwen3tts_active_streams` of the live ones (`livesum`), sessions and
queued utterances from the server-wide counts the limits use, and the engine core's series once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from .workers import Count

_LATENCY_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_RTF_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
_LATENESS_BUCKETS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)
# engine.stats() fields exported as qwen3tts_engine_<field>
_ENGINE_FIELDS = (
    "active_streams", "queued_streams", "max_streams", "frames_generated", "streams_started", "cancels", "errors",
    "steps", "first_frame_steps", "steps_deferred", "clock_releases", "first_audio_holds", "speculations",
    "speculation_misses", "codec_decodes", "codec_chunks", "early_codec_decodes", "timed_steps",
    "step_device_seconds", "step_flight_seconds", "step_gap_seconds", "steps_overlapped", "late_chunks",
    "underrun_seconds", "overloaded", "stream_limit", "stream_limit_cuts", "stream_limit_seconds", "healthy",
    "restarts", "device_memory_bytes", "core_rss_bytes",
)

# engine.stats() dicts exported as one labelled family each: (name, help, label, field)
_ENGINE_LABELLED = (
    ("qwen3tts_engine_loop_seconds", "Seconds the engine's step loop spent per part of its turn", "phase", "loop_seconds"),
    (
        "qwen3tts_engine_step_gap_seconds_by_hold",
        "qwen3tts_engine_step_gap_seconds by what held the next batched step back (in_flight, clock, first_audio, "
        "first_frames, codec; read: from a step's read back to the first look after it; loop: the engine's loop at its "
        "other work)",
        "hold", "step_gap_by_hold",
    ),
    (
        "qwen3tts_engine_late_chunks_by_index",
        "Chunks that left late, by their place in their stream (1: the second chunk; 4+: the fifth and later)",
        "index", "late_by_index",
    ),
    (
        "qwen3tts_engine_late_chunks_by_cause",
        "Chunks that left late, by why: frames (made after the chunk was due) or decode (made in time, the codec "
        "lane late)",
        "cause", "late_by_cause",
    ),
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
        for name, documentation, label, field in _ENGINE_LABELLED:
            family = GaugeMetricFamily(name, documentation, labels=[label])
            for value, amount in getattr(stats, field).items():
                family.add_metric([value], float(amount))
            yield family


class _HeldCollector(Collector):
    """Sessions open and utterances queued, read from the counts the limits hold them against (server-wide
    under `serve --workers N`, where reading them also drops the share of a worker that died)."""

    def __init__(self, sessions: Count, queued: Count) -> None:
        self._sessions = sessions
        self._queued = queued

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("qwen3tts_active_sessions", "WebSocket sessions open", value=self._sessions.total)
        yield GaugeMetricFamily(
            "qwen3tts_queued_requests", "Utterances waiting for a synthesis slot", value=self._queued.total
        )


class ServerMetrics:
    """The server's counters; `endpoint` is "ws" or "http".

    `multiprocess_dir`: this process is one of `serve`'s API workers and prometheus_client writes to that
    folder (one app per process then: two would share their values); `render` sums every worker's files.
    """

    def __init__(
        self,
        engine_stats: Callable[[], Any | None],
        *,
        sessions: Count,
        queued: Count,
        multiprocess_dir: Path | None = None,
    ) -> None:
        self._multiprocess_dir = multiprocess_dir
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
        self.active_streams = Gauge(
            "qwen3tts_active_streams", "Engine streams open", ["endpoint"], registry=r, multiprocess_mode="livesum"
        )
        self.utterances = Counter(
            "qwen3tts_utterances", "Finished utterances", ["endpoint", "finish_reason"], registry=r
        )
        self.audio_seconds = Counter("qwen3tts_audio_seconds", "Audio seconds synthesized", registry=r)
        self.cancels = Counter(
            "qwen3tts_cancels", "Utterances stopped early (client = cancel message, disconnect)", ["reason"], registry=r
        )
        self.errors = Counter("qwen3tts_errors", "Errors returned to clients", ["code"], registry=r)
        self.busy = Counter(
            "qwen3tts_busy", "The errors `busy`, by what refused (protocol.BUSY_REASONS)", ["reason"], registry=r
        )
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
        self._held = _HeldCollector(sessions, queued)
        self._engine = _EngineCollector(engine_stats)
        r.register(self._held)
        r.register(self._engine)

    def render(self) -> bytes:
        """The exposition: this registry's, or under `serve --workers N` the sum over every worker's files."""
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._held)  # first: reading the counts drops a dead worker's live gauge files
        MultiProcessCollector(registry, path=str(self._multiprocess_dir))
        registry.register(self._engine)
        return generate_latest(registry)

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
