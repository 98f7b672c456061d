"""Load benchmark through `qwen3tts-agent serve`: open-loop Poisson arrivals from client processes.

Measures what a deployment's callers feel, the way nari-qwen3-tts and SGLang-Omni report their serving
figures: requests arrive at a fixed mean rate whatever the server does (open loop), from several client
processes of their own; each request is a fixed-length utterance; first audio is timed at the client,
from the `flush` sent (WebSocket, on a session opened before) or the request sent (HTTP, on a client process's
pool of keep-alive connections, as an SDK keeps them) to the first PCM bytes received. Each client
plays what it receives at real time from the first PCM on, with no extra buffer: a stream underruns when
its playback starves for more than 10 ms in all. Per rate: a warm-up, then a measured window (requests
started in it), then a drain: every stream of the window ends at its client, and then the server's live gauges
(streams open or queued, in the API workers and the engine) must come back to 0 within `--drain-timeout`; each
window reports how long that took (`drained_s`, None: never, a stream hung or leaked) and the gauges then.

`--held N` is the closed loop instead: N calls at once, each playing one utterance and, once its listener has
heard the last of it, asking for the next (starts spread over one utterance: a warm-up of at least that long
sees them all running). `--back-to-back` asks as soon as the audio is received: N streams generating at
once, and more playing, the faster the server (the held figures before 2026-12-03 were measured so).

`--capacity` searches instead for the highest open-loop rate the server serves well: at most 1 % of requests
refused (any error), at most 1 % of served streams underrunning and first audio p95 <= 100 ms (each a
`--capacity-*` option). One window per probed rate on the first of `--transports`, with the server kept running
and idle (no stream open or queued) before each: from `--capacity-from` req/s, doubling while the windows pass
(halving while they fail, should the first fail), then halving the gap between the highest passing and the lowest
failing rate until it is under
`--capacity-resolution` of the passing rate or `--capacity-steps` windows have run. The report's `capacity`
section has that rate, the frames a second it served, and each probe with the criteria it missed (their
windows are in `runs`).

    python -m benchmarks.serving.load --model synthetic:1.7b-customvoice --rates 1 20 40 80 --out load.json
    python -m benchmarks.serving.load --url ws://127.0.0.1:8000 --rates 5 --duration 10     # a running server
    python -m benchmarks.serving.load --url ws://127.0.0.1:8000 --client-urls ws://127.0.0.1:30000 \
        ws://127.0.0.1:30001 --rates 20          # clients spread over two replicas' own ports, metrics from --url
    python -m benchmarks.serving.load --model synthetic:0.6b --rates --held 256 --warmup 10 --duration 60
    python -m benchmarks.serving.load --model synthetic:1.7b-customvoice --capacity --duration 30 --out capacity.json

The server's own metrics (late chunks, underrun seconds, errors) are scraped after each window, and its stream
limit with the engine's streams every half second through it (`stream_limit_samples`: when late chunks cut it, how
low, from how many streams). With `--profile SECONDS` (a server started here, py-spy installed), the engine core
and every API worker are sampled from the window's start (`benchmarks/serving/profiling.py`): where each thread's
time went, and how much of it each of the core's threads held the GIL, go into the report, the raw stacks into
`--profile-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import httpx

TEXT = (
    "Thanks for calling. I can help you change your booking today; could you tell me the reference "
    "number and the name it was made under, please? Thank you."
)
SAMPLE_RATE = 24_000
FRAME_S = 0.08  # audio per codec frame
UNDERRUN_S = 0.010  # a stream whose playback starved this long in all counts as an underrun
BUSY_RETRY_S = 0.1  # a held stream refused with `busy` tries again after this long
# metric families kept per label set by `scrape` (the others are summed over their labels)
LABELLED_FAMILIES = (
    "qwen3tts_engine_loop_seconds", "qwen3tts_engine_late_chunks_by_index", "qwen3tts_engine_late_chunks_by_cause",
    "qwen3tts_engine_step_gap_seconds_by_hold", "qwen3tts_busy_total",
)
# streams open or waiting for a slot, in the API workers and in the engine: all 0 once the server is idle
LIVE_GAUGES = ("qwen3tts_active_streams", "qwen3tts_queued_requests", "qwen3tts_engine_active_streams",
               "qwen3tts_engine_queued_streams")


@dataclass
class Record:
    """One request as its client saw it (monotonic seconds)."""

    started: float  # arrival time (the request was due)
    transport: str
    first_audio_s: float | None = None
    audio_s: float = 0.0
    done_s: float | None = None  # flush/request -> last audio
    stall_s: float = 0.0  # total playback starvation after the first PCM
    played_until: float | None = None  # when its listener has heard the last of it (monotonic)
    stages_ms: dict[str, float] | None = None  # where the first chunk's time went (`done` metrics; an HTTP header)
    error: str | None = None
    failed_at: float | None = None  # when the error came (monotonic)

    @property
    def rtf(self) -> float | None:
        return self.audio_s / self.done_s if self.done_s else None


@dataclass
class ClientPlan:
    url: str
    transport: str
    rate: float
    duration: float
    seed: int
    voice: str | None
    language: str
    frames: int
    api_key: str | None
    start_at: float  # time.monotonic() (CLOCK_MONOTONIC: shared by the processes of one machine)
    held: int = 0  # closed loop instead: this many streams at once, each followed by the next (`held_loop`)
    back_to_back: bool = False  # a held stream's next request once its audio is received, not played
    hang_s: float | None = None  # a request with no `done`, error or close this long is given up as hung
    ramp_to: float | None = None  # open loop: the rate goes linearly from `rate` to this over `duration`
    records: list[Record] = field(default_factory=list)

    def rate_at(self, t: float) -> float:
        """The arrival rate at time `t` (monotonic) of the open loop."""
        if self.ramp_to is None:
            return self.rate
        return self.rate + (self.ramp_to - self.rate) * (t - self.start_at) / self.duration


class Playback:
    """A client that starts playing at the first PCM it receives, in real time, with no extra buffer."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.audio_s = 0.0
        self.stall_s = 0.0

    def receive(self, now: float, samples: int) -> None:
        if self.first is None:
            self.first = now
        else:
            # audio before this chunk runs out at first + audio + stalls so far; arriving later starves
            self.stall_s += max(0.0, now - (self.first + self.audio_s + self.stall_s))
        self.audio_s += samples / SAMPLE_RATE

    def ends_at(self) -> float | None:
        """When the last audio received so far has played out (None before the first PCM)."""
        return None if self.first is None else self.first + self.audio_s + self.stall_s


