"""The engine core's outputs on their way to the API workers: what each chunk costs the core's threads, and how
long it takes to reach a worker.

At capacity the core sends over a thousand chunks a second from its engine thread, the thread that also queues
every step: a py-spy profile of 0.6B at 120 req/s on an H100 had the chunks' sends at ~8 % of that thread, and
forwarding them at most of the core's I/O thread's busy time (docs/performance.md). This drives the real
transport with no model work: a `HostedEngine` of the tiny synthetic model on this CPU (its core idle) behind a
real `CoreServer`, and `--clients` real `EngineClient`s, each in a process of its own as an API worker is. A
thread of the core process stands in for the engine thread: `--turns-per-s` turns a second, each some Python
work (`--turn-work-us`, the rest of a loaded turn) and then a few chunks (Poisson, `--chunks-per-turn` on
average; 1-8 frames of 24 kHz float PCM each, spread over the clients' requests) handed to the engine's output
path exactly as the core hands them, then the end of its turn. Reported: the engine thread's wall time in that
output path per chunk (median and p95 of its turns' per-chunk share; GIL waits included), the I/O thread's CPU
time per chunk, and each chunk's delivery time, from the output path taking it to the worker's engine client
handing it on (p50 / p95 / p99; both processes read the same monotonic clock); and, first, what a chunk's
encoding and send cost alone (`isolated_send_us`).

    python -m benchmarks.serving.bench_core_outputs --seconds 10 --out core-outputs.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from qwen3tts_agent.engine.messages import ChunkOutput, FinishOutput
from qwen3tts_agent.engine.process import ipc
from qwen3tts_agent.engine.process.client import EngineClient
from qwen3tts_agent.engine.process.core_server import CoreServer, HostedEngine
from qwen3tts_agent.engine.process.launch import GIL_SWITCH_INTERVAL_S
from qwen3tts_agent.engine.types import ChunkTimings, FinishReason

SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz
CHUNK_FRAMES = (1, 2, 4, 8, 8, 8, 8, 8)  # the default chunk schedule's sizes, the long ones most often
REQUESTS_PER_CLIENT = 64


class _TimedClient(EngineClient):
    """A worker's engine client that times each chunk it hands on instead of handing it to a stream."""

    delays: list[float]

    def chunk(self, output: ChunkOutput) -> None:
        self.delays.append(time.perf_counter() - output.timings.ready)


def _client(address: str, pipe: Connection) -> None:
    client = _TimedClient.connect(address, timeout=60)
    client.delays = []
    pipe.send(client._link.identity)
    pipe.recv()  # the sender is done
    time.sleep(0.5)  # the last chunks' way
    pipe.send(client.delays)
    client.close()


def _thread_cpu_s(native_id: int) -> float:
    """A thread of this process's user + system CPU seconds (Linux /proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def drive(engine: HostedEngine, owners: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The stand-in engine thread's turns (module docstring); each turn's output time per chunk."""
    rng = random.Random(0)
    pcm = {n: np.random.default_rng(n).uniform(-0.5, 0.5, n * SAMPLES_PER_FRAME).astype(np.float32) for n in set(CHUNK_FRAMES)}
    per_chunk: list[float] = []
    cpu = 0.0
    chunks = 0
    period = 1.0 / args.turns_per_s
    start = time.perf_counter()
    next_turn = start
    frame = 0
    while (now := time.perf_counter()) - start < args.seconds:
        if now < next_turn:
            time.sleep(next_turn - now)
        next_turn += period
        _busy(args.turn_work_us)
        n = int(np.random.default_rng(rng.randrange(2**32)).poisson(args.chunks_per_turn))
        if n == 0:
            continue
        began, began_cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            frames = rng.choice(CHUNK_FRAMES)
            ready = time.perf_counter()
            timings = ChunkTimings(ready, ready, ready, ready, ready, ready)
            engine.chunk(ChunkOutput(rng.choice(owners), pcm[frames].copy(), frame, frame + frames, False, timings))
            frame += frames
        per_chunk.append((time.perf_counter() - began) / n)
        cpu += time.thread_time() - began_cpu
        chunks += n
    for rid in owners:
        engine.finish(FinishOutput(rid, FinishReason.EOS, None, frame, 0.0, 0.0))
    return {"chunks": chunks, "turns_with_chunks": len(per_chunk), "wall_s": time.perf_counter() - start,
            "engine_thread_us_per_chunk": _quantiles(per_chunk), "engine_thread_cpu_us_per_chunk": round(1e6 * cpu / chunks, 1)}


