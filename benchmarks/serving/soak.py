"""Soak: thousands of mixed utterances through a real server, then its memory and its metrics are checked.

The server runs in a child process (uvicorn on loopback, as `qwen3tts-agent serve` runs it), so the memory
measured is the server's alone; the clients here are real websockets and httpx clients doing what clients do:
whole utterances streamed in as text deltas, cancels mid-stream, disconnects mid-stream, bad messages,
whitespace-only utterances, oversize messages, and OpenAI-style HTTP requests, good and bad. A request the
server refuses as `busy` (a GPU engine sheds new streams while it runs behind real time) is counted with the
errors, and an HTTP one is retried shortly, as a client would.

Checks (each in the report, all must hold): the server's RSS grows less than `--max-rss-growth-mb` over the
second half of the measured run (a leak grows with every unit; the allocator's arenas grow in steps for the
first several hundred units and then stay flat, so growth from the end of the warm-up is reported, not judged); `torch.cuda.memory_allocated` returns to its value after the warm-up (GPU);
every counter in /metrics equals what the clients saw (utterances by finish reason, errors by code, cancels by
reason, first-audio count); nothing is left open (sessions, streams, queue, engine slots); no engine errors.

    python -m benchmarks.serving.soak --model synthetic:tiny --utterances 1000 --out soak-cpu.json
    python -m benchmarks.serving.soak --model synthetic:0.6b --device cuda --utterances 10000 --concurrency 64 \\
        --max-streams 64 --max-rss-growth-mb 50 --out soak-gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import gc
import itertools
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

API_KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KINDS = {  # unit of work -> share of the run
    "speak": 0.55,
    "cancel": 0.10,
    "disconnect": 0.08,
    "bad_message": 0.10,
    "whitespace": 0.03,
    "oversize": 0.02,
    "http": 0.08,
    "http_bad": 0.04,
}
BUSY_RETRIES = 100  # tries of an HTTP request the server refuses as busy (engine behind real time, queue full)
WORDS = ("hello", "there", "how", "can", "I", "help", "you", "today", "the", "weather", "is", "lovely", "and",
         "the", "train", "leaves", "at", "nine")


@dataclass
class Options:
    model: str = "synthetic:tiny"
    device: str = "cpu"
    utterances: int = 1000
    concurrency: int = 6
    rate: float = 0.0  # units started per second; 0: as fast as the workers go
    frames: int = 3  # frames per complete utterance (synthetic weights never end one by themselves)
    max_streams: int = 16
    warmup_fraction: float = 0.1
    seed: int = 0
    max_rss_growth_mb: float = 20.0


# ---------------------------------------------------------------------- the server, in its own process
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_free_heap() -> None:
    """Hand the allocator's free memory back to the system before RSS is read (glibc's `malloc_trim`; elsewhere
    nothing): freed blocks that a thread's arena keeps would otherwise count as growth (a CI run once failed on
    such retention alone, its repeats passing far inside the limit). A leak keeps its memory in use, so it still
    shows."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _serve(conn: Connection, options: Options) -> None:
    """Child process: load the engine, serve on loopback, answer probes until told to stop."""
    import torch
    import uvicorn

    from qwen3tts_agent import Engine
    from qwen3tts_agent.server import ServerConfig, create_app
    from qwen3tts_agent.server.connections import uvicorn_config

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    engine = Engine.load(options.model, device=options.device, progress=False, max_streams=options.max_streams)
    voices = tempfile.TemporaryDirectory()
    config = ServerConfig(
        api_key=API_KEY,
        model_name=options.model,
        voices_dir=Path(voices.name),
        max_sessions=4 * options.concurrency + 16,
        max_queued=4 * options.concurrency + 16,
        queue_timeout_s=120.0,
        max_message_bytes=16 * 1024,
        max_frames=2000,
        idle_timeout_s=120.0,
    )
    app = create_app(config, engine=engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, config, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    state = app.state.server
    while not (server.started and (state.ready or state.failure)):
        time.sleep(0.05)
    conn.send({"port": sock.getsockname()[1], "failure": state.failure})
    cuda = options.device.startswith("cuda")
    while (command := conn.recv()) != "stop":
        assert command == "probe"
        gc.collect()
        _release_free_heap()
        if cuda:
            torch.cuda.synchronize()
        conn.send(
            {
                "rss_bytes": _rss_bytes(),
                "cuda_allocated_bytes": torch.cuda.memory_allocated() if cuda else None,
                "engine": {k: v for k, v in asdict(engine.stats()).items() if k != "loop_seconds"},
            }
        )
    server.should_exit = True
    thread.join(30)
    engine.close()
    voices.cleanup()
    conn.send("stopped")


class ServerProcess:
    def __init__(self, options: Options) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing inherited from ours
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, options), daemon=True)
        self._process.start()
        if not self._conn.poll(600):
            raise RuntimeError("the server did not start within 600 s")
        hello = self._conn.recv()
        if hello["failure"]:
            raise RuntimeError(f"the server failed to start: {hello['failure']}")
        self.port: int = hello["port"]

    def probe(self) -> dict[str, Any]:
        self._conn.send("probe")
        return self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, EOFError):
            self._conn.send("stop")
            self._conn.poll(60) and self._conn.recv()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