async def ws_request(plan: ClientPlan, record: Record) -> None:
    import websockets

    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else None
    async with websockets.connect(plan.url + "/v1/stream", additional_headers=headers, max_size=None) as ws:
        start = {"type": "start", "language": plan.language,
                 "sampling": {"max_frames": plan.frames, "ignore_eos": True}}
        if plan.voice:
            start["voice"] = plan.voice
        await ws.send(json.dumps(start))
        ready = json.loads(await ws.recv())
        if ready.get("type") != "ready":
            raise RuntimeError(f"{ready.get('code')}: {ready.get('message')}")
        await ws.send(json.dumps({"type": "text", "text": TEXT}))
        sent = time.monotonic()
        await ws.send(json.dumps({"type": "flush"}))
        playback = Playback()
        while True:
            message = await ws.recv()
            now = time.monotonic()
            if isinstance(message, bytes):
                if record.first_audio_s is None:
                    record.first_audio_s = now - sent
                playback.receive(now, len(message) // 2)
                continue
            body = json.loads(message)
            if body["type"] == "error":
                raise RuntimeError(f"{body['code']}: {body['message']}")
            if body["type"] == "done":
                record.done_s = now - sent
                record.stages_ms = (body.get("metrics") or {}).get("first_chunk_stages_ms")
                break
        await ws.send(json.dumps({"type": "close"}))
        record.audio_s, record.stall_s, record.played_until = playback.audio_s, playback.stall_s, playback.ends_at()


async def http_request(plan: ClientPlan, record: Record, client: httpx.AsyncClient) -> None:
    url = plan.url.replace("ws://", "http://").replace("wss://", "https://") + "/v1/audio/speech"
    body = {"model": "qwen3-tts", "input": TEXT, "response_format": "pcm", "language": plan.language,
            "sampling": {"max_frames": plan.frames, "ignore_eos": True}}
    if plan.voice:
        body["voice"] = plan.voice
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    playback = Playback()
    sent = time.monotonic()
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            detail = json.loads(await response.aread()).get("error", {})
            raise RuntimeError(f"{detail.get('code')}: {detail.get('message')}")
        stages = response.headers.get("x-first-chunk-stages")  # the server's split, as the WebSocket's `done` gives
        record.stages_ms = json.loads(stages) if stages else None
        leftover = 0
        async for piece in response.aiter_bytes():
            now = time.monotonic()
            if record.first_audio_s is None:
                record.first_audio_s = now - sent
            samples, leftover = divmod(leftover + len(piece), 2)
            playback.receive(now, samples)
    record.done_s = time.monotonic() - sent
    record.audio_s, record.stall_s, record.played_until = playback.audio_s, playback.stall_s, playback.ends_at()


async def run_client(plan: ClientPlan) -> list[Record]:
    if plan.transport == "ws":
        return await _run_requests(plan, ws_request)
    import httpx

    # one pool per client process, its connections kept alive between requests (no limit on their number)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await _run_requests(plan, functools.partial(http_request, client=client))


async def _run_requests(plan: ClientPlan, request) -> list[Record]:  # noqa: ANN001
    rng = random.Random(plan.seed)
    if plan.held:
        # playing streams start spread over one utterance, so that the calls' ends are spread too
        spread = 2.0 if plan.back_to_back else max(2.0, plan.frames * FRAME_S)
        await asyncio.gather(*(held_loop(plan, request, rng.uniform(0, spread)) for _ in range(plan.held)))
        return plan.records
    tasks = []
    t = plan.start_at
    end = plan.start_at + plan.duration
    top = max(plan.rate, plan.ramp_to or 0.0)  # a ramp's arrivals: those of its top rate, thinned
    while True:
        t += rng.expovariate(top)
        if t > end:
            break
        if plan.ramp_to is not None and rng.random() * top >= plan.rate_at(t):
            continue
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        record = Record(started=t, transport=plan.transport)
        plan.records.append(record)
        tasks.append(asyncio.create_task(_guarded(request, plan, record)))
    await asyncio.gather(*tasks)
    return plan.records


async def held_loop(plan: ClientPlan, request, offset: float) -> None:  # noqa: ANN001
    """One of the streams held at once, as a call holds it: its next request once its listener has heard the
    last one (played at real time from its first PCM, stalls included), or with `back_to_back` as soon as its
    audio was received, which keeps that many streams *generating* at once and, as streams are made faster
    than real time, several times as many playing; `BUSY_RETRY_S` after a refusal, as a client told to
    "retry shortly" would (a retry at once would turn each refusal into a storm of them). Starts are spread
    by `offset`."""
    await asyncio.sleep(max(0.0, plan.start_at + offset - time.monotonic()))
    while time.monotonic() < plan.start_at + plan.duration:
        record = Record(started=time.monotonic(), transport=plan.transport)
        plan.records.append(record)
        await _guarded(request, plan, record)
        if record.error is not None and "busy" in record.error:
            await asyncio.sleep(BUSY_RETRY_S)
        elif not plan.back_to_back and record.played_until is not None:
            await asyncio.sleep(max(0.0, record.played_until - time.monotonic()))


async def _guarded(request, plan: ClientPlan, record: Record) -> None:  # noqa: ANN001
    try:
        if plan.hang_s is None:
            await request(plan, record)
        else:
            await bounded_request(request(plan, record), plan.hang_s)
    except Exception as exc:  # noqa: BLE001 - every failure is a data point
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.failed_at = time.monotonic()


class Hung(Exception):
    """A request that got neither its `done`, an error nor a close within its bound."""


async def bounded_request(request: Awaitable[None], hang_s: float) -> None:
    """`request`, given up as `Hung` after `hang_s` (a timeout of the request's own, e.g. a handshake's, stays
    what it is). The abandoned request gets a few seconds to close its connection."""
    task = asyncio.ensure_future(request)
    try:
        done, _ = await asyncio.wait({task}, timeout=hang_s)
    except asyncio.CancelledError:  # the caller's: the request goes with it
        task.cancel()
        raise
    if task in done:
        task.result()  # the request's own error, if it failed
        return
    task.cancel()
    await asyncio.wait({task}, timeout=5.0)
    raise Hung(f"nothing ended it within {hang_s:g} s")


def client_process(plan: ClientPlan, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    results.put([asdict(r) for r in asyncio.run(run_client(plan))])


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def mean_overlap(spans: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """How many of `spans` are open at once on average over `window`."""
    covered = sum(max(0.0, min(end, window[1]) - max(start, window[0])) for start, end in spans)
    return covered / (window[1] - window[0])


def error_key(error: str) -> str:
    """A failed request's error by kind: the server's error code (`busy`, `not_ready`, ...) or the exception's name."""
    return error.split(":", 2)[1].strip() if error.startswith("RuntimeError") else error.split(":")[0]


def summarize(records: list[Record], window: tuple[float, float]) -> dict[str, object]:
    measured = [r for r in records if window[0] <= r.started < window[1]]
    ok = [r for r in measured if r.error is None and r.first_audio_s is not None]
    first = [1000 * r.first_audio_s for r in ok]  # type: ignore[operator]
    rtfs = [r.rtf for r in ok if r.rtf is not None]
    errors: dict[str, int] = {}
    for r in measured:
        if r.error is not None:
            key = error_key(r.error)
            errors[key] = errors.get(key, 0) + 1
    underruns = [r for r in ok if r.stall_s > UNDERRUN_S]
    staged = [r.stages_ms for r in ok if r.stages_ms]
    stages = {
        name: {"p50": pct([s[name] for s in staged], 50), "p95": pct([s[name] for s in staged], 95)}
        for name in (staged[0] if staged else {})
    }
    generating = [(r.started, r.started + r.done_s) for r in records if r.done_s is not None]
    playing = [(r.started, r.played_until) for r in records if r.played_until is not None]
    return {
        "requests": len(measured),
        "completed": len(ok),
        "achieved_rate_per_s": len(measured) / (window[1] - window[0]),
        "served_rate_per_s": len(ok) / (window[1] - window[0]),  # streams that played (not refused, not failed)
        "first_audio_ms": {"p50": pct(first, 50), "p95": pct(first, 95), "p99": pct(first, 99), "max": max(first, default=None)},
        "underrun_streams": len(underruns),
        "underrun_fraction": len(underruns) / len(ok) if ok else None,
        "stall_ms_p99": pct([1000 * r.stall_s for r in ok], 99),
        "slowest_stream_rtf": min(rtfs, default=None),
        "errors": errors,
        # streams at once over the window, on average: in the server (request to last audio), and playing
        # (request to the end of its playback: a call's span)
        "mean_streams_generating": mean_overlap(generating, window),
        "mean_streams_playing": mean_overlap(playing, window),
        # server side, from the engine's timestamps: submit -> prompt done -> first frame -> decoded -> sent
        # (over HTTP, also the request before its submit: body, checks, slot)
        "first_chunk_stages_ms": stages,
    }


def capacity_figures(summary: dict[str, Any]) -> dict[str, float | None]:
    """What `--capacity` judges a window by: the fraction of its requests refused (any error: a caller who got
    no audio was not served), the fraction of its served streams that underran, first audio p95 (ms)."""
    requests = summary["requests"]
    refused = sum(summary["errors"].values())
    return {
        "refused_fraction": refused / requests if requests else None,
        "underrun_fraction": summary["underrun_fraction"],
        "p95_first_audio_ms": summary["first_audio_ms"]["p95"],
    }


def missed_criteria(figures: dict[str, float | None], limits: dict[str, float]) -> list[str]:
    """The figures over their limit, by name. A figure a window could not measure (no request, no stream
    served) misses too: such a window shows nothing served well."""
    return [name for name, limit in limits.items() if (figure := figures[name]) is None or figure > limit]


def device_ceiling_from_budget(path: Path) -> float:
    """The device's ceiling in frames a second from a `benchmarks/engine/bench_device_budget.py` report: its most
    utterances a second (at its fullest frame steps and codec calls, nothing overlapping, nothing waiting) times
    its frames an utterance."""
    budget = json.loads(path.read_text())
    return max(row["utterances_per_s"] for row in budget["budget"]) * budget["frames"]


class CapacitySearch:
    """The highest open-loop rate whose window passes, in few windows (each costs a warm-up, a window and a
    drain): from `start`, double while windows pass (halve while they fail, if the first did: a start above the
    capacity still finds it), then bisect between the highest passing and the lowest failing rate until that gap
    is under `resolution` times the passing rate or `max_steps` windows have run.
    No I/O, so that the rule is tested on its own: `next_rate` says what to probe, `record` takes the outcome.
    Bisection only probes between the two, so every rate above the highest passing one that ran failed."""

    def __init__(self, start: float, resolution: float, max_steps: int) -> None:
        self.start = start
        self.resolution = resolution
        self.max_steps = max_steps
        self.probes: list[tuple[float, bool]] = []  # (rate, passed), in the order they ran

    def record(self, rate: float, passed: bool) -> None:
        self.probes.append((rate, passed))

    @property
    def passing(self) -> float | None:
        """The highest rate that passed (None while none has)."""
        return max((rate for rate, passed in self.probes if passed), default=None)

    @property
    def failing(self) -> float | None:
        """The lowest rate that failed (None while none has)."""
        return min((rate for rate, passed in self.probes if not passed), default=None)

    def next_rate(self) -> float | None:
        """The rate to probe next, or None when the search is done (the gap is within the resolution, or the
        windows are spent)."""
        if not self.probes:
            return self.start
        passing, failing = self.passing, self.failing
        if len(self.probes) >= self.max_steps:
            return None
        if passing is None:
            assert failing is not None  # a window ran and did not pass
            return failing / 2
        if failing is None:
            return 2 * passing
        if failing - passing < self.resolution * passing:
            return None
        return (passing + failing) / 2


def scrape(url: str, api_key: str | None) -> dict[str, float]:
    """The server's Prometheus counters and gauges (families named qwen3tts_*): counters summed over their
    labels, the engine's loop seconds per phase and its late chunks per chunk index."""
    request = urllib.request.Request(url.replace("ws://", "http://") + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    values: dict[str, float] = {}
    with urllib.request.urlopen(request, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("qwen3tts_") and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                key = name if name.startswith(LABELLED_FAMILIES) else name.split("{")[0]
                if key.endswith("_bucket"):
                    continue
                values[key] = values.get(key, 0.0) + float(value)
    return values


def _cumulative(name: str) -> bool:
    """Counters and sums (a window's figure is after minus before), not gauges."""
    if name.endswith("_created"):
        return False
    return any(mark in name for mark in ("_total", "_sum", "_count", "loop_seconds", "frames_generated", "steps",
                                         "late_chunks", "underrun_seconds", "streams_started", "cancels", "errors",
                                         "codec_decodes", "codec_chunks", "clock_releases", "first_audio_holds",
                                         "stream_limit_cuts", "stream_limit_seconds", "step_device_seconds",
                                         "step_flight_seconds", "step_gap_seconds"))


def engine_figures(metrics: dict[str, float], seconds: float) -> dict[str, object]:
    """From the counter deltas over `seconds` (warm-up, window and drain): steps and codec calls a second,
    the mean rows per batched step (first-frame steps apart), its mean device time, its time in flight beyond that
    and the gap before the next while rows could step, in all and by what held the step back (ms: where a step's
    time goes), the share of them queued while another was in flight (no gap), the batched steps a second
    that went before the step clock's tick for a stream's deadline and that waited for a new stream's first frame
    and first chunk,
    and the codec calls a second (those of the early lane apart) with their mean chunks; the chunks that left
    late, by their place in their stream (the second chunk, the third, the fourth, later ones) and by why (their
    frames made after they were due, or their decode late); the times late chunks cut the streams the engine takes
    on, and the seconds that limit stayed below the slots; and the `busy` refusals by what refused them (the
    server's limits, the engine's rules: `protocol.BUSY_REASONS`)."""
    steps, decodes = metrics.get("qwen3tts_engine_steps", 0.0), metrics.get("qwen3tts_engine_codec_decodes", 0.0)
    first = metrics.get("qwen3tts_engine_first_frame_steps", 0.0)
    frames = metrics.get("qwen3tts_engine_frames_generated", 0.0)
    timed = metrics.get("qwen3tts_engine_timed_steps", 0.0)
    device_s = metrics.get("qwen3tts_engine_step_device_seconds", 0.0)
    return {
        "steps_per_s": steps / seconds,
        "first_frame_steps_per_s": first / seconds,
        "clock_releases_per_s": metrics.get("qwen3tts_engine_clock_releases", 0.0) / seconds,
        "first_audio_holds_per_s": metrics.get("qwen3tts_engine_first_audio_holds", 0.0) / seconds,
        "mean_step_batch": (frames - first) / (steps - first) if steps > first else None,  # a first-frame step: ~1 row
        # a batched step's mean device time, its time in flight beyond that, and the gap before the next (ms)
        "step_device_ms": 1000 * device_s / timed if timed else None,
        "step_flight_beyond_device_ms": (
            1000 * (metrics.get("qwen3tts_engine_step_flight_seconds", 0.0) - device_s) / timed if timed else None
        ),
        "step_gap_ms": (
            1000 * metrics.get("qwen3tts_engine_step_gap_seconds", 0.0) / (steps - first) if steps > first else None
        ),
        # of the batched steps, the share queued while another was in flight: no gap, the device kept busy
        "overlapped_step_share": (
            metrics.get("qwen3tts_engine_steps_overlapped", 0.0) / (steps - first) if steps > first else None
        ),
        "step_gap_ms_by_hold": {
            hold: 1000 * seconds / (steps - first)
            for hold, seconds in by_label(metrics, "qwen3tts_engine_step_gap_seconds_by_hold", "hold").items()
        } if steps > first else {},
        "codec_decodes_per_s": decodes / seconds,
        "early_codec_decodes_per_s": metrics.get("qwen3tts_engine_early_codec_decodes", 0.0) / seconds,
        "mean_codec_batch": metrics.get("qwen3tts_engine_codec_chunks", 0.0) / decodes if decodes else None,
        "late_chunks_by_index": by_label(metrics, "qwen3tts_engine_late_chunks_by_index", "index"),
        "late_chunks_by_cause": by_label(metrics, "qwen3tts_engine_late_chunks_by_cause", "cause"),
        "stream_limit_cuts": metrics.get("qwen3tts_engine_stream_limit_cuts", 0.0),
        "stream_limit_seconds": metrics.get("qwen3tts_engine_stream_limit_seconds", 0.0),
        "busy_by_reason": {k: v for k, v in by_label(metrics, "qwen3tts_busy_total", "reason").items() if v},
    }


def by_label(metrics: dict[str, float], family: str, label: str) -> dict[str, float]:
    """A labelled family's values (as `scrape` keeps them: `LABELLED_FAMILIES`) by their one `label`'s value."""
    return {name.split(f'{label}="')[1].rstrip('"}'): value for name, value in metrics.items()
            if name.startswith(f"{family}{{")}


def wait_until_idle(url: str, api_key: str | None, timeout: float) -> float | None:
    """Seconds until the server's /metrics showed no stream open or queued (`LIVE_GAUGES`), or None if it still
    had some after `timeout`: a window's last streams (or hung ones) would otherwise load the next window."""
    began = time.monotonic()
    while any(scrape(url, api_key).get(name, 0.0) for name in LIVE_GAUGES):
        if time.monotonic() - began > timeout:
            return None
        time.sleep(0.2)
    return time.monotonic() - began


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "qwen3tts_agent.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-queued", "100000", "--queue-timeout", "60", "--max-sessions", "100000", *args.server_arg]
    log = open(args.server_log, "wb") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"ws://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"serve exited with code {server.returncode} (see --server-log)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                if response.status == 200:
                    return server, url
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"serve was not ready within {args.startup_timeout} s")


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind this process as `SystemExit`, so that its `finally` blocks stop the server it started.
    Killed outright (`timeout`, a job runner), a benchmark left `serve` in its own session holding the GPU, and the
    next benchmark's server could not load its model. (Signal handlers belong to the main thread: elsewhere, as
    when a test runs a benchmark on a thread of its own, this does nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        return

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to serve's process group (the supervisor stops its workers and core), SIGKILL after 60 s."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


class PeriodicSampler(threading.Thread):
    """`take()` every `every_s` seconds from `start_at` (monotonic) until `stop`, which returns what it took (a None
    taken is left out): the figures a window's or a run's totals do not show, as they went."""

    def __init__(self, take: Callable[[], Any], every_s: float, start_at: float, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.take, self.every_s, self.start_at = take, every_s, start_at
        self.samples: list[Any] = []
        self._stopped = threading.Event()

    def run(self) -> None:
        if self._stopped.wait(max(0.0, self.start_at - time.monotonic())):
            return
        while True:
            if (sample := self.take()) is not None:
                self.samples.append(sample)
            if self._stopped.wait(self.every_s):
                return

    def stop(self, timeout: float) -> list[Any]:
        self._stopped.set()
        self.join(timeout)
        return self.samples


STREAM_LIMIT_EVERY_S = 0.5


def stream_limit_row(url: str, api_key: str | None, start_at: float) -> list[float] | None:
    """[seconds from `start_at`, the engine's stream limit, active streams, queued streams] (`run_rate` samples it
    through each window: when late chunks cut the limit and how low, which the window's `stream_limit_seconds`
    does not say); None where the scrape failed or had no limit."""
    try:
        gauges = scrape(url, api_key)
    except OSError:  # a scrape that timed out or was refused: the next one may not be
        return None
    if "qwen3tts_engine_stream_limit" not in gauges:
        return None
    return [round(time.monotonic() - start_at, 2), gauges["qwen3tts_engine_stream_limit"],
            gauges.get("qwen3tts_engine_active_streams", 0.0), gauges.get("qwen3tts_engine_queued_streams", 0.0)]


def run_rate(
    args: argparse.Namespace, url: str, rate: float, transport: str, held: int = 0, server_pid: int | None = None
) -> dict[str, object]:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    start_at = time.monotonic() + 2.0  # every client process is up by then
    total = args.warmup + args.duration
    endpoints = args.client_urls or [url]
    clients = [
        context.Process(target=client_process, args=(ClientPlan(
            endpoints[i % len(endpoints)], transport, rate / args.clients, total, seed=1000 * i + int(rate * 10), voice=args.voice,
            language=args.language, frames=args.frames, api_key=args.api_key, start_at=start_at,
            held=held // args.clients + (1 if i < held % args.clients else 0), back_to_back=args.back_to_back,
        ), results))
        for i in range(args.clients)
    ]
    before, scraped = scrape(url, args.api_key), time.monotonic()
    for c in clients:
        c.start()
    profile = _ProfileWindow(args, server_pid, f"{transport}-{held}-held" if held else f"{transport}-{rate:g}")
    profile.start_at(start_at + args.warmup)
    # from the warm-up's start: a cut there counts too
    sampler = PeriodicSampler(lambda: stream_limit_row(url, args.api_key, start_at), STREAM_LIMIT_EVERY_S, start_at,
                              "stream-limit-sampler")
    sampler.start()
    records: list[Record] = []
    try:
        for _ in clients:
            records += [Record(**r) for r in results.get(timeout=total + args.drain_timeout)]
    finally:
        samples = {"period_s": STREAM_LIMIT_EVERY_S, "columns": ["s", "limit", "active", "queued"],
                   "rows": sampler.stop(timeout=15)}
    for c in clients:
        c.join()
    after, elapsed = scrape(url, args.api_key), time.monotonic() - scraped
    # The live gauges lag the clients a little (the engine's stats are a snapshot, Ray's metrics are pushed), so the
    # gauges that count are those once the server says it is idle, or after --drain-timeout if it never does.
    drained_s = wait_until_idle(url, args.api_key, args.drain_timeout)
    gauges = scrape(url, args.api_key)
    window = (start_at + args.warmup, start_at + total)
    summary = summarize(records, window)
    if held:
        summary["held_streams"] = held
        summary["held_until"] = "received" if args.back_to_back else "played"
    metrics = {k: after[k] - before.get(k, 0.0) for k in after if _cumulative(k)}
    summary.update(rate_per_s=rate, transport=transport, clients=args.clients, window_s=args.duration,
                   engine=engine_figures(metrics, elapsed), server_metrics=metrics, drained_s=drained_s,
                   server_gauges_after={k: v for k, v in gauges.items() if not _cumulative(k)},
                   stream_limit_samples=samples)
    if profile.enabled:
        summary["profile"] = profile.result()
    return summary


def run_capacity(args: argparse.Namespace, report: dict[str, Any], url: str, server_pid: int | None) -> None:
    """`--capacity`: probe rates as `CapacitySearch` says, one window each on the first transport, each window
    kept in the report's runs and judged in its `capacity` section (rewritten after every window)."""
    transport = args.transports[0]
    limits = {"refused_fraction": args.capacity_max_refused, "underrun_fraction": args.capacity_max_underrun,
              "p95_first_audio_ms": args.capacity_p95_ms}
    search = CapacitySearch(args.capacity_from, args.capacity_resolution, args.capacity_steps)
    probes: list[dict[str, Any]] = []
    capacity: dict[str, Any] = {
        "transport": transport, "criteria_max": limits, "frames_per_utterance": args.frames,
        "rate_per_s": None, "frames_per_s_served": None,
        "device_ceiling_frames_per_s": args.device_ceiling_frames_per_s, "probes": probes,
    }
    report["capacity"] = capacity
    runs: list[dict[str, object]] = report["runs"]
    rate = search.next_rate()
    while rate is not None:
        idle_wait_s = wait_until_idle(url, args.api_key, args.drain_timeout)
        print(f"[{time.strftime('%H:%M:%S')}] capacity probe {len(probes) + 1}: {transport} at {rate:g} req/s ...",
              flush=True)
        summary = run_rate(args, url, rate, transport, server_pid=server_pid)
        summary["idle_wait_s"] = idle_wait_s
        runs.append(summary)
        print_summary(summary)
        figures = capacity_figures(summary)
        missed = missed_criteria(figures, limits)
        search.record(rate, passed=not missed)
        probes.append({"rate_per_s": rate, "passed": not missed, "failed": missed, **figures,
                       "served_rate_per_s": summary["served_rate_per_s"], "run": len(runs) - 1})
        best = next((p for p in probes if p["rate_per_s"] == search.passing), None)
        if best is not None:
            capacity["rate_per_s"] = best["rate_per_s"]
            capacity["frames_per_s_served"] = best["served_rate_per_s"] * args.frames
        write_report(args, report)
        rate = search.next_rate()
    print_capacity(capacity)


class _ProfileWindow:
    """py-spy over the server's processes from the window's start (`--profile`); a no-op without it."""

    def __init__(self, args: argparse.Namespace, server_pid: int | None, name: str) -> None:
        self.enabled = bool(args.profile) and server_pid is not None
        self._seconds = min(args.profile, args.duration)
        self._server_pid = server_pid
        self._dir = args.profile_dir / name
        self._py_spy = args.py_spy
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, object] = {}

    def start_at(self, when: float) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, args=(when,), daemon=True)
            self._thread.start()

    def _run(self, when: float) -> None:
        from benchmarks.serving import profiling

        time.sleep(max(0.0, when - time.monotonic()))
        try:
            assert self._server_pid is not None
            recorders = profiling.start(profiling.serve_processes(self._server_pid), self._seconds, self._dir, self._py_spy)
            self._outcome = profiling.finish(recorders, self._dir, timeout=self._seconds + 60)
        except Exception as exc:  # noqa: BLE001 - a failed profile is reported, the measurement stands
            self._outcome = {"error": f"{type(exc).__name__}: {exc}"}

    def result(self) -> dict[str, object]:
        if self._thread is not None:
            self._thread.join(self._seconds + 90)
        return {"seconds": self._seconds, "raw_dir": str(self._dir), "processes": self._outcome}


def print_summary(summary: dict[str, object]) -> None:
    fa = summary["first_audio_ms"]

    def fixed(value: object, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    print(f"  first audio p50 {fixed(fa['p50'])} / p95 {fixed(fa['p95'])} / p99 {fixed(fa['p99'])} ms; "  # type: ignore[index]
          f"underrun {summary['underrun_streams']}/{summary['completed']}; served "
          f"{fixed(summary['served_rate_per_s'])}/s; slowest RTF {fixed(summary['slowest_stream_rtf'], 2)}; "
          f"errors {summary['errors']}", flush=True)
    if summary.get("drained_s", 0.0) is None:
        live = {k: v for k, v in summary["server_gauges_after"].items() if k in LIVE_GAUGES and v}  # type: ignore[attr-defined]
        print(f"  NOT DRAINED: the server still had {live} after the window's streams ended (hung or leaked)", flush=True)
    if "held_streams" in summary:
        print(f"  held until {summary['held_until']}: {summary['achieved_rate_per_s']:.1f} requests/s, streams at once "
              f"{summary['mean_streams_generating']:.0f} generating, {summary['mean_streams_playing']:.0f} playing",
              flush=True)
    print(f"  first chunk stages (ms): {json.dumps(summary['first_chunk_stages_ms'])}", flush=True)
    engine = {k: round(v, 1) if isinstance(v, float) else v for k, v in summary["engine"].items()}  # type: ignore[attr-defined]
    print(f"  engine: {json.dumps(engine)}", flush=True)
    rows = summary.get("stream_limit_samples", {}).get("rows", [])  # type: ignore[attr-defined]
    if rows and (lowest := min(rows, key=lambda row: row[1]))[1] < max(row[1] for row in rows):
        print(f"  stream limit lowest {lowest[1]:.0f} at {lowest[0]:.1f} s from the warm-up's start "
              f"({lowest[2]:.0f} streams active, {lowest[3]:.0f} queued)", flush=True)


def print_capacity(capacity: dict[str, Any]) -> None:
    limits = capacity["criteria_max"]
    probes = ", ".join(f"{p['rate_per_s']:g} " + ("pass" if p["passed"] else "fail (" + ", ".join(p["failed"]) + ")")
                       for p in capacity["probes"])
    served = capacity["frames_per_s_served"]
    ceiling = capacity["device_ceiling_frames_per_s"]
    found = "none of the rates probed" if capacity["rate_per_s"] is None else (
        f"{capacity['rate_per_s']:g} req/s, {served:.0f} frames/s served"
        + (f" (device ceiling {ceiling:.0f})" if ceiling is not None else ""))
    print(f"capacity over {capacity['transport']} (refused <= {limits['refused_fraction']:.1%}, underrun <= "
          f"{limits['underrun_fraction']:.1%}, first audio p95 <= {limits['p95_first_audio_ms']:g} ms): {found}; "
          f"probes {probes}", flush=True)


def write_report(args: argparse.Namespace, report: dict[str, object]) -> None:
    """Write the report so far (after every run: a run cut short by a time limit keeps the ones before)."""
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


def _py_spy() -> str:
    """py-spy on the PATH, else beside this interpreter (a virtual environment's bin/)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else "py-spy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:tiny")
    parser.add_argument("--url", help="a running server (ws://host:port); otherwise serve is started here")
    parser.add_argument("--client-urls", nargs="+",
                        help="the endpoints the client processes send to instead of --url, client i to the i-th "
                             "modulo their number (e.g. each replica of serve-ray --direct-ingress); the server's "
                             "metrics are still read from --url")
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument for serve (repeatable)")
    parser.add_argument("--server-log", help="write serve's output here")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--api-key")
    parser.add_argument("--rates", type=float, nargs="*", help="open-loop rates, req/s (default: 1)")
    parser.add_argument("--held", type=int, nargs="*", default=[],
                        help="closed loop: streams held at once, each followed by the next once it has played")
    parser.add_argument("--back-to-back", action="store_true",
                        help="a held stream's next request as soon as its audio is received (not played)")
    parser.add_argument("--http-rates", type=float, nargs="*", help="rates for the HTTP transport (default: --rates)")
    parser.add_argument("--transports", nargs="+", default=["ws"], choices=["ws", "http"])
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of arrivals before the window")
    parser.add_argument("--duration", type=float, default=60.0, help="measured window, seconds of arrivals")
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--frames", type=int, default=100, help="frames per utterance (100 = 8 s)")
    parser.add_argument("--voice")
    parser.add_argument("--language", default="english")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", type=float, default=0.0,
                        help="sample the server's processes with py-spy for this many seconds of each window")
    parser.add_argument("--profile-dir", type=Path, help="raw py-spy stacks (default: beside --out)")
    parser.add_argument("--py-spy", default=_py_spy(), help="the py-spy executable")
    parser.add_argument("--capacity", action="store_true",
                        help="search the highest rate meeting the --capacity-* criteria (instead of --rates, --held)")
    parser.add_argument("--capacity-from", type=float, default=10.0, help="the first rate probed, req/s")
    parser.add_argument("--capacity-resolution", type=float, default=0.1,
                        help="stop once the highest passing and lowest failing rates are closer than this "
                             "fraction of the passing one")
    parser.add_argument("--capacity-steps", type=int, default=8, help="at most this many windows")
    parser.add_argument("--capacity-max-refused", type=float, default=0.01,
                        help="fraction of requests that may fail (refused or any other error)")
    parser.add_argument("--capacity-max-underrun", type=float, default=0.01,
                        help="fraction of served streams that may underrun")
    parser.add_argument("--capacity-p95-ms", type=float, default=100.0, help="first audio p95 limit, ms")
    ceiling = parser.add_mutually_exclusive_group()
    ceiling.add_argument("--device-ceiling-frames-per-s", type=float,
                         help="the device's measured ceiling (benchmarks/engine/bench_device_budget.py), "
                              "copied into the capacity section beside the frames served")
    ceiling.add_argument("--device-budget", type=Path,
                         help="bench_device_budget.py's report for this model and device: its ceiling goes beside "
                              "the frames served (`device_ceiling_from_budget`)")
    args = parser.parse_args()
    if args.device_budget is not None:
        args.device_ceiling_frames_per_s = device_ceiling_from_budget(args.device_budget)
    if args.capacity and (args.rates or args.held or args.http_rates):
        parser.error("--capacity picks its own rates: no --rates, --http-rates or --held with it")
    if args.rates is None:
        args.rates = [1.0]
    if args.profile_dir is None:
        args.profile_dir = args.out.with_suffix("") if args.out else Path("load-profile")
    if args.profile and args.url:
        parser.error("--profile needs the server started here (not --url)")
    if args.client_urls and (not args.url or args.clients % len(args.client_urls)):
        parser.error("--client-urls needs --url (for the metrics) and --clients a multiple of their number")

    server = None
    url = args.url
    unwind_on_sigterm()
    try:
        if url is None:
            server, url = start_server(args)
        report: dict[str, object] = {
            "command": " ".join(sys.argv), "model": args.model, "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": [],
        }
        report["server_gauges_start"] = {k: v for k, v in scrape(url, args.api_key).items() if not _cumulative(k)}
        if args.capacity:
            run_capacity(args, report, url, server.pid if server else None)
            return
        for transport in args.transports:
            rates = args.http_rates if transport == "http" and args.http_rates is not None else args.rates
            for rate in rates:
                print(f"[{time.strftime('%H:%M:%S')}] {transport} at {rate:g} req/s ...", flush=True)
                summary = run_rate(args, url, rate, transport, server_pid=server.pid if server else None)
                report["runs"].append(summary)  # type: ignore[union-attr]
                print_summary(summary)
                write_report(args, report)
            for held in args.held:
                print(f"[{time.strftime('%H:%M:%S')}] {transport}, {held} streams held ...", flush=True)
                summary = run_rate(args, url, 0.0, transport, held=held, server_pid=server.pid if server else None)
                report["runs"].append(summary)  # type: ignore[union-attr]
                print_summary(summary)
                write_report(args, report)
    finally:
        if server is not None:
            stop_server(server)


if __name__ == "__main__":
    main()
