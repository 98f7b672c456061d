"""Where one stream's frame period goes in the running engine: the GPU's own record of the steps' stream.

A graphed frame timed alone (`bench_engine.graph_frame_ms`) is shorter than a frame of a live stream: between
two frame graphs the steps' stream also copies the codes out (and the active rows in, when they change), and
the codec's kernels run beside the frames on their own stream. This profiles one stream through the engine
(CUPTI records every kernel and copy, on every stream) and splits each frame period into the frame's own
span, the copies, the idle gap, and how much longer frames grow while codec kernels overlap them.

    python -m benchmarks.engine.loop_timeline --model synthetic:0.6b --out loop-timeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.bench_engine import REF_TEXT, log, run_stream
from qwen3tts_agent import Engine, Voice
from qwen3tts_agent.models.loading import load_official_model
from qwen3tts_agent.reference import demo_reference

LAST_KERNEL_OF_A_FRAME = "_talker_code0_kernel"


def chrome_trace(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """The profiler's trace events (a profile exports its trace once)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())["traceEvents"]


def gpu_events(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kernels, copies and the host's CUDA calls from a `chrome_trace`: name, kind, stream, thread, start and
    end (µs)."""
    out = []
    for e in trace:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver") and e.get("dur", 0) > 0:
            out.append({"name": e["name"], "kind": e["cat"], "stream": e.get("args", {}).get("stream"), "tid": e.get("tid"),
                        "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"])})
    return sorted(out, key=lambda e: e["start"])


def host_calls_in_gaps(events: list[dict[str, Any]], rows: list[dict[str, float]], min_idle_us: float = 200.0,
                       min_call_us: float = 30.0) -> list[dict[str, Any]]:
    """For each long idle gap of the steps' stream: the host's CUDA calls (any thread) of 30 µs or more from
    the start of the frame before it to the launch after it; times relative to the gap's start."""
    calls = [e for e in events if e["kind"] in ("cuda_runtime", "cuda_driver") and e["end"] - e["start"] >= min_call_us]
    out = []
    for r in rows:
        if r["idle_us"] < min_idle_us:
            continue
        gap_start, gap_end = r["start"] + r["span_us"] + r["copies_us"], r["start"] + r["period_us"]
        out.append({"idle_us": r["idle_us"], "calls": [
            {"name": c["name"], "tid": c["tid"], "at_us": round(c["start"] - gap_start, 1), "us": round(c["end"] - c["start"], 1)}
            for c in calls if c["end"] >= r["start"] and c["start"] <= gap_end
        ]})
    return out


def overlap(start: float, end: float, events: list[dict[str, Any]]) -> float:
    return sum(max(0.0, min(end, e["end"]) - max(start, e["start"])) for e in events)


def frames(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per frame of the steps' stream: its span, the period to the next frame, copies and idle time after it,
    and the codec's kernel time (other streams) inside its span."""
    step_stream = next(e["stream"] for e in events if e["name"].startswith(LAST_KERNEL_OF_A_FRAME))
    steps = [e for e in events if e["stream"] == step_stream]
    others = [e for e in events if e["stream"] != step_stream and e["kind"] == "kernel"]
    # a frame: the kernels after the previous frame's last kernel, up to its own last one
    bounds, begin = [], None
    for i, e in enumerate(steps):
        if e["kind"] == "kernel" and begin is None:
            begin = i
        if e["name"].startswith(LAST_KERNEL_OF_A_FRAME):
            bounds.append((begin, i))
            begin = None
    out = []
    for (b0, b1), (n0, _) in zip(bounds, bounds[1:], strict=False):
        start, end, next_start = steps[b0]["start"], steps[b1]["end"], steps[n0]["start"]
        between = steps[b1 + 1 : n0]
        copies = sum(e["end"] - e["start"] for e in between if e["kind"] != "kernel")
        out.append({
            "start": start, "span_us": end - start, "period_us": next_start - start, "kernels": b1 - b0 + 1,
            "copies_us": copies, "copies": sum(e["kind"] != "kernel" for e in between),
            "idle_us": next_start - end - copies, "codec_overlap_us": overlap(start, end, others),
        })
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {f"{k}_p50": statistics.median(r[k] for r in rows) for k in rows[0] if k != "start"} | {"frames": len(rows)}


async def profile_stream(engine: Engine, voice: Voice, n_frames: int) -> list[dict[str, Any]]:
    await run_stream(engine, voice, n_frames, seed=0)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        await run_stream(engine, voice, n_frames, seed=1)
        torch.cuda.synchronize()
    return gpu_events(chrome_trace(prof))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:0.6b")
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    official = load_official_model(args.model, device="cuda", dtype=torch.bfloat16)
    engine = Engine(official, max_streams=1, max_seq_len=512)
    engine.warmup(progress=False)
    voice = Voice(prompt=engine.create_voice(demo_reference(), REF_TEXT))
    events = asyncio.run(profile_stream(engine, voice, args.frames))
    engine.close()
    rows = frames(events)[5:-2]  # steady frames: after the first chunks, before the last decode
    quiet = [r for r in rows if r["codec_overlap_us"] == 0]
    busy = [r for r in rows if r["codec_overlap_us"] > 0]
    report = {"model": args.model, "all": summary(rows), "codec_idle": summary(quiet) if quiet else {},
              "codec_running": summary(busy) if busy else {}, "frames": rows, "gaps": host_calls_in_gaps(events, rows)}
    for name in ("all", "codec_idle", "codec_running"):
        log(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in report[name].items()))
    for gap in report["gaps"][:4]:
        log(f"gap of {gap['idle_us']:.0f} µs; host calls: {gap['calls']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