# ---------------------------------------------------------------------- the clients
@dataclass
class Tally:
    """What the clients saw; the server's metrics must say the same."""

    units: collections.Counter[str] = field(default_factory=collections.Counter)
    ws_opened: int = 0  # utterances the server opened for a WebSocket client
    ws_done: collections.Counter[str] = field(default_factory=collections.Counter)  # by finish_reason
    ws_lost: int = 0  # utterances whose session ended before their done (the client left)
    ws_first_audio: int = 0  # utterances finished normally with audio (the first-audio histogram's count)
    http_ok: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # every error code received
    cancels_client: int = 0
    cancels_disconnect: int = 0
    first_audio_s: list[float] = field(default_factory=list)  # flush -> first audio, client side
    cancel_s: list[float] = field(default_factory=list)  # cancel sent -> its done received


class Worker:
    """One client at a time with two sessions it reuses: short utterances, and long ones it interrupts."""

    def __init__(self, port: int, options: Options, tally: Tally) -> None:
        self.ws_url = f"ws://127.0.0.1:{port}/v1/stream"
        self.http_url = f"http://127.0.0.1:{port}"
        self.options = options
        self.tally = tally
        self.short: Any = None
        self.long: Any = None

    async def _session(self, sampling: dict[str, Any]) -> Any:
        from websockets.asyncio.client import connect

        ws = await connect(self.ws_url, additional_headers=AUTH, proxy=None, open_timeout=60, max_size=2**24)
        await ws.send(json.dumps({"type": "start", "sampling": sampling}))
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready", ready
        return ws

    async def short_session(self, rng: random.Random) -> Any:
        if self.short is None:
            self.short = await self._session({"max_frames": self.options.frames, "seed": rng.randrange(2**31)})
        return self.short

    async def long_session(self, rng: random.Random) -> Any:
        if self.long is None:
            sampling = {"max_frames": 2000, "ignore_eos": True, "seed": rng.randrange(2**31)}
            self.long = await self._session(sampling)
        return self.long

    async def close(self) -> None:
        for ws in (self.short, self.long):
            if ws is not None:
                await ws.send(json.dumps({"type": "close"}))
                with contextlib.suppress(Exception):
                    while True:  # to the server's close (1000)
                        await asyncio.wait_for(ws.recv(), 60)
        self.short = self.long = None

    async def run(self, kind: str, rng: random.Random) -> None:
        self.tally.units[kind] += 1
        await getattr(self, kind)(rng)

    # ------------------------------------------------------------------ units
    async def speak(self, rng: random.Random) -> None:
        ws = await self.short_session(rng)
        words = rng.sample(WORDS, rng.randint(2, 6))
        for i, word in enumerate(words):
            await ws.send(json.dumps({"type": "text", "text": (" " if i else "") + word}))
        await ws.send(json.dumps({"type": "text", "text": "."}))
        flushed = time.perf_counter()
        await ws.send(json.dumps({"type": "flush"}))
        self.tally.ws_opened += 1
        first = None
        async for message in self._until_done(ws):
            if message.get("type") == "audio" and first is None:
                first = time.perf_counter() - flushed
            if message.get("type") == "done":
                self._record_done(message)
        if first is not None:
            self.tally.first_audio_s.append(first)

    async def cancel(self, rng: random.Random) -> None:
        ws = await self.long_session(rng)
        await ws.send(json.dumps({"type": "text", "text": "This answer goes on until the caller cuts in."}))
        await ws.send(json.dumps({"type": "flush"}))
        self.tally.ws_opened += 1
        if not await self._first_audio(ws):
            return
        sent = time.perf_counter()
        await ws.send(json.dumps({"type": "cancel"}))
        self.tally.cancels_client += 1
        async for message in self._until_done(ws):
            if message.get("type") == "done":
                assert message["finish_reason"] == "cancelled", message
                self._record_done(message)
        self.tally.cancel_s.append(time.perf_counter() - sent)

    async def disconnect(self, rng: random.Random) -> None:
        ws = await self.long_session(rng)
        await ws.send(json.dumps({"type": "text", "text": "Nobody will hear the end of this."}))
        await ws.send(json.dumps({"type": "flush"}))
        self.tally.ws_opened += 1
        if not await self._first_audio(ws):
            return
        self.long = None
        ws.transport.abort()  # no close frame: the TCP connection just drops
        self.tally.ws_lost += 1
        self.tally.cancels_disconnect += 1

    async def bad_message(self, rng: random.Random) -> None:
        ws = await self.short_session(rng)
        raw, code = rng.choice(
            [
                ("{not json", "invalid_json"),
                ('{"type": "sing"}', "unknown_type"),
                ('{"type": "text", "text": "bad \\ud800 text"}', "invalid_text"),
                ("[" * 100 + "]" * 100, "invalid_json"),
                ('{"type": "flush", "now": true}', "invalid_message"),
                ('{"type": "start"}', "already_started"),
            ]
        )
        await ws.send(raw)
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))
        assert message["type"] == "error" and message["code"] == code, (raw, message)
        self.tally.errors[code] += 1

    async def whitespace(self, rng: random.Random) -> None:
        ws = await self.short_session(rng)
        await ws.send(json.dumps({"type": "text", "text": rng.choice([" ", "\n", "  \t "])}))
        await ws.send(json.dumps({"type": "flush"}))
        self.tally.ws_opened += 1
        async for message in self._until_done(ws):
            if message.get("type") == "done":
                assert message["finish_reason"] == "error", message
                self._record_done(message)

    async def oversize(self, rng: random.Random) -> None:
        ws = await self.short_session(rng)
        self.short = None
        await ws.send(json.dumps({"type": "text", "text": "x" * 20_000}))  # over 16 KiB, within twice that
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))
        assert message["code"] == "message_too_large", message
        self.tally.errors["message_too_large"] += 1
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.recv(), 60)  # the close (1009)

    async def http(self, rng: random.Random) -> None:
        import httpx

        body = {
            "model": "tts-1",
            "input": " ".join(rng.sample(WORDS, 4)) + ".",
            "response_format": rng.choice(["pcm", "wav"]),
            "sampling": {"max_frames": self.options.frames},
        }
        async with httpx.AsyncClient(base_url=self.http_url, headers=AUTH, timeout=120) as client:
            for _ in range(BUSY_RETRIES):
                response = await client.post("/v1/audio/speech", json=body)
                if response.status_code != 503 or response.json()["error"]["code"] != "busy":
                    break
                self.tally.errors["busy"] += 1  # what a client does with busy: retry shortly
                await asyncio.sleep(rng.uniform(0.05, 0.3))
        assert response.status_code == 200 and response.content, response.text
        self.tally.http_ok += 1

    async def http_bad(self, rng: random.Random) -> None:
        import httpx

        content, code = rng.choice(
            [
                (b"{broken", "invalid_json"),
                (json.dumps({"model": "m", "input": " \n "}).encode(), "invalid_text"),
                (json.dumps({"model": "m", "input": "hi", "voice": "nobody"}).encode(), "unknown_voice"),
                (json.dumps({"model": "m", "input": "hi", "sampling": {"top_k": 1000}}).encode(), "invalid_request"),
            ]
        )
        async with httpx.AsyncClient(base_url=self.http_url, headers=AUTH, timeout=120) as client:
            response = await client.post("/v1/audio/speech", content=content)
        assert response.status_code == 400 and response.json()["error"]["code"] == code, response.text
        self.tally.errors[code] += 1

    # ------------------------------------------------------------------ reading
    async def _until_done(self, ws: Any) -> Any:
        """Messages up to and including the utterance's done; audio headers are paired with their payload."""
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if message["type"] == "audio":
                payload = await asyncio.wait_for(ws.recv(), 120)
                assert isinstance(payload, bytes) and len(payload) > 0
            elif message["type"] == "error":
                self.tally.errors[message["code"]] += 1
            yield message
            if message["type"] == "done":
                return

    async def _first_audio(self, ws: Any) -> bool:
        """Wait for the utterance's first audio; False if the server refused it as busy (counted, as a
        client that retries later would)."""
        message = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if message["type"] == "audio":
            await asyncio.wait_for(ws.recv(), 120)
            return True
        assert message["type"] == "error" and message["code"] == "busy", message
        self.tally.errors["busy"] += 1
        async for later in self._until_done(ws):
            if later.get("type") == "done":
                self._record_done(later)
        return False

    def _record_done(self, message: dict[str, Any]) -> None:
        reason = message["finish_reason"]
        self.tally.ws_done[reason] += 1
        if reason in ("eos", "max_frames", "length") and (message["metrics"] or {}).get("chunks"):
            self.tally.ws_first_audio += 1