def _quantiles(seconds: list[float]) -> dict[str, float]:
    """p50 / p95 / p99 and the mean, in µs."""
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p50": at(0.5), "p95": at(0.95), "p99": at(0.99), "mean": round(1e6 * statistics.fmean(ordered), 1)}


def isolated_send_us(turns: int = 300) -> float:
    """A chunk's encoding and send alone (median over `turns` turns of one chunk of each size): the real
    `ipc.encode_chunk` into a PUSH socket whose in-process peer is drained between turns, no other thread running.
    The floor under the loaded figure: what is above it is waiting (for the GIL, for a core)."""
    context = zmq.Context.instance()
    address = f"inproc://bench-core-outputs-{uuid.uuid4().hex}"
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind(address)
    push.connect(address)
    timings = ChunkTimings(0.0, 0.0, 0.0, 0.0)
    outputs = [ChunkOutput("w:r", np.zeros(n * SAMPLES_PER_FRAME, np.float32), 0, n, False, timings) for n in set(CHUNK_FRAMES)]
    per_chunk = []
    for _ in range(turns):
        began = time.perf_counter()
        for output in outputs:
            push.send_multipart([b"identity", *ipc.encode_chunk(output, "r")], copy=False)
        per_chunk.append((time.perf_counter() - began) / len(outputs))
        for _ in outputs:
            pull.recv_multipart()
    push.close(linger=0)
    pull.close(linger=0)
    return round(1e6 * statistics.median(per_chunk), 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as the core process sets it (`core_main`)
    engine = HostedEngine.load("synthetic:tiny", device="cpu", progress=False, max_streams=4)
    address = f"ipc://{tempfile.mkdtemp(prefix='qwen3tts-bench-')}/core.sock"
    server = CoreServer(engine, address)
    server.start()
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for _ in range(args.clients):
        ours, theirs = context.Pipe()
        process = context.Process(target=_client, args=(address, theirs), daemon=True)
        process.start()
        pipes.append(ours)
        processes.append(process)
    owners = []
    for pipe in pipes:
        identity: bytes = pipe.recv()
        for i in range(REQUESTS_PER_CLIENT):  # the requests a worker's ADD messages would have registered
            rid = f"{identity.hex()}:r{i}"
            server._owners[rid] = identity
            owners.append(rid)
    io_thread = next(t for t in threading.enumerate() if t.name == "qwen3tts-core-io")
    assert io_thread.native_id is not None
    io_before = _thread_cpu_s(io_thread.native_id)
    result: dict[str, Any] = {}
    sender = threading.Thread(target=lambda: result.update(drive(engine, owners, args)), name="qwen3tts-engine-stand-in")
    sender.start()
    sender.join()
    result["io_thread_us_per_chunk"] = round(1e6 * (_thread_cpu_s(io_thread.native_id) - io_before) / result["chunks"], 1)
    delays: list[float] = []
    for pipe in pipes:
        pipe.send(None)
    for pipe, process in zip(pipes, processes, strict=True):
        delays += pipe.recv()
        process.join(timeout=30)
    result["received"] = len(delays)
    result["delivery_us"] = _quantiles(delays)
    server.stop()
    engine.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4, help="API workers (processes), each with its requests")
    parser.add_argument("--turns-per-s", type=float, default=300.0)
    parser.add_argument("--chunks-per-turn", type=float, default=6.0)
    parser.add_argument("--turn-work-us", type=float, default=1500.0, help="the turn's other Python work")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "args": {k: str(v) for k, v in vars(args).items()},
        "isolated_send_us_per_chunk": isolated_send_us(), **run(args),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
