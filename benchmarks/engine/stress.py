"""Stress the engine in-process: open-loop arrivals of mixed streams, with no server in front, to find faults.

A GPU engine's lanes (frame steps, prompts, the staged prefill, two codec lanes) run on CUDA streams of their own,
and the faults that only concurrency brings show at high arrival rates: an illegal memory access ended the engine
core once at 75 req/s of 1.7B with a 1-frame second chunk (benchmarks/results/2026-12-06-h100-capacity-e). This
drives the engine as the server does, without the server's own limits and processes in the way, and with a model
as small as `synthetic:tiny` it runs under `compute-sanitizer --tool memcheck`, which names the kernel and address
of an out-of-bounds access where a plain run only reports it later, at some other call.

Arrivals are Poisson at `--rate` for `--duration` seconds. Each stream speaks one of a few texts: given whole, or
streamed in word by word (an LLM's tokens); a share is cancelled after its first chunk (barge-in). A `busy`
refusal (a GPU engine behind real time) is counted, not an error. It fails (exit 1) on any other error of a stream
or of the engine, and on a stream that has not ended `--hang-s` after its last arrival.

    python -m benchmarks.engine.stress --model synthetic:1.7b-customvoice --rate 75 --duration 30 \\
        --chunk-schedule 1,1,2,4,8 --out stress.json
    compute-sanitizer --tool memcheck --target-processes all python -m benchmarks.engine.stress \\
        --model synthetic:tiny-customvoice --rate 4 --duration 20 --max-streams 64 --no-shed --hang-s 600 \\
        --chunk-schedule 1,1,2,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.serving.load import pct
from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.errors import EngineOverloadedError
from qwen3tts_agent.reference import demo_reference

TEXTS = (
    "Hello there, how can I help you today?",
    "Your order shipped this morning and should arrive on Thursday.",
    "Sure. One moment while I look that up for you.",
    "I'm sorry, could you repeat the last part?",
)
HANG_S = 60.0


@dataclass
class Outcomes:
    """What became of the streams opened, by how they ended."""

    opened: int = 0
    refused: int = 0
    finished: collections.Counter[str] = field(default_factory=collections.Counter)  # by finish reason
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # by exception and message
    first_audio_s: list[float] = field(default_factory=list)
    hung: int = 0


def voice_for(engine: Engine) -> Voice:
    """A voice every model type takes: a named speaker, a described one, or an x-vector clone of the demo reference."""
    if engine.model_type == "custom_voice":
        return Voice(speaker=engine.speakers[0])
    if engine.model_type == "voice_design":
        return Voice(instruct="A calm, warm voice.")
    return Voice(prompt=engine.create_voice(demo_reference(), None, x_vector_only=True))


async def one_stream(engine: Engine, voice: Voice, args: argparse.Namespace, rng: random.Random, out: Outcomes) -> None:
    sampling = SamplingParams(max_frames=args.frames, ignore_eos=True, seed=rng.randrange(1 << 30))
    text = rng.choice(TEXTS)
    streamed = rng.random() < args.streamed_share
    try:
        stream = engine.open_stream(None if streamed else text, voice=voice, sampling=sampling)
    except EngineOverloadedError:
        out.refused += 1
        return
    out.opened += 1
    started = time.perf_counter()
    barge_in = rng.random() < args.cancel_share
    if streamed:
        for word in text.split(" "):
            stream.push_text(word + " ")
            await asyncio.sleep(rng.uniform(0.0, 0.02))  # an LLM's tokens, 50+ a second
        stream.close_input()
    first = True
    try:
        async for _ in stream:
            if first:
                out.first_audio_s.append(time.perf_counter() - started)
                first = False
            if barge_in:
                stream.cancel()
                break
        result = stream.result
        out.finished["cancelled" if barge_in else str(result.finish_reason)] += 1
    except Exception as exc:  # noqa: BLE001 - every other failure is what this looks for
        out.errors[f"{type(exc).__name__}: {str(exc)[:200]}"] += 1


async def drive(engine: Engine, args: argparse.Namespace) -> Outcomes:
    rng = random.Random(args.seed)
    voice = voice_for(engine)
    out = Outcomes()
    tasks: list[asyncio.Task[None]] = []
    began = time.perf_counter()
    next_at = began
    while (now := time.perf_counter()) < began + args.duration:
        if now < next_at:
            await asyncio.sleep(next_at - now)
        tasks.append(asyncio.create_task(one_stream(engine, voice, args, rng, out)))
        next_at += rng.expovariate(args.rate)
    _, pending = await asyncio.wait(tasks, timeout=args.hang_s) if tasks else (set(), set())
    out.hung = len(pending)
    for task in pending:
        task.cancel()
    return out


def report(engine: Engine, args: argparse.Namespace, out: Outcomes, seconds: float) -> dict[str, Any]:
    stats = engine.stats()
    audio_ms = [s * 1000 for s in out.first_audio_s]
    return {
        "command": " ".join(sys.argv),
        "model": args.model,
        "device": str(engine.device),
        "max_streams": engine.max_streams,
        "chunk_schedule": args.chunk_schedule,
        "rate_per_s": args.rate,
        "seconds": round(seconds, 1),
        "opened": out.opened,
        "refused_busy": out.refused,
        "finished": dict(out.finished),
        "errors": dict(out.errors),
        "hung": out.hung,
        "first_audio_ms": {"p50": pct(audio_ms, 50), "p95": pct(audio_ms, 95)},
        "engine": {"healthy": stats.healthy, "restarts": stats.restarts, "errors": stats.errors,
                   "late_chunks": stats.late_chunks, "late_by_index": stats.late_by_index,
                   "late_by_cause": stats.late_by_cause,
                   "steps": stats.steps, "frames_generated": stats.frames_generated},
        "ok": not out.errors and not out.hung and stats.errors == 0 and stats.restarts == 0 and stats.healthy,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:tiny-customvoice")
    p.add_argument("--device", default="auto")
    p.add_argument("--rate", type=float, default=20.0, help="arrivals a second (Poisson)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--frames", type=int, default=60, help="frames per stream (ignore_eos)")
    p.add_argument("--max-streams", default="auto")
    p.add_argument("--chunk-schedule", default=None, help="frames per chunk, e.g. 1,1,2,4,8 (default: the engine's)")
    p.add_argument("--streamed-share", type=float, default=0.3, help="share of streams whose text comes word by word")
    p.add_argument("--cancel-share", type=float, default=0.1, help="share of streams cancelled after their first chunk")
    p.add_argument("--hang-s", type=float, default=HANG_S, help="a stream not ended this long after the last arrival hangs")
    p.add_argument("--no-shed", action="store_true",
                   help="the engine never refuses for running behind (under compute-sanitizer every step is slow)")
    p.add_argument("--no-graphs", action="store_true",
                   help="no CUDA graphs: with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (which graphs cannot replay under), "
                        "memcheck sees every tensor's own bounds, not the caching allocator's blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    max_streams: int | str = args.max_streams if args.max_streams == "auto" else int(args.max_streams)
    kwargs: dict[str, Any] = {"max_streams": max_streams}
    if args.no_shed:
        kwargs["shed_when_behind"] = False
    if args.no_graphs:
        kwargs["use_cuda_graphs"] = False
    if args.chunk_schedule:
        kwargs["chunk_schedule"] = tuple(int(n) for n in args.chunk_schedule.split(","))
    engine = Engine.load(args.model, device=args.device, progress=sys.stderr.isatty(), **kwargs)
    try:
        engine.warmup(progress=sys.stderr.isatty())
        began = time.perf_counter()
        out = asyncio.run(drive(engine, args))
        result = report(engine, args, out, time.perf_counter() - began)
    finally:
        engine.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
