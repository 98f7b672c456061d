"""Hostile soak: good clients at a steady open-loop rate through `serve`, hostile clients beside them, and one
kill of the engine core under load; afterwards every gauge must be back to 0 and nothing may have hung.

`serve` runs as deployed (the real command line, an engine-core process, `--workers` API workers). The run is
`--duration` seconds of arrivals: a baseline phase (`--baseline-fraction` of it) of good clients alone, then
the same good clients beside hostile ones until the end. The good clients are benchmarks/serving/load.py's: Poisson
arrivals at `--rate` from `--clients` processes, each request a fresh WebSocket session that speaks one
utterance of `--frames` frames, first audio timed at the client from its `flush`, and an underrun when a player
that starts on the first chunk starves for more than 10 ms. Each hostile kind runs in a process of its own
with `--hostile-concurrency` loops, each doing one unit after another (a pause of up to `2 * --hostile-pause`
between them):

- close_on_done: a short utterance, and the moment its `done` arrives a close frame, an abort, a TCP reset, or
  (two utterances queued) an abort while the second one speaks;
- abort_mid_stream: a long utterance dropped after its first chunks (abort, or a TCP reset), right after its
  flush, or before it (text sent, never flushed);
- stall_reading: a long utterance in the largest format the server sends (f32 at 48 kHz) on a socket with a
  tiny receive buffer, never read (silent, or still sending text), until the server's send timeout closes it;
- malformed: every kind of bad WebSocket message (text before `start`, bad JSON, deep nesting, lone
  surrogates, unknown types and voices, binary, a second `start`, text over the limit, then a short utterance
  that must still speak), messages over the size limit (1009), bad HTTP requests, a wrong token;
- flood: thousands of one-character, blank or empty text deltas as fast as the socket takes them (every
  character counted, then the session still speaks), or thirty utterances flushed at once (the session's
  pending limit answers `busy` for the rest);
- slowloris: connections that trickle an HTTP head or a WebSocket handshake a byte at a time, send nothing,
  trickle a JSON body, or trickle the body of a request already answered (a wrong token: 401); the server
  must answer and close each within its `--http-read-timeout` (plus `CLOSE_SLACK_S` and `ACCEPT_SLACK_S`);
- kill_reconnect: a client process with sessions mid-utterance (utterances as long as the good clients',
  listened to in real time) is SIGKILLed every few seconds and replaced.

At `--kill-core-at` of the hostile phase the engine-core process (the serve supervisor's child that does not
listen on the server's port) is SIGKILLed: the time until /ready answers 503, then 200 again, and until a good
utterance is served are measured, and good clients' failures from the kill until then (plus `KILL_GRACE_S`) are
counted apart.

Once every client has left: every gauge (sessions, streams, queued utterances, the engine's active and queued
streams, its overload flag) must read 0 on `--scrapes` scrapes in a row (fresh connections, so every API
worker answers some) within `--settle`; those scrapes must agree series for series (server-wide metrics, not
one worker's share); and a good utterance must still be served.

Checks (all must hold, else exit code 1): the above; no session hung (a good request or a hostile unit that got
neither its `done`, an error nor a close within `--hang`); no good-client error outside the kill's window but
refusals (`busy`, `not_ready`, a handshake's 503), whose share is reported per phase and may not grow by more
than `--max-refusal-increase`; no hostile client got an answer the protocol does not give (in the kill's window,
`engine_error` is one it gives); the core came back and served within `--restart-bound`, and a session opened
before the kill answered an utterance during the outage as an outage allows and spoke the next one after; the API processes' RSS grew less than
`--max-rss-growth-mb` over the second half of the hostile phase (a leak grows with every unit; the allocator's
arenas settle during the first half), and the engine's device memory at the end is within
`--max-device-growth-mb` of its value at the start; serve's processes together hold at most
`--max-open-files-growth` more open files and `--max-threads-growth` more threads at the end than at the start
(a file or a thread left behind per connection would show hundreds); the good clients' first audio p95 in the hostile phase is
at most `--max-p95-ratio` times the baseline's (0: reported, not judged) and their underrun share grew by at most
`--max-underrun-increase`; every hostile kind ran. The report is JSON (`--out`) and a printed table.

    python -m benchmarks.serving.hostile --model synthetic:tiny --duration 240 --rate 1 --frames 25 --workers 2 \\
        --max-p95-ratio 0 --max-underrun-increase 1 --out hostile-cpu.json       # tests/test_hostile_soak.py
    python -m benchmarks.serving.hostile --model synthetic:1.7b-customvoice --duration 3600 --rate 20 --frames 100 \\
        --clients 8 --hostile-concurrency 4 --out hostile-gpu.json                # run_h200.sh stage `hostile`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import platform
import random
import signal
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from benchmarks.serving import load
from benchmarks.serving.soak import API_KEY, metric_sum, scrape

KINDS = ("close_on_done", "abort_mid_stream", "stall_reading", "malformed", "flood", "slowloris", "kill_reconnect")
VARIANTS = {
    "close_on_done": ("close", "abort", "reset", "pipelined"),
    "abort_mid_stream": ("reset_after_audio", "abort_after_audio", "abort_after_flush", "abort_unflushed"),
    "stall_reading": ("silent", "talking"),
    "malformed": ("ws_messages", "ws_over_limit", "ws_over_twice_limit", "http", "wrong_token"),
    "flood": ("tiny_deltas", "blank_deltas", "empty_deltas", "utterances"),
    "slowloris": ("http_head", "ws_handshake", "silent", "slow_body", "answered_slow_body"),
}
# The gauges that must read 0 once every client has left (summed over their labels).
GAUGES = ("qwen3tts_active_sessions", "qwen3tts_active_streams", "qwen3tts_queued_requests",
          "qwen3tts_engine_active_streams", "qwen3tts_engine_queued_streams", "qwen3tts_engine_overloaded")
# Series that move while the server idles (the core's loop, its memory): left out when scrapes are compared.
VOLATILE = ("qwen3tts_engine_loop_seconds", "qwen3tts_engine_core_rss_bytes", "qwen3tts_engine_device_memory_bytes")
# /ready answered 200 on this many fresh connections in a row: every API worker has the new core, very likely
READY_EVERYWHERE = 8
KILL_GRACE_S = 2.0  # after the first good utterance served by the new core, failures still count as the kill's
STALL_FILL_S = 5.0  # time a stalled client allows the server to fill its send buffers before the send timeout runs
SLOW_CONNECTIONS = 4  # connections of one slowloris unit
TRICKLE_S = 0.5  # a slowloris client's pause between bytes
CLOSE_SLACK_S = 5.0  # a deadline on the server may be this late (a busy event loop) before its client calls it hung
# A slow connection's read deadline starts when an API worker's loop accepts it; its client counts from its connect,
# which the kernel completes from the listen backlog before that (on two loaded CPU cores, later by a fraction of a
# second: enough, once, to fail a check that allowed the read timeout and CLOSE_SLACK_S alone)
ACCEPT_SLACK_S = 3.0
REFUSALS = ("busy", "not_ready")  # error codes that refuse a request, for a client to retry shortly
HANDSHAKE_REFUSED = "handshake_503"  # a good client's session refused at its handshake (busy or not ready)
TEXT = "Thanks for calling. I can help you change your booking today; could you tell me the reference number?"
MB = 2**20


@dataclass
class Options:
    model: str = "synthetic:tiny"
    duration_s: float = 240.0  # arrivals, baseline and hostile phases together
    baseline_fraction: float = 0.15
    warmup_s: float = 5.0  # good requests of the run's first seconds are left out of the baseline's figures
    rate: float = 1.0  # good requests a second
    frames: int = 25  # frames per good utterance
    clients: int = 2  # good client processes
    workers: str = "auto"  # serve --workers
    hostile_concurrency: int = 1  # loops per hostile kind
    hostile_pause_s: float = 1.0  # mean pause between one loop's units
    kinds: tuple[str, ...] = KINDS
    # when to kill the engine core, as a fraction of the hostile phase (negative: never); early, so that the RSS
    # growth over the phase's second half has no restart in it (the API workers' RSS steps once at the first)
    kill_core_at: float = 0.25
    send_timeout_s: float = 10.0  # serve --send-timeout (the stalled clients wait for it)
    http_read_timeout_s: float = 10.0  # serve --http-read-timeout (the slowloris clients wait for it)
    max_message_bytes: int = 65536  # serve --max-message-bytes (the oversize messages are sized by it)
    hang_s: float = 60.0
    settle_s: float = 30.0
    scrapes: int = 0  # scrapes that must show every gauge at 0 in a row, and agree; 0: four per API worker
    restart_bound_s: float = 300.0
    max_rss_growth_mb: float = 100.0
    max_device_growth_mb: float = 256.0
    # serve's processes' open files and threads at the end against the start, all summed: a few files open at the
    # first requests (metrics files, say), where a leak of one per connection would show hundreds
    max_open_files_growth: int = 16
    max_threads_growth: int = 8
    max_p95_ratio: float = 2.0
    max_underrun_increase: float = 0.02
    max_refusal_increase: float = 0.01
    language: str = "english"
    voice: str | None = None
    seed: int = 0
    server_args: tuple[str, ...] = ()
    server_log: str | None = None
    startup_timeout_s: float = 900.0


# ---------------------------------------------------------------------- hostile clients (their own processes)
@dataclass
class HostilePlan:
    kind: str
    host: str
    port: int
    start_at: float  # time.monotonic(), shared by the processes of one machine
    end_at: float
    concurrency: int
    pause_s: float
    send_timeout_s: float
    http_read_timeout_s: float
    max_message_bytes: int
    hang_s: float
    seed: int
    language: str
    voice: str | None
    frames: int  # a victim's utterances (kill_reconnect), as long as the good clients'


@dataclass
class HostileTally:
    """What one kind's units saw: outcomes by variant, and every unit that did not go as the protocol says."""

    kind: str
    units: collections.Counter[str] = field(default_factory=collections.Counter)  # by variant
    # ok, refused, engine_error, unexpected, hung
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    ends: collections.Counter[str] = field(default_factory=collections.Counter)  # how the server ended them
    slowest_s: dict[str, float] = field(default_factory=dict)  # by variant: the longest the server took to end one
    events: list[tuple[float, float, str, str]] = field(default_factory=list)  # started, ended, outcome, detail

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts (dataclasses.asdict would rebuild each Counter from its items, counting the pairs)."""
        return {"kind": self.kind, "units": dict(self.units), "outcomes": dict(self.outcomes),
                "ends": dict(self.ends), "slowest_s": self.slowest_s, "events": self.events}


class Refused(Exception):
    """The server said `busy` or `not_ready` (a handshake's 503 included): a refusal, not a fault."""


class Unexpected(Exception):
    """An answer the protocol does not give to what the unit sent."""


class EngineFailed(Exception):
    """`engine_error`: the engine failed a stream, which only the core's death (the kill) may explain."""


class HostileClient:
    """The units of one hostile kind, run by `concurrency` loops until `end_at`."""

    def __init__(self, plan: HostilePlan) -> None:
        self.plan = plan
        self.tally = HostileTally(plan.kind)
        self.url = f"ws://{plan.host}:{plan.port}/v1/stream"
        self.http_url = f"http://{plan.host}:{plan.port}"

    async def run(self) -> HostileTally:
        await asyncio.gather(*(self._loop(i) for i in range(self.plan.concurrency)))
        return self.tally

    def unit_bound_s(self) -> float:
        """How long one unit may take before it counts as hung (a stalled client waits out the server first)."""
        if self.plan.kind == "stall_reading":
            return self._stall_wait_s() + self.plan.hang_s
        if self.plan.kind == "slowloris":  # each connection calls itself hung first, saying which it was
            return self.plan.http_read_timeout_s + self.plan.hang_s + CLOSE_SLACK_S
        return self.plan.hang_s

    async def _loop(self, index: int) -> None:
        rng = random.Random(self.plan.seed * 1_000_003 + index)
        await asyncio.sleep(max(0.0, self.plan.start_at - time.monotonic()) + rng.uniform(0, self.plan.pause_s))
        unit, variants = getattr(self, self.plan.kind), VARIANTS[self.plan.kind]
        done = 0
        while time.monotonic() < self.plan.end_at:
            variant = variants[(index + done) % len(variants)]  # in turn: every variant runs, however few units
            done += 1
            started = time.monotonic()
            outcome, detail = "ok", ""
            try:
                await load.bounded_request(unit(rng, variant), self.unit_bound_s())
            except load.Hung as exc:
                outcome, detail = "hung", str(exc)
            except Refused as exc:
                outcome, detail = "refused", str(exc)
            except EngineFailed as exc:
                outcome, detail = "engine_error", str(exc)
            except Exception as exc:  # noqa: BLE001 - every other failure is an answer the protocol does not give
                outcome, detail = "unexpected", f"{type(exc).__name__}: {exc}"[:300]
            self.tally.units[variant] += 1
            self.tally.outcomes[outcome] += 1
            if outcome != "ok":
                self.tally.events.append((started, time.monotonic(), outcome, f"{variant}: {detail}"))
            await asyncio.sleep(rng.uniform(0, 2 * self.plan.pause_s))

    # ------------------------------------------------------------------ WebSocket helpers
    async def _connect(self, token: str = API_KEY, **kwargs: Any) -> ClientConnection:
        try:
            # no keepalive pings: a client that stops reading could not answer them, and would close itself
            return await connect(self.url, additional_headers={"Authorization": f"Bearer {token}"}, proxy=None,
                                 max_size=None, open_timeout=self.plan.hang_s, ping_interval=None, **kwargs)
        except InvalidStatus as exc:
            if exc.response.status_code == 503:
                raise Refused(f"handshake answered {exc.response.status_code}") from None
            raise

    async def _start(self, ws: ClientConnection, **fields: Any) -> dict[str, Any]:
        start = {"type": "start", "language": self.plan.language, **fields}
        if self.plan.voice and "voice" not in fields:
            start["voice"] = self.plan.voice
        await ws.send(json.dumps(start))
        ready = await _next_json(ws)
        if ready["type"] != "ready":
            _raise_error(ready)
        return ready

    async def _expect_error(self, ws: ClientConnection, raw: str | bytes, codes: set[str]) -> None:
        await ws.send(raw)
        answer = await _next_json(ws)
        if answer["type"] != "error" or answer["code"] not in codes:
            if answer.get("code") in REFUSALS:
                raise Refused(answer["code"])
            raise Unexpected(f"{str(raw)[:40]!r} answered {json.dumps(answer)[:200]}, not an error {sorted(codes)}")

    async def _expect_close(self, ws: ClientConnection, code: int) -> None:
        """Read until the server closes; its close code must be `code`."""
        try:
            while True:
                await ws.recv()
        except ConnectionClosed as closed:
            got = closed.rcvd.code if closed.rcvd is not None else None
            self.tally.ends[f"close {got}"] += 1
            if got != code:
                raise Unexpected(f"closed with {got}, not {code}") from None

    # ------------------------------------------------------------------ units
    async def close_on_done(self, rng: random.Random, variant: str) -> None:
        ws = await self._connect()
        try:
            await self._start(ws, sampling={"max_frames": rng.randint(1, 4), "ignore_eos": True})
            for _ in range(2 if variant == "pipelined" else 1):
                await ws.send(json.dumps({"type": "text", "text": "Hello there."}))
                await ws.send(json.dumps({"type": "flush"}))
            await _until_done(ws)
            if variant == "close":
                await ws.close()
            elif variant == "reset":
                _reset_on_close(ws)
        finally:
            ws.transport.abort()

    async def abort_mid_stream(self, rng: random.Random, variant: str) -> None:
        ws = await self._connect()
        try:
            await self._start(ws, sampling={"max_frames": 400, "ignore_eos": True})
            await ws.send(json.dumps({"type": "text", "text": "This answer goes on and on until the caller hangs up."}))
            if variant == "abort_unflushed":
                await asyncio.sleep(rng.uniform(0, 0.2))
                return
            await ws.send(json.dumps({"type": "flush"}))
            if variant == "abort_after_flush":
                return
            chunks, wanted = 0, rng.randint(1, 4)
            while chunks < wanted:
                message = await ws.recv()
                if isinstance(message, bytes):
                    chunks += 1
                elif (body := json.loads(message))["type"] in ("error", "done"):
                    _raise_error(body)
            if variant == "reset_after_audio":
                _reset_on_close(ws)
        finally:
            ws.transport.abort()

    def _stall_wait_s(self) -> float:
        # the server fills its buffers, waits out its send timeout, says why (at most 1 s), closes, and drops
        # a connection whose close goes unanswered after another send timeout
        return STALL_FILL_S + 2 * self.plan.send_timeout_s + 1.0 + CLOSE_SLACK_S

    async def stall_reading(self, rng: random.Random, variant: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small TCP window
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (self.plan.host, self.plan.port))
            ws = await self._connect(sock=sock, max_queue=1)  # the client library stops reading after one message
        except BaseException:
            sock.close()
            raise
        try:
            await self._start(ws, sampling={"max_frames": 1500, "ignore_eos": True},
                              audio_format={"encoding": "pcm_f32le", "sample_rate": 48000})
            await ws.send(json.dumps({"type": "text", "text": TEXT}))
            await ws.send(json.dumps({"type": "flush"}))
            stalled_until = time.monotonic() + self._stall_wait_s()
            if variant == "talking":  # still sending text (later utterances), never reading
                with contextlib.suppress(ConnectionClosed):
                    while time.monotonic() < stalled_until:
                        await ws.send(json.dumps({"type": "text", "text": rng.choice([" and", " so", " then"])}))
                        await asyncio.sleep(1.0)
            await asyncio.sleep(max(0.0, stalled_until - time.monotonic()))
            try:  # the server must have closed the connection by now: what it had sent, then the end
                while True:
                    await asyncio.wait_for(ws.recv(), self.plan.hang_s)
            except ConnectionClosed as closed:
                self.tally.ends[f"close {closed.rcvd.code if closed.rcvd is not None else 'dropped'}"] += 1
            except asyncio.TimeoutError:
                raise load.Hung(f"still open {self._stall_wait_s():.0f} s after it stopped reading") from None
        finally:
            ws.transport.abort()

    async def malformed(self, rng: random.Random, variant: str) -> None:
        if variant == "http":
            await self._malformed_http(rng)
            return
        if variant == "wrong_token":
            try:
                ws = await self._connect(token="not-the-key")
            except InvalidStatus as exc:
                self.tally.ends[f"handshake {exc.response.status_code}"] += 1
                if exc.response.status_code != 401:
                    raise Unexpected(f"a wrong token answered {exc.response.status_code}, not 401") from None
                return
            ws.transport.abort()
            raise Unexpected("a wrong token was let in")
        ws = await self._connect()
        try:
            if variant == "ws_messages":
                await self._bad_messages(ws, rng)
                return
            await self._start(ws)
            if variant == "ws_over_limit":  # over the limit, within twice it: an error, then 1009
                await ws.send(json.dumps({"type": "text", "text": "x" * (self.plan.max_message_bytes + 100)}))
                answer = await _next_json(ws)
                if answer.get("code") != "message_too_large":
                    raise Unexpected(f"an oversize message answered {json.dumps(answer)[:200]}")
            else:  # over twice the limit: the protocol layer closes with 1009 before buffering it
                await ws.send(json.dumps({"type": "text", "text": "x" * (2 * self.plan.max_message_bytes + 100)}))
            await self._expect_close(ws, 1009)
        finally:
            ws.transport.abort()

    async def _bad_messages(self, ws: ClientConnection, rng: random.Random) -> None:
        await self._expect_error(ws, json.dumps({"type": "text", "text": "too early"}), {"not_started"})
        await self._expect_error(ws, json.dumps({"type": "start", "voice": "nobody-by-this-name"}), {"unknown_voice"})
        ready = await self._start(ws, sampling={"max_frames": 3, "ignore_eos": True})
        bad: list[tuple[str | bytes, set[str]]] = [
            ("{not json", {"invalid_json"}),
            ('{"type": "sing"}', {"unknown_type"}),
            ('{"type": "text", "text": "bad \\ud800 text"}', {"invalid_text"}),
            ("[" * 3000 + "]" * 3000, {"invalid_json"}),
            ('{"type": "flush", "now": true}', {"invalid_message"}),
            ('{"type": "text", "text": 5}', {"invalid_message"}),
            (b"\x00\x01binary", {"invalid_message"}),
            (json.dumps({"type": "start"}), {"already_started"}),
            (json.dumps({"type": "text", "text": "x" * (ready["max_text_chars"] + 1)}), {"text_too_long"}),
        ]
        for raw, codes in rng.sample(bad, len(bad)):
            await self._expect_error(ws, raw, codes)
        await ws.send(json.dumps({"type": "text", "text": "Still here."}))  # the session still speaks
        await ws.send(json.dumps({"type": "flush"}))
        done = await _until_done(ws)
        if done["finish_reason"] != "max_frames":
            raise Unexpected(f"the utterance after the bad messages ended {done['finish_reason']}")
        await ws.close()

    async def _malformed_http(self, rng: random.Random) -> None:
        import httpx

        speech = {"model": "tts-1", "input": "Hello."}
        cases: list[tuple[str, str, dict[str, Any], int, str]] = [
            ("POST", "/v1/audio/speech", {"content": b"{broken"}, 400, "invalid_json"),
            ("POST", "/v1/audio/speech", {"content": b"{" + b" " * self.plan.max_message_bytes + b"}"}, 413,
             "message_too_large"),
            ("POST", "/v1/audio/speech", {"json": {**speech, "speed": 2.0}}, 400, "unsupported_parameter"),
            ("POST", "/v1/audio/speech", {"json": {**speech, "response_format": "mp3"}}, 400, "unsupported_format"),
            ("POST", "/v1/audio/speech", {"json": {**speech, "input": " \n "}}, 400, "invalid_text"),
            ("GET", "/v1/nowhere", {}, 404, "not_found"),
            ("PUT", "/v1/audio/speech", {}, 405, "method_not_allowed"),
            ("GET", "/v1/voices", {"headers": {"Authorization": "Bearer not-the-key"}}, 401, "unauthorized"),
        ]
        method, path, kwargs, status, code = rng.choice(cases)
        headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
        async with httpx.AsyncClient(base_url=self.http_url, headers=headers, timeout=self.plan.hang_s) as client:
            response = await client.request(method, path, **kwargs)
        is_json = response.headers.get("content-type") == "application/json"
        got = response.json().get("error", {}).get("code") if is_json else None
        self.tally.ends[f"http {response.status_code}"] += 1
        if got in REFUSALS:
            raise Refused(got)
        if (response.status_code, got) != (status, code):
            raise Unexpected(f"{method} {path} answered {response.status_code} {got}, not {status} {code}")

    async def flood(self, rng: random.Random, variant: str) -> None:
        ws = await self._connect()
        try:
            await self._start(ws, sampling={"max_frames": 6, "ignore_eos": True})
            if variant == "utterances":
                await self._utterance_flood(ws)
                return
            count = rng.randint(500, 3000)
            deltas = {
                # an LLM's text a character at a time: speech starts on the first words, and may reach its
                # max_frames before the flush (the protocol drops the text after its `done`)
                "tiny_deltas": [TEXT[i % len(TEXT)] for i in range(count)],
                # spaces, then words: nothing is spoken before the words, so every character must be counted
                "blank_deltas": [" "] * count + ["Hello."],
                "empty_deltas": [""] * count + ["Hello."],
            }[variant]
            for delta in deltas:
                await ws.send(json.dumps({"type": "text", "text": delta}))
            await ws.send(json.dumps({"type": "flush"}))
            chars = sum(map(len, deltas))
            done = await _until_done(ws)
            counted = done["metrics"]["text_chars"]
            if done["finish_reason"] != "max_frames" or not (
                0 < counted <= chars if variant == "tiny_deltas" else counted == chars
            ):
                raise Unexpected(f"{len(deltas)} deltas of {chars} characters ended {done['finish_reason']} with "
                                 f"{counted} characters counted")
            await ws.send(json.dumps({"type": "text", "text": "Hi."}))  # the session still speaks
            await ws.send(json.dumps({"type": "flush"}))
            after = await _until_done(ws)
            if after["finish_reason"] != "max_frames" or after["metrics"]["text_chars"] != 3:
                raise Unexpected(f"the utterance after the flood ended {json.dumps(after)[:200]}")
            await ws.close()
        finally:
            ws.transport.abort()

    async def _utterance_flood(self, ws: ClientConnection) -> None:
        """Thirty one-word utterances at once: each is spoken or refused `busy` (the session's pending limit)."""
        flushed = 30
        for _ in range(flushed):
            await ws.send(json.dumps({"type": "text", "text": "Hi."}))
            await ws.send(json.dumps({"type": "flush"}))
        spoken = refused = 0
        while spoken + refused < flushed:
            message = await ws.recv()
            if isinstance(message, bytes):
                continue
            body = json.loads(message)
            if body["type"] == "done":
                spoken += 1
                if body["finish_reason"] != "max_frames":
                    raise Unexpected(f"a flooded utterance ended {body['finish_reason']}")
            elif body["type"] == "error" and body["code"] == "busy" and "utterance_id" not in body:
                refused += 1
            elif body["type"] == "error":
                _raise_error(body)
        self.tally.ends[f"utterances spoken {min(spoken, 10)}{'+' if spoken > 10 else ''}"] += 1
        await ws.close()

    async def slowloris(self, rng: random.Random, variant: str) -> None:
        await asyncio.gather(*(self._slow_connection(variant) for _ in range(SLOW_CONNECTIONS)))

    async def _slow_connection(self, variant: str) -> None:
        """One connection that never completes what it sends; the server must answer (408, or 401 for a body
        sent with a wrong token) and close it within its read timeout, however slowly the bytes trickle in."""
        host = f"Host: {self.plan.host}:{self.plan.port}\r\n"

        def body_head(token: str) -> bytes:
            return (f"POST /v1/audio/speech HTTP/1.1\r\n{host}Authorization: Bearer {token}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n").encode()

        head, trickled = {
            "http_head": (b"", f"POST /v1/audio/speech HTTP/1.1\r\n{host}Content-Type: application/json\r\nX-Pad: "),
            "ws_handshake": (b"", f"GET /v1/stream HTTP/1.1\r\n{host}Upgrade: websocket\r\nConnection: Upgrade\r\n"
                                  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nX-Pad: "),
            "silent": (b"", ""),
            "slow_body": (body_head(API_KEY), '{"model": "tts-1", "input": "'),  # the app's body deadline: 408
            # answered before its body is read (401), which goes on trickling: the connection must end all the same
            "answered_slow_body": (body_head("not-the-key"), '{"model": "tts-1", "input": "'),
        }[variant]
        reader, writer = await asyncio.open_connection(self.plan.host, self.plan.port)
        opened = time.monotonic()

        async def trickle() -> None:
            writer.write(head)
            if not trickled:
                return
            for i in range(10**6):
                writer.write(trickled[i].encode() if i < len(trickled) else b"a")
                await writer.drain()
                await asyncio.sleep(TRICKLE_S)

        sender = asyncio.create_task(trickle())
        answer = b""
        hung_after = self.plan.http_read_timeout_s + self.plan.hang_s
        try:
            while piece := await asyncio.wait_for(reader.read(4096), opened + hung_after - time.monotonic()):
                answer += piece
        except asyncio.TimeoutError:
            raise load.Hung(f"still open {hung_after:g} s after it connected") from None
        except OSError:
            pass  # reset while trickling: closed all the same
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            writer.transport.abort()
        took = time.monotonic() - opened
        self.tally.slowest_s[variant] = round(max(took, self.tally.slowest_s.get(variant, 0.0)), 2)
        status = answer.split(b" ", 2)[1].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else "none"
        self.tally.ends[f"{variant} {status}"] += 1
        expected = "401" if variant == "answered_slow_body" else "408"
        if status == "503":
            raise Refused("answered 503")
        if status not in (expected, "none"):
            raise Unexpected(f"answered {answer[:80]!r}, not {expected}")
        if took > self.plan.http_read_timeout_s + CLOSE_SLACK_S + ACCEPT_SLACK_S:
            limit = self.plan.http_read_timeout_s
            raise Unexpected(f"closed {took:.1f} s after it connected (read timeout {limit:g} s)")


async def _next_json(ws: ClientConnection) -> dict[str, Any]:
    """The next text message (binary audio skipped)."""
    while True:
        message = await ws.recv()
        if isinstance(message, str):
            return dict(json.loads(message))


async def _until_done(ws: ClientConnection) -> dict[str, Any]:
    """Read to the next `done`; an error on the way is raised (a refusal as `Refused`)."""
    while True:
        body = await _next_json(ws)
        if body["type"] == "error":
            _raise_error(body)
        if body["type"] == "done":
            return body


def _raise_error(body: dict[str, Any]) -> None:
    if body.get("code") in REFUSALS:
        raise Refused(body["code"])
    if body.get("code") == "engine_error":
        raise EngineFailed(body.get("message", ""))
    raise Unexpected(json.dumps(body)[:200])


def _reset_on_close(ws: ClientConnection) -> None:
    """Make the coming abort a TCP reset (SO_LINGER 0) rather than a FIN."""
    ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def hostile_process(plan: HostilePlan, results: multiprocessing.Queue) -> None:
    results.put(asyncio.run(HostileClient(plan).run()).as_dict())


def victim_process(plan: HostilePlan, open_sessions: Any) -> None:
    """A client process with a few sessions mid-utterance, killed by the orchestrator (`KillReconnect`)."""

    async def session(client: HostileClient) -> None:
        while True:
            try:
                ws = await client._connect()
                try:
                    await client._start(ws, sampling={"max_frames": plan.frames, "ignore_eos": True})
                    open_sessions.value += 1
                    try:
                        while True:  # a call: its text streamed in word by word, its audio listened to
                            for word in TEXT.split():
                                await ws.send(json.dumps({"type": "text", "text": word + " "}))
                            await ws.send(json.dumps({"type": "flush"}))
                            await _until_done(ws)
                            await asyncio.sleep(plan.frames * load.FRAME_S)
                    finally:
                        open_sessions.value -= 1
                finally:
                    ws.transport.abort()
            except Exception:  # noqa: BLE001 - refused or cut off (the core kill): connect again
                await asyncio.sleep(0.2)

    async def main() -> None:
        client = HostileClient(plan)
        await asyncio.gather(*(session(client) for _ in range(plan.concurrency + 1)))

    asyncio.run(main())


class KillReconnect(threading.Thread):
    """Starts a victim client process, SIGKILLs it a few seconds later with its sessions open, starts the next."""

    def __init__(self, plan: HostilePlan) -> None:
        super().__init__(name="kill-reconnect", daemon=True)
        self.plan = plan
        self.kills = 0
        self.sessions_at_kill: list[int] = []
        self._halt = threading.Event()

    def run(self) -> None:
        context = multiprocessing.get_context("spawn")
        rng = random.Random(self.plan.seed)
        self._halt.wait(max(0.0, self.plan.start_at - time.monotonic()))
        while not self._halt.is_set() and time.monotonic() < self.plan.end_at - 2:
            open_sessions = context.Value("i", 0, lock=False)  # no lock: a killed process may not hold one
            victim = context.Process(target=victim_process, args=(self.plan, open_sessions), daemon=True)
            victim.start()
            self._halt.wait(rng.uniform(2.0, 6.0))
            self.sessions_at_kill.append(open_sessions.value)
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            victim.join(10)
            self.kills += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


# ---------------------------------------------------------------------- the server
class Server:
    """`qwen3tts-agent serve` started with benchmarks/serving/load.py's launcher, plus what this benchmark reads of it."""

    def __init__(self, options: Options) -> None:
        args = [f"--api-key={API_KEY}", "--engine-core=process", f"--workers={options.workers}",
                f"--send-timeout={options.send_timeout_s}", f"--http-read-timeout={options.http_read_timeout_s}",
                f"--max-message-bytes={options.max_message_bytes}", "--log-level=warning", *options.server_args]
        started = time.monotonic()
        self.process, url = load.start_server(argparse.Namespace(
            model=options.model, server_arg=args, server_log=options.server_log,
            startup_timeout=options.startup_timeout_s))
        self.startup_s = time.monotonic() - started
        self.port = int(url.rsplit(":", 1)[1])

    def processes(self) -> dict[str, int]:
        """Name -> pid: "serve" (the supervisor, which runs the app itself when there is one API worker),
        "worker-N" (the API workers: the children listening on the server's port) and "core" (the child that
        does not listen; the largest, should a worker just restarted not listen yet). Told apart by the socket,
        not by size, so a core that restarts (small while it loads) is never taken for a worker."""
        api: list[tuple[int, int]] = []  # (pid, rss) of the children listening on the port
        others: list[tuple[int, int]] = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # denied: told apart by size
                if "resource_tracker" in " ".join(child.cmdline()):
                    continue
                listening = any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                                for c in child.net_connections(kind="tcp"))
                (api if listening else others).append((child.pid, child.memory_info().rss))
        named = {"serve": self.process.pid} | {f"worker-{i}": pid for i, (pid, _) in enumerate(api, 1)}
        if others:
            named["core"] = max(others, key=lambda child: child[1])[0]
        return named

    def memory(self) -> dict[str, Any]:
        """Resident memory (the API side's summed too), open files and threads of each of serve's processes, and the
        engine's device memory."""
        rss: dict[str, float] = {}
        files: dict[str, int] = {}
        threads: dict[str, int] = {}
        for name, pid in self.processes().items():
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                rss[name] = round(process.memory_info().rss / MB, 1)
                files[name] = process.num_fds()
                threads[name] = process.num_threads()
        try:
            device: float | None = round(metric_sum(scrape(self.port), "qwen3tts_engine_device_memory_bytes") / MB, 1)
        except Exception:  # noqa: BLE001 - /metrics failing is reported by the gauges' check
            device = None
        return {
            "rss_mb": rss,
            "api_rss_mb": round(sum(v for name, v in rss.items() if name != "core"), 1),
            "core_rss_mb": rss.get("core"),
            "device_memory_mb": device,
            "open_files": files,
            "threads": threads,
        }

    def ready_status(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    async def _session(self) -> ClientConnection:
        """A started session for short utterances (3 frames)."""
        ws = await connect(f"ws://127.0.0.1:{self.port}/v1/stream", proxy=None, open_timeout=30, ping_interval=None,
                           additional_headers={"Authorization": f"Bearer {API_KEY}"})
        await ws.send(json.dumps({"type": "start", "sampling": {"max_frames": 3, "ignore_eos": True}}))
        ready = await _next_json(ws)
        if ready["type"] != "ready":
            ws.transport.abort()
            _raise_error(ready)
        return ws

    async def _utterance(self, ws: ClientConnection, *, refusal_ok: bool = False) -> None:
        """One short utterance on `ws`: spoken, or with `refusal_ok` refused as a core outage allows (`not_ready`,
        `busy`, or `engine_error` for a stream the dead core had taken) with the session still open."""
        await ws.send(json.dumps({"type": "text", "text": "Are you there?"}))
        await ws.send(json.dumps({"type": "flush"}))
        error: dict[str, Any] | None = None
        while (body := await _next_json(ws))["type"] != "done":
            if body["type"] == "error":
                error = body
        if body["finish_reason"] == "max_frames" and error is None:
            return
        if refusal_ok and body["finish_reason"] == "error" and error and error["code"] in (*REFUSALS, "engine_error"):
            return
        raise Unexpected(f"ended {body['finish_reason']} after {json.dumps(error)[:200]}")

    async def _probe(self) -> str | None:
        """One good utterance on a fresh session: None if it was spoken, else what went wrong."""

        async def utterance() -> None:
            ws = await self._session()
            try:
                await self._utterance(ws)
                await ws.close()
            finally:
                ws.transport.abort()

        try:
            await load.bounded_request(utterance(), 60)
        except Exception as exc:  # noqa: BLE001 - the answer is the report
            return f"{type(exc).__name__}: {exc}"[:300]
        return None

    def probe(self) -> str | None:
        return asyncio.run(self._probe())

    def kill_core(self, bound_s: float) -> dict[str, Any]:
        return asyncio.run(self._kill_core(bound_s))

    async def _kill_core(self, bound_s: float) -> dict[str, Any]:
        """SIGKILL the engine core; time /ready's 503, its 200 again, and the first good utterance served. A
        session opened before the kill must answer an utterance while the core is down as an outage allows,
        and speak the next one once the core is back ("open_session": None, else what it got)."""
        old = self.processes().get("core")
        assert old is not None, "no engine-core process found"
        survivor = await self._session()
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + bound_s
        down = ready = served = None
        last_probe: str | None = None
        while_down: asyncio.Task[str | None] | None = None
        open_session: str | None = "no utterance tried: /ready never answered 503"
        try:
            while ready is None and time.monotonic() < deadline:
                status, now = await asyncio.to_thread(self.ready_status), time.monotonic()
                if status != 200 and down is None:
                    down = now
                    while_down = asyncio.create_task(
                        self._survivor_step(survivor, refusal_ok=True, when="while the core was down"))
                elif status == 200 and down is not None:
                    ready = now
                await asyncio.sleep(0.05)
            while ready is not None and served is None and time.monotonic() < deadline:
                last_probe = await self._probe()
                if last_probe is None:
                    served = time.monotonic()
                else:
                    await asyncio.sleep(0.2)
            if while_down is not None:
                open_session = await while_down
                if open_session is None and served is not None:
                    # each API worker hears of the new core on its own (its hello, every 0.5 s while it has none):
                    # the session's worker may not be the one that answered /ready and served the probe
                    await self._ready_in_every_worker(deadline)
                    open_session = await self._survivor_step(survivor, refusal_ok=False, when="once the core was back")
        finally:
            survivor.transport.abort()

        def after(t: float | None) -> float | None:
            return None if t is None else round(t - killed, 2)

        return {"killed_pid": old, "new_pid": self.processes().get("core"), "killed_at": killed,
                "not_ready_after_s": after(down), "ready_after_s": after(ready), "served_after_s": after(served),
                "last_probe_error": last_probe if served is None else None, "open_session": open_session}

    async def _ready_in_every_worker(self, deadline: float) -> None:
        """Until `READY_EVERYWHERE` fresh connections in a row (spread over the workers by the kernel) found /ready
        200, or `deadline`."""
        streak = 0
        while streak < READY_EVERYWHERE and time.monotonic() < deadline:
            streak = streak + 1 if await asyncio.to_thread(self.ready_status) == 200 else 0
            if streak == 0:
                await asyncio.sleep(0.05)

    async def _survivor_step(self, ws: ClientConnection, *, refusal_ok: bool, when: str) -> str | None:
        try:
            await load.bounded_request(self._utterance(ws, refusal_ok=refusal_ok), 60)
        except Exception as exc:  # noqa: BLE001 - the answer is the report
            return f"{when}: {type(exc).__name__}: {exc}"[:300]
        return None

    def stop(self) -> None:
        load.stop_server(self.process)


def gauges(metrics: dict) -> dict[str, float | None]:
    """Each of GAUGES summed over its labels; None when the series is missing (e.g. no engine core)."""
    present = {name for name, _ in metrics}
    return {name: metric_sum(metrics, name) if name in present else None for name in GAUGES}


def settle(server: Server, scrapes: int, bound_s: float) -> dict[str, Any]:
    """Wait until `scrapes` scrapes in a row read every gauge at 0 (so that every API worker has answered)."""
    left = time.monotonic()
    streak = 0
    last: dict[str, Any]
    while True:
        try:
            last = dict(gauges(scrape(server.port)))
        except Exception as exc:  # noqa: BLE001 - a scrape that fails is not a gauge at 0
            last = {"scrape failed": f"{type(exc).__name__}: {exc}"[:200]}
        streak = streak + 1 if all(v == 0 for v in last.values()) else 0
        if streak >= scrapes:
            return {"settled": True, "after_s": round(time.monotonic() - left, 2), "gauges": last}
        if time.monotonic() - left > bound_s:
            return {"settled": False, "after_s": None, "gauges": last}
        time.sleep(0.2)


def scrape_agreement(server: Server, scrapes: int) -> dict[str, Any]:
    """Scrape `scrapes` times (fresh connections) with nothing going on: every series must read the same."""

    def stable() -> dict:
        try:
            metrics = scrape(server.port)
        except Exception as exc:  # noqa: BLE001 - a scrape that fails agrees with none
            return {("scrape failed", ()): f"{type(exc).__name__}: {exc}"[:200]}
        return {k: v for k, v in metrics.items() if k[0] not in VOLATILE and not k[0].endswith("_created")}

    samples = [stable() for _ in range(scrapes)]
    keys = sorted(set().union(*samples))
    differing = [key for key in keys if len({s.get(key) for s in samples}) > 1]
    return {"scrapes": scrapes, "series": len(keys), "differing": len(differing),
            "examples": {f"{name}{dict(labels)}": sorted({repr(s.get(key)) for s in samples})
                         for key in differing[:10] for name, labels in [key]}}


def _sample(server: Server, origin: float) -> dict[str, Any]:
    """The server's memory and gauges now, for the report's timeline (`load.PeriodicSampler` takes them)."""
    sample: dict[str, Any] = {"t_s": round(time.monotonic() - origin, 1)}
    try:
        sample.update(server.memory())
        sample["gauges"] = gauges(scrape(server.port))
    except Exception as exc:  # noqa: BLE001 - e.g. the core restarting: noted, sampling goes on
        sample["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return sample


# ---------------------------------------------------------------------- the run
def run(options: Options) -> dict[str, Any]:
    """The whole hostile soak; returns the report (report["ok"] says whether every check held)."""
    unknown = set(options.kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown hostile kinds {sorted(unknown)}; choose from {KINDS}")
    load.unwind_on_sigterm()
    server = Server(options)
    try:
        return _drive(server, options)
    finally:
        server.stop()


def _drive(server: Server, options: Options) -> dict[str, Any]:
    workers = len([name for name in server.processes() if name.startswith("worker-")]) or 1
    scrapes = options.scrapes or 4 * workers
    memory_start = server.memory()
    context = multiprocessing.get_context("spawn")
    start_at = time.monotonic() + 5.0  # every client process is up by then
    hostile_at = start_at + options.baseline_fraction * options.duration_s
    end_at = start_at + options.duration_s
    good_results: multiprocessing.Queue = context.Queue()
    good = [
        context.Process(target=load.client_process, args=(load.ClientPlan(
            f"ws://127.0.0.1:{server.port}", "ws", options.rate / options.clients, options.duration_s,
            seed=options.seed * 1000 + i, voice=options.voice, language=options.language, frames=options.frames,
            api_key=API_KEY, start_at=start_at, hang_s=options.hang_s), good_results), daemon=True)
        for i in range(options.clients)
    ]

    def plan(kind: str, index: int) -> HostilePlan:
        return HostilePlan(kind, "127.0.0.1", server.port, hostile_at, end_at, options.hostile_concurrency,
                           options.hostile_pause_s, options.send_timeout_s, options.http_read_timeout_s,
                           options.max_message_bytes, options.hang_s, options.seed * 100 + index, options.language,
                           options.voice, options.frames)

    hostile_results: multiprocessing.Queue = context.Queue()
    kinds = [kind for kind in options.kinds if kind != "kill_reconnect"]
    hostile = {kind: context.Process(target=hostile_process, args=(plan(kind, i), hostile_results), daemon=True)
               for i, kind in enumerate(kinds)}
    killer = KillReconnect(plan("kill_reconnect", len(KINDS))) if "kill_reconnect" in options.kinds else None
    every_s = max(5.0, options.duration_s / 20)
    sampler = load.PeriodicSampler(lambda: _sample(server, start_at), every_s, time.monotonic() + every_s, "sampler")
    for process in [*good, *hostile.values()]:
        process.start()
    if killer is not None:
        killer.start()
    sampler.start()
    print(f"[{time.strftime('%H:%M:%S')}] {options.rate:g} good requests/s for {options.duration_s:g} s; hostile "
          f"clients from {hostile_at - start_at:.0f} s", file=sys.stderr, flush=True)

    core_kill: dict[str, Any] | None = None
    if options.kill_core_at >= 0:
        time.sleep(max(0.0, hostile_at + options.kill_core_at * (end_at - hostile_at) - time.monotonic()))
        core_kill = server.kill_core(options.restart_bound_s)
        print(f"[{time.strftime('%H:%M:%S')}] engine core killed: {json.dumps(core_kill)}", file=sys.stderr, flush=True)

    records: list[load.Record] = []
    for _ in good:
        records += [load.Record(**r) for r in good_results.get(timeout=max(1.0, end_at - time.monotonic())
                                                                + options.hang_s + 60)]
    tallies: dict[str, dict[str, Any]] = {}
    unit_bound = max(HostileClient(plan(kind, 0)).unit_bound_s() for kind in kinds) if kinds else 0.0
    deadline = end_at + unit_bound + 60
    while len(tallies) < len(kinds) and time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            tally = hostile_results.get(timeout=max(0.1, deadline - time.monotonic()))
            tallies[tally["kind"]] = tally
    for kind, process in hostile.items():  # a client process still running now has a unit that never ended
        process.join(5)
        if process.is_alive():
            process.kill()
        tallies.setdefault(kind, {"kind": kind, "units": {}, "outcomes": {"hung": 1}, "ends": {},
                                  "events": [(end_at, time.monotonic(), "hung", "the client process never finished")]})
    if killer is not None:
        killer.stop()
    for process in good:
        process.join(10)
    samples = sampler.stop(timeout=60)
    print(f"[{time.strftime('%H:%M:%S')}] every client has left; waiting for the gauges", file=sys.stderr, flush=True)

    settled = settle(server, scrapes, options.settle_s)
    agreement = scrape_agreement(server, scrapes)
    served_after = server.probe()
    final_metrics = scrape(server.port)
    memory_end = server.memory()
    report = _report(options, server, records, tallies, killer, core_kill, settled, agreement, served_after,
                     final_metrics, memory_start, memory_end, samples, (start_at, hostile_at, end_at))
    report["checks"] = checks(report, options)
    report["ok"] = all(check["ok"] for check in report["checks"].values())
    return report


def _kill_window(core_kill: dict[str, Any] | None, end_at: float) -> tuple[float, float] | None:
    if core_kill is None:
        return None
    served = core_kill["served_after_s"]
    return core_kill["killed_at"], (end_at if served is None else core_kill["killed_at"] + served) + KILL_GRACE_S


def _overlaps(start: float, end: float, window: tuple[float, float] | None) -> bool:
    return window is not None and start <= window[1] and end >= window[0]


def _record_end(record: load.Record) -> float:
    if record.failed_at is not None:
        return record.failed_at
    return record.started + (record.done_s or 0.0)


def good_error(error: str) -> str:
    """A good request's error by kind (benchmarks/serving/load.py's), a refused handshake told apart."""
    return HANDSHAKE_REFUSED if error.startswith("InvalidStatus") and "HTTP 503" in error else load.error_key(error)


def _errors(records: list[load.Record]) -> dict[str, int]:
    return dict(collections.Counter(good_error(r.error) for r in records if r.error is not None))


def _phase(records: list[load.Record], window: tuple[float, float]) -> dict[str, Any]:
    """benchmarks/serving/load.py's summary of the requests that arrived in `window`, with their refusals."""
    summary = load.summarize(records, window)
    errors = _errors([r for r in records if window[0] <= r.started < window[1]])
    refused = sum(n for code, n in errors.items() if code in (*REFUSALS, HANDSHAKE_REFUSED))
    summary.update(errors=errors, refusals=refused,
                   refusal_fraction=refused / summary["requests"] if summary["requests"] else None)  # type: ignore[operator]
    return summary


def _report(options: Options, server: Server, records: list[load.Record], tallies: dict[str, dict[str, Any]],
            killer: KillReconnect | None, core_kill: dict[str, Any] | None, settled: dict[str, Any],
            agreement: dict[str, Any], served_after: str | None, final_metrics: dict,
            memory_start: dict[str, Any], memory_end: dict[str, Any], samples: list[dict[str, Any]],
            times: tuple[float, float, float]) -> dict[str, Any]:
    start_at, hostile_at, end_at = times
    kill = _kill_window(core_kill, end_at)
    inside = [r for r in records if _overlaps(r.started, _record_end(r), kill)]
    outside = [r for r in records if not _overlaps(r.started, _record_end(r), kill)]
    hostile_report = {}
    for kind, tally in sorted(tallies.items()):
        events = [tuple(e) for e in tally["events"]]
        in_kill = [e for e in events if _overlaps(e[0], e[1], kill)]
        outside_kill = [e for e in events if e not in in_kill]

        def described(event: tuple[Any, ...]) -> str:
            return f"at {event[0] - start_at:.1f} s, for {event[1] - event[0]:.1f} s: {event[3]}"

        hostile_report[kind] = {
            "units": sum(tally["units"].values()), "by_variant": tally["units"], "outcomes": tally["outcomes"],
            "ends": tally["ends"], "slowest_s": tally.get("slowest_s", {}),
            "refused_outside_kill": sum(e[2] == "refused" for e in outside_kill),
            "refused_or_failed_in_kill_window": sum(e[2] in ("refused", "engine_error") for e in in_kill),
            # a refusal or an engine_error is an outage's answer; anything else never is
            "unexpected": [described(e) for e in events
                           if e[2] == "unexpected" or (e[2] == "engine_error" and e in outside_kill)][:20],
            "hung": [described(e) for e in events if e[2] == "hung"][:20],
        }
    if killer is not None:
        hostile_report["kill_reconnect"] = {"units": killer.kills, "sessions_open_at_kill": killer.sessions_at_kill}

    def labelled(name: str, label: str) -> dict[str, float]:
        return {dict(labels).get(label, ""): value for (sample, labels), value in sorted(final_metrics.items())
                if sample == name and value}

    return {
        "command": " ".join(sys.argv), "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average": os.getloadavg(), "options": asdict(options),
        "server": {"startup_s": round(server.startup_s, 1), "processes": server.processes()},
        "phases_s": {"baseline": round(hostile_at - start_at, 1), "hostile": round(end_at - hostile_at, 1)},
        "good": {
            "baseline": _phase(outside, (start_at + options.warmup_s, hostile_at)),
            "hostile": _phase(outside, (hostile_at, end_at)),
            "core_kill_window": {"requests": len(inside), "completed": sum(r.error is None for r in inside),
                                 "errors": _errors(inside)},
            "errors_outside_kill": _errors(outside),
            "hung": sum(r.error is not None and r.error.startswith("Hung") for r in records),
        },
        "hostile": hostile_report,
        "core_kill": core_kill,
        "settle": settled,
        "scrape_agreement": agreement,
        "served_after_run": served_after,
        "memory": {"start": memory_start, "end": memory_end, "samples": samples},
        "server_counters": {
            "errors": labelled("qwen3tts_errors_total", "code"),
            "cancels": labelled("qwen3tts_cancels_total", "reason"),
            "utterances": {f"{dict(labels)['endpoint']} {dict(labels)['finish_reason']}": value
                           for (sample, labels), value in sorted(final_metrics.items())
                           if sample == "qwen3tts_utterances_total" and value},
            "engine_restarts": metric_sum(final_metrics, "qwen3tts_engine_restarts"),
            "engine_healthy": metric_sum(final_metrics, "qwen3tts_engine_healthy"),
        },
    }


def _growth_over_second_half(samples: list[dict[str, Any]], end: dict[str, Any], hostile_at_s: float,
                             end_s: float) -> float | None:
    """The API processes' RSS at the end minus at the sample nearest the hostile phase's middle (MB)."""
    middle = (hostile_at_s + end_s) / 2
    usable = [s for s in samples if "api_rss_mb" in s]
    if not usable:
        return None
    nearest = min(usable, key=lambda s: abs(s["t_s"] - middle))
    return round(end["api_rss_mb"] - nearest["api_rss_mb"], 1)


def checks(report: dict[str, Any], options: Options) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}

    def check(name: str, ok: bool, actual: Any, expected: Any) -> None:
        found[name] = {"ok": bool(ok), "actual": actual, "expected": expected}

    settled, agreement = report["settle"], report["scrape_agreement"]
    check(f"every gauge at 0 within {options.settle_s:g} s of the clients leaving", settled["settled"],
          settled["gauges"], {name: 0 for name in GAUGES})
    check("repeated /metrics scrapes agree", agreement["differing"] == 0 and agreement["series"] > 0,
          agreement["examples"] or f"{agreement['series']} series alike", "every series equal")
    check("good sessions that hung", report["good"]["hung"] == 0, report["good"]["hung"], 0)
    hung = {kind: r["hung"] for kind, r in report["hostile"].items() if r.get("hung")}
    check("hostile sessions that hung", not hung, hung, {})
    errors = {code: n for code, n in report["good"]["errors_outside_kill"].items()
              if code not in (*REFUSALS, HANDSHAKE_REFUSED)}
    errors |= {f"{code} (core kill)": n for code, n in report["good"]["core_kill_window"]["errors"].items()
               if code not in (*REFUSALS, HANDSHAKE_REFUSED, "engine_error")}
    check("good clients' errors but refusals (and engine_error in the core kill's window)", not errors, errors, {})
    unexpected = {kind: r["unexpected"] for kind, r in report["hostile"].items() if r.get("unexpected")}
    check("hostile clients' answers the protocol does not give", not unexpected, unexpected, {})
    ran = {kind: report["hostile"].get(kind, {}).get("units", 0) for kind in options.kinds}
    check("every hostile kind ran", all(ran.values()), ran, "> 0 each")
    phases = {name: report["good"][name]["completed"] for name in ("baseline", "hostile")}
    check("good requests served in each phase", all(phases.values()), phases, "> 0 each")
    if report["core_kill"] is not None:
        served = report["core_kill"]["served_after_s"]
        check(f"engine core restarted and served within {options.restart_bound_s:g} s", served is not None,
              served, f"<= {options.restart_bound_s:g}")
        restarts = report["server_counters"]["engine_restarts"]
        check("the engine's restarts count the killed core", restarts >= 1, restarts, ">= 1")
        survivor = report["core_kill"]["open_session"]
        check("a session open across the core kill: refused while it was down, spoken after", survivor is None,
              survivor, None)
    check("a good utterance is served after the run", report["served_after_run"] is None,
          report["served_after_run"], None)
    memory = report["memory"]
    growth = _growth_over_second_half(memory["samples"], memory["end"], report["phases_s"]["baseline"],
                                      report["phases_s"]["baseline"] + report["phases_s"]["hostile"])
    check("API processes' RSS growth over the hostile phase's second half (MB)",
          growth is not None and growth < options.max_rss_growth_mb, growth, f"< {options.max_rss_growth_mb:g}")
    start_mb, end_mb = memory["start"]["device_memory_mb"], memory["end"]["device_memory_mb"]
    device = None if start_mb is None or end_mb is None else round(end_mb - start_mb, 1)
    check("engine device memory, end - start (MB)", device is not None and device <= options.max_device_growth_mb,
          device, f"<= {options.max_device_growth_mb:g}")
    for what, bound in (("open_files", options.max_open_files_growth), ("threads", options.max_threads_growth)):
        grown = sum(memory["end"][what].values()) - sum(memory["start"][what].values())
        check(f"serve's processes' {what.replace('_', ' ')}, end - start", grown <= bound,
              {"grown": grown, "start": memory["start"][what], "end": memory["end"][what]}, f"<= {bound}")
    base, hostile = report["good"]["baseline"], report["good"]["hostile"]
    if options.max_p95_ratio > 0:
        b95, h95 = base["first_audio_ms"]["p95"], hostile["first_audio_ms"]["p95"]
        ratio = round(h95 / b95, 2) if b95 and h95 else None
        check("good first audio p95, hostile / baseline", ratio is not None and ratio <= options.max_p95_ratio,
              ratio, f"<= {options.max_p95_ratio:g}")
    if base["underrun_fraction"] is not None and hostile["underrun_fraction"] is not None:
        grew = round(hostile["underrun_fraction"] - base["underrun_fraction"], 4)
        check("good underrun share, hostile - baseline", grew <= options.max_underrun_increase, grew,
              f"<= {options.max_underrun_increase:g}")
    if base["refusal_fraction"] is not None and hostile["refusal_fraction"] is not None:
        grew = round(hostile["refusal_fraction"] - base["refusal_fraction"], 4)
        check("good refusal share, hostile - baseline", grew <= options.max_refusal_increase, grew,
              f"<= {options.max_refusal_increase:g}")
    return found


# ---------------------------------------------------------------------- the table
def print_table(report: dict[str, Any], out: Any = sys.stdout) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    o = report["options"]
    print(f"\nhostile soak: {o['model']}, {o['rate']:g} good req/s of {o['frames']} frames, {o['duration_s']:g} s "
          f"(baseline {report['phases_s']['baseline']:g} s), workers {o['workers']}, server ready in "
          f"{report['server']['startup_s']} s", file=out)
    print(f"{'good clients':<18}{'requests':>9}{'served':>8}{'first audio p50/p95/p99 ms':>30}{'underruns':>11}"
          f"{'refusals':>10}  errors", file=out)
    for name in ("baseline", "hostile"):
        p = report["good"][name]
        fa = p["first_audio_ms"]
        first_audio = f"{ms(fa['p50'])} / {ms(fa['p95'])} / {ms(fa['p99'])}"
        print(f"{name:<18}{p['requests']:>9}{p['completed']:>8}{first_audio:>30}"
              f"{p['underrun_streams']:>11}{p['refusals']:>10}  {p['errors'] or ''}", file=out)
    k = report["good"]["core_kill_window"]
    print(f"{'core kill window':<18}{k['requests']:>9}{k['completed']:>8}{'':>30}{'':>11}{'':>10}  {k['errors'] or ''}",
          file=out)
    print(f"{'hostile clients':<18}{'units':>9}  outcomes / how the server ended them", file=out)
    for kind, h in report["hostile"].items():
        ends = h.get("ends") or {"sessions open at each kill": h.get("sessions_open_at_kill")}
        print(f"{kind:<18}{h['units']:>9}  {json.dumps(h.get('outcomes', {}))} {json.dumps(ends)}", file=out)
    if report["core_kill"]:
        c = report["core_kill"]
        print(f"core kill: pid {c['killed_pid']} -> {c['new_pid']}; /ready 503 after {c['not_ready_after_s']} s, 200 "
              f"after {c['ready_after_s']} s; a good utterance served after {c['served_after_s']} s; "
              f"qwen3tts_engine_restarts at the end: {report['server_counters']['engine_restarts']:g}", file=out)
    m = report["memory"]
    print(f"memory start -> end: API RSS {m['start']['api_rss_mb']} -> {m['end']['api_rss_mb']} MB, core RSS "
          f"{m['start']['core_rss_mb']} -> {m['end']['core_rss_mb']} MB, device {m['start']['device_memory_mb']} -> "
          f"{m['end']['device_memory_mb']} MB; open files {m['start']['open_files']} -> {m['end']['open_files']}, "
          f"threads {m['start']['threads']} -> {m['end']['threads']}", file=out)
    print(f"gauges at 0 after {report['settle']['after_s']} s; {report['scrape_agreement']['scrapes']} scrapes, "
          f"{report['scrape_agreement']['differing']} of {report['scrape_agreement']['series']} series differing",
          file=out)
    for name, c in report["checks"].items():
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {name}: {json.dumps(c['actual'])[:160]}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--duration", dest="duration_s", type=float, default=d.duration_s,
                        help="seconds of arrivals, baseline and hostile phases together")
    parser.add_argument("--baseline-fraction", type=float, default=d.baseline_fraction)
    parser.add_argument("--warmup", dest="warmup_s", type=float, default=d.warmup_s,
                        help="the baseline's figures leave out the run's first seconds")
    parser.add_argument("--rate", type=float, default=d.rate, help="good requests a second (open loop)")
    parser.add_argument("--frames", type=int, default=d.frames, help="frames per good utterance (80 ms each)")
    parser.add_argument("--clients", type=int, default=d.clients, help="good client processes")
    parser.add_argument("--workers", default=d.workers, help="serve --workers")
    parser.add_argument("--hostile-concurrency", type=int, default=d.hostile_concurrency, help="loops per hostile kind")
    parser.add_argument("--hostile-pause", dest="hostile_pause_s", type=float, default=d.hostile_pause_s,
                        help="mean pause between one loop's units")
    parser.add_argument("--kinds", nargs="+", default=list(d.kinds), choices=KINDS)
    parser.add_argument("--kill-core-at", type=float, default=d.kill_core_at,
                        help="when to SIGKILL the engine core, as a fraction of the hostile phase (negative: never)")
    parser.add_argument("--send-timeout", dest="send_timeout_s", type=float, default=d.send_timeout_s)
    parser.add_argument("--http-read-timeout", dest="http_read_timeout_s", type=float, default=d.http_read_timeout_s)
    parser.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes)
    parser.add_argument("--hang", dest="hang_s", type=float, default=d.hang_s,
                        help="a session with no done, error or close this long has hung")
    parser.add_argument("--settle", dest="settle_s", type=float, default=d.settle_s,
                        help="seconds for every gauge to read 0 once the clients have left")
    parser.add_argument("--scrapes", type=int, default=d.scrapes, help="0: four per API worker")
    parser.add_argument("--restart-bound", dest="restart_bound_s", type=float, default=d.restart_bound_s)
    parser.add_argument("--max-rss-growth-mb", type=float, default=d.max_rss_growth_mb)
    parser.add_argument("--max-device-growth-mb", type=float, default=d.max_device_growth_mb)
    parser.add_argument("--max-open-files-growth", type=int, default=d.max_open_files_growth)
    parser.add_argument("--max-threads-growth", type=int, default=d.max_threads_growth)
    parser.add_argument("--max-p95-ratio", type=float, default=d.max_p95_ratio, help="0: not judged")
    parser.add_argument("--max-underrun-increase", type=float, default=d.max_underrun_increase)
    parser.add_argument("--max-refusal-increase", type=float, default=d.max_refusal_increase)
    parser.add_argument("--language", default=d.language)
    parser.add_argument("--voice", default=d.voice)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--server-arg", dest="server_args", action="append", default=[],
                        help="extra argument for serve (repeatable), e.g. --server-arg=--max-streams=64")
    parser.add_argument("--server-log", help="write serve's output here")
    parser.add_argument("--startup-timeout", dest="startup_timeout_s", type=float, default=d.startup_timeout_s)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    options = Options(**{**args, "kinds": tuple(args["kinds"]), "server_args": tuple(args["server_args"])})
    report = run(options)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