async def drive(port: int, options: Options, first: int, count: int, tally: Tally) -> float:
    """Run units [first, first + count) on `concurrency` workers; returns the wall time."""
    kinds, weights = zip(*KINDS.items(), strict=True)
    next_unit = first
    started = time.perf_counter()

    async def worker_loop() -> None:
        nonlocal next_unit
        worker = Worker(port, options, tally)
        try:
            while next_unit < first + count:
                index = next_unit
                next_unit += 1
                if options.rate > 0:
                    await asyncio.sleep(max(0.0, started + (index - first) / options.rate - time.perf_counter()))
                rng = random.Random(options.seed * 1_000_003 + index)
                await worker.run(rng.choices(kinds, weights)[0], rng)
        finally:
            await worker.close()

    await asyncio.gather(*(worker_loop() for _ in range(options.concurrency)))
    return time.perf_counter() - started


# ---------------------------------------------------------------------- the checks
def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH, timeout=30).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_sum(metrics: dict, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in metrics.items()
        if sample == name and all(dict(sample_labels).get(k) == v for k, v in labels.items())
    )


def checks(
    tally: Tally, metrics: dict, options: Options, before: dict, middle: dict, after: dict
) -> dict[str, dict]:
    found: dict[str, dict] = {}

    def check(name: str, expected: float, actual: float, ok: bool | None = None) -> None:
        found[name] = {"expected": expected, "actual": actual, "ok": expected == actual if ok is None else ok}

    utterances = "qwen3tts_utterances_total"
    check("ws utterances, all reasons", tally.ws_opened, metric_sum(metrics, utterances, endpoint="ws"))
    for reason in sorted(set(tally.ws_done) | {"cancelled"}):
        expected = tally.ws_done[reason] + (tally.ws_lost if reason == "cancelled" else 0)
        check(f"ws utterances {reason}", expected, metric_sum(metrics, utterances, endpoint="ws", finish_reason=reason))
    # an HTTP request refused as busy counts as an utterance ended by an error when the engine refused it, and
    # as none when the admission queue did; both count as a busy error
    http_served = metric_sum(metrics, utterances, endpoint="http") - metric_sum(
        metrics, utterances, endpoint="http", finish_reason="error")
    check("http utterances served", tally.http_ok, http_served)
    for code in sorted(set(tally.errors)):
        check(f"errors {code}", tally.errors[code], metric_sum(metrics, "qwen3tts_errors_total", code=code))
    check("errors, all codes", sum(tally.errors.values()), metric_sum(metrics, "qwen3tts_errors_total"))
    check("cancels by the client", tally.cancels_client, metric_sum(metrics, "qwen3tts_cancels_total", reason="client"))
    check("cancels by disconnect", tally.cancels_disconnect,
          metric_sum(metrics, "qwen3tts_cancels_total", reason="disconnect"))
    check("ws first-audio observations", tally.ws_first_audio,
          metric_sum(metrics, "qwen3tts_first_audio_seconds_count", endpoint="ws"))
    for gauge in ("qwen3tts_active_sessions", "qwen3tts_active_streams", "qwen3tts_queued_requests",
                  "qwen3tts_engine_active_streams", "qwen3tts_engine_queued_streams"):
        check(f"{gauge} at the end", 0, metric_sum(metrics, gauge))
    check("engine errors", before["engine"]["errors"], after["engine"]["errors"])
    growth_mb = (after["rss_bytes"] - middle["rss_bytes"]) / 2**20
    check("server RSS growth over the second half (MB)", options.max_rss_growth_mb, round(growth_mb, 1),
          ok=growth_mb < options.max_rss_growth_mb)
    if before["cuda_allocated_bytes"] is not None:
        check("torch.cuda.memory_allocated back to its value after warm-up",
              before["cuda_allocated_bytes"], after["cuda_allocated_bytes"])
    return found


