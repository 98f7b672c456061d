"""The diagnosis's load: open-loop Poisson sessions against ioapp.py from client processes that offer deflate.

Per session: first audio (flush sent -> first PCM received), and its two ends from the app's monotonic stamps (one
host, one clock): in = flush sent -> the handler saw it; out = the handler sent the first PCM -> the client had it.
Prints one JSON line: p50 / p95 of each, ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time

from websockets.asyncio.client import connect


async def one(url: str, compression: str | None, out: list[tuple[float, float, float]]) -> None:
    async with connect(url + "/v1/stream", max_size=None, compression=compression) as ws:
        await ws.send(json.dumps({"type": "start"}))
        sent = time.monotonic()
        await ws.send(json.dumps({"type": "flush", "frames": 100}))
        first = None
        while True:
            message = await ws.recv()
            now = time.monotonic()
            if isinstance(message, bytes):
                first = now if first is None else first
                continue
            body = json.loads(message)
            if body["type"] == "done":
                assert first is not None
                out.append((first - sent, body["seen"] - sent, first - body["first_sent"]))
                break
        await ws.send(json.dumps({"type": "close"}))


async def client(url: str, rate: float, n: int, compression: str | None, seed: int) -> tuple[list, int]:
    rnd = random.Random(seed)
    out: list[tuple[float, float, float]] = []
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(one(url, compression, out)))
        await asyncio.sleep(rnd.expovariate(rate))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return out, sum(isinstance(r, Exception) for r in results)


def run(args: tuple[str, float, int, str | None, int]) -> tuple[list, int]:
    return asyncio.run(client(*args))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--rate", type=float, default=10)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--no-deflate", action="store_true")
    p.add_argument("--label", default="")
    a = p.parse_args()
    compression = None if a.no_deflate else "deflate"
    per = a.rate / a.clients
    with multiprocessing.Pool(a.clients) as pool:
        results = pool.map(run, [(a.url, per, int(per * a.seconds), compression, s) for s in range(a.clients)])
    out = [o for r, _ in results for o in r]
    row: dict[str, object] = {"label": a.label, "rate": a.rate, "n": len(out), "errors": sum(e for _, e in results)}
    for i, name in enumerate(("first", "in", "out")):
        xs = sorted(1000 * o[i] for o in out)
        row[name] = f"{statistics.median(xs):.1f}/{xs[min(len(xs) - 1, int(0.95 * len(xs)))]:.1f}"
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
