"""Where a graphed frame's time goes: every kernel of one `frame_step` graph replay on the GPU's clock.

Under programmatic dependent launch the kernels of a frame overlap, so summed kernel durations say little.
This replays the captured frame under the profiler (CUPTI records the kernels a graph launches) and charges
each kernel the time by which it extends the frame: its end minus the latest end before it. Those charges
add up to the replay's span; they are reported per kernel name and, for the predictor, per step position.

    python -m benchmarks.engine.frame_timeline --model synthetic:0.6b --out timeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.bench_engine import log
from qwen3tts_agent import Engine, SamplingParams
from qwen3tts_agent.kernels import decode_layer, frame, gemv
from qwen3tts_agent.models.loading import load_official_model


def replay_kernels(graph: torch.cuda.CUDAGraph, replays: int) -> list[list[dict[str, Any]]]:
    """The kernels (name, start and end in µs) of each of `replays` graph replays, in start order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    per_replay = []
    for _ in range(replays):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [
            {"name": e.name, "start": e.time_range.start, "end": e.time_range.end}
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
        ]
        kernels.sort(key=lambda k: k["start"])
        t0 = kernels[0]["start"]
        per_replay.append([{**k, "start": k["start"] - t0, "end": k["end"] - t0} for k in kernels])
    return per_replay


def charges(kernels: list[dict[str, Any]]) -> list[float]:
    """Per kernel: how much later the frame ends because of it (its end minus the latest earlier end)."""
    latest, out = 0.0, []
    for k in kernels:
        out.append(max(0.0, k["end"] - latest))
        latest = max(latest, k["end"])
    return out


def summarize(kernels: list[dict[str, Any]]) -> dict[str, Any]:
    charged = charges(kernels)
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "charged_us": 0.0, "duration_us": 0.0})
    for k, c in zip(kernels, charged, strict=True):
        row = by_name[k["name"][:60]]
        row["count"] += 1
        row["charged_us"] += c
        row["duration_us"] += k["end"] - k["start"]
    return {
        "span_us": kernels[-1]["end"] - kernels[0]["start"] if kernels else 0.0,
        "kernels": len(kernels),
        "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["charged_us"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-len", type=int, default=256)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=INT",
                        help="override an integer constant of kernels.decode_layer, kernels.gemv or kernels.frame (an A/B switch)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    for name, value in overrides.items():
        modules = [m for m in (decode_layer, gemv, frame) if isinstance(getattr(m, name, None), int)]
        if not modules:
            parser.error(f"{name} is not an integer constant of the kernel modules")
        for module in modules:  # a constant imported by name into another module is set there too
            setattr(module, name, int(value))
    official = load_official_model(args.model, device="cuda", dtype=torch.bfloat16)
    engine = Engine(official, max_streams=max(1, args.batch), max_seq_len=max(512, args.kv_len))
    runner = engine.core.runner
    for slot in range(args.batch):  # the default sampling (top-k 50 of a sort), as streams use it
        runner.reset_slot(slot, asdict(SamplingParams(seed=slot)))
    runner.active.zero_()  # every row inactive: a frame's work, but no slot's state moves
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            runner.frame_step(args.batch, args.kv_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            runner.frame_step(args.batch, args.kv_len)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    replays = replay_kernels(graph, args.replays)
    summaries = [summarize(r) for r in replays]
    spans = [s["span_us"] for s in summaries]
    best = replays[spans.index(statistics.median_low(spans))]
    report = {"model": args.model, "batch": args.batch, "kv_len": args.kv_len, "overrides": overrides, "spans_us": spans,
              "median_replay": summarize(best), "timeline": best}
    log(f"spans (µs): {[round(s, 1) for s in spans]}; median replay: {len(best)} kernels")
    for name, row in list(report["median_replay"]["by_name"].items())[:12]:
        log(f"  {name:60s} {row['count']:4d} launches, charged {row['charged_us']:8.1f} µs, durations {row['duration_us']:8.1f} µs")
    engine.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