def percentiles(values: list[float]) -> dict[str, float] | None:
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=20)
    return {"median": statistics.median(values), "p95": q[18], "n": len(values)}


def run(options: Options) -> dict[str, Any]:
    """The whole soak; returns the report (report["ok"] says whether every check held)."""
    server = ServerProcess(options)
    tally = Tally()
    try:
        warmup = max(1, int(options.utterances * options.warmup_fraction))
        asyncio.run(drive(server.port, options, 0, warmup, tally))
        before = server.probe()
        probes = [before]  # the server after each tenth of the measured run
        bounds = [warmup + (options.utterances - warmup) * k // 10 for k in range(11)]
        wall = 0.0
        for start, end in itertools.pairwise(bounds):
            wall += asyncio.run(drive(server.port, options, start, end - start, tally))
            probes.append(server.probe())
        deadline = time.monotonic() + 30  # the server winds sessions down after the clients' last close
        while metric_sum(metrics := scrape(server.port), "qwen3tts_active_sessions") and time.monotonic() < deadline:
            time.sleep(0.1)
        after = server.probe()
    finally:
        server.stop()
    found = checks(tally, metrics, options, before, probes[5], after)
    report = {
        "ok": all(c["ok"] for c in found.values()),
        "options": asdict(options),
        "load_average": os.getloadavg(),
        "units": dict(tally.units),
        "measured_units": options.utterances - warmup,
        "measured_wall_s": wall,
        "units_per_s": (options.utterances - warmup) / wall,
        "first_audio_s": percentiles(tally.first_audio_s),
        "cancel_to_done_s": percentiles(tally.cancel_s),
        "rss_mb": {"after_warmup": before["rss_bytes"] / 2**20, "end": after["rss_bytes"] / 2**20,
                   "each_tenth": [round(probe["rss_bytes"] / 2**20, 1) for probe in probes]},
        "cuda_allocated_bytes": {"after_warmup": before["cuda_allocated_bytes"], "end": after["cuda_allocated_bytes"]},
        "engine": {"after_warmup": before["engine"], "end": after["engine"]},
        "checks": found,
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--utterances", type=int, default=d.utterances, help="units of work (see KINDS)")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="clients at once")
    parser.add_argument("--rate", type=float, default=d.rate, help="units started per second (0: unpaced)")
    parser.add_argument("--frames", type=int, default=d.frames, help="frames per complete utterance")
    parser.add_argument("--max-streams", type=int, default=d.max_streams, help="engine slots")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--max-rss-growth-mb", type=float, default=d.max_rss_growth_mb)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    options = Options(**{k: v for k, v in vars(args).items() if k != "out"})
    report = run(options)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    failed = {name: c for name, c in report["checks"].items() if not c["ok"]}
    print(
        f"soak: {options.utterances} units in {report['measured_wall_s']:.1f} s (after warm-up), "
        f"RSS {report['rss_mb']['after_warmup']:.1f} -> {report['rss_mb']['end']:.1f} MB, "
        f"{'all checks hold' if not failed else f'FAILED: {json.dumps(failed)}'}",
        file=sys.stderr,
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
