"""Where a batched frame step's time goes under load: the GPU's own record of every CUDA stream while the engine
serves open-loop arrivals.

Through `serve` at 120 req/s of 0.6B a ~215-row step takes ~13.4 ms of device time, against ~8.5 ms for a 240-row
graph replayed alone, and a third fewer codec calls did not shorten it (docs/performance.md). This runs the engine
in-process at a rate (Poisson arrivals of fixed-length utterances, as `bench_engine --rates`), records a few
seconds of it with CUPTI once it has warmed up, and splits each step on the steps' stream into its own kernels'
time and the gaps between them, beside how much of its span the other streams' kernels overlapped: the codec
lanes' (streams that run the codec's kernels) and the rest (the prompts' lane). Steps grouped by that overlap show
whether it is the step's kernels that slow (sharing the SMs and the memory bandwidth) or the gaps between them.
The host's side of the same seconds: each thread's CUDA calls (`host_calls`), how long each kind took and how
much of the thread's time they held. A launch or an asynchronous copy that takes far longer than its usual few
µs waited for room in the driver's queue: then the core's thread is held by the device, and py-spy shows it at
whatever call it was making (the profile of 0.6B at 120 req/s had single copies charged ~200 µs each).

    python -m benchmarks.engine.loaded_timeline --model synthetic:0.6b --rate 120 --out loaded-timeline.json

In-process, the listeners run on the engine's own Python process (not in client processes, as `serve` is
measured): the device's side of the picture, not the server's latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.bench_engine import REF_TEXT, log, poisson
from benchmarks.engine.loop_timeline import LAST_KERNEL_OF_A_FRAME, chrome_trace, gpu_events
from qwen3tts_agent import Engine, Voice
from qwen3tts_agent.models.loading import load_official_model
from qwen3tts_agent.reference import demo_reference

# A stream that runs the predictor's sampling runs frame steps (a prompt's prefill samples codebook 0, not these);
# one that runs any of the streaming codec's own Triton kernels is a codec lane.
STEP_KERNEL = "_predictor_code_kernel"
CODEC_KERNELS = ("_extend_kernel", "_epilogue_kernel", "_rope_window_kernel")
# Steps grouped by the share of their span that other streams' kernels overlapped: below each bound in turn.
OVERLAP_GROUPS = (0.25, 0.5, 0.75, 1.0)
# A step's kernels follow each other within microseconds; kernels on the steps' stream this long before the next
# (a text feed, a slot's copy) are the loop's work between steps, not the next step's.
STEP_GAP_US = 500.0


def stream_kinds(events: list[dict[str, Any]]) -> dict[Any, str]:
    """Each CUDA stream of the trace as "steps" (it runs frame steps), "codec" or "other"."""
    kinds: dict[Any, str] = {}
    for e in events:
        if e["kind"] != "kernel":
            continue
        if e["name"].startswith(STEP_KERNEL):
            kinds[e["stream"]] = "steps"
        elif e["name"].startswith(CODEC_KERNELS) and kinds.get(e["stream"]) != "steps":
            kinds[e["stream"]] = "codec"
        else:
            kinds.setdefault(e["stream"], "other")
    return kinds


def union_us(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """How long within [start, end] at least one of `spans` runs."""
    total, reach = 0.0, start
    for s, e in sorted(spans):
        s, e = max(s, reach), min(e, end)
        if e > s:
            total += e - s
            reach = e
    return total


def step_rows(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step on a steps' stream (its kernels up to the frame's last one): its span, kernel count, its own
    kernels' time, the gaps between them, and the time within its span that codec and other kernels ran. Under
    programmatic dependent launch a step's next kernel starts before the last has ended, so the gaps may read
    negative: overlap the step's own kernels made."""
    kinds = stream_kinds(events)
    kernels = [e for e in events if e["kind"] == "kernel"]
    by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in kernels:
        if kinds[e["stream"]] != "steps":
            by_kind[kinds[e["stream"]]].append((e["start"], e["end"]))
    rows: list[dict[str, float]] = []
    own_by_stream: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in kernels:
        if kinds[e["stream"]] != "steps":
            continue
        own = own_by_stream[e["stream"]]
        if own and e["start"] - own[-1]["end"] > STEP_GAP_US:
            own.clear()  # what came before was work between steps
        own.append(e)
        if not e["name"].startswith(LAST_KERNEL_OF_A_FRAME):
            continue
        start, end = own[0]["start"], own[-1]["end"]
        kernel_us = sum(k["end"] - k["start"] for k in own)
        codec = union_us(by_kind["codec"], start, end)
        other = union_us(by_kind["other"], start, end)
        either = union_us(by_kind["codec"] + by_kind["other"], start, end)
        rows.append({
            "start": start, "span_us": end - start, "kernels": len(own), "kernel_us": kernel_us,
            "gaps_us": end - start - kernel_us, "codec_overlap_us": codec, "other_overlap_us": other,
            "overlap_share": either / (end - start) if end > start else 0.0,
        })
        own.clear()
    return sorted(rows, key=lambda row: row["start"])


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = ("span_us", "kernels", "kernel_us", "gaps_us", "codec_overlap_us", "other_overlap_us")
    return {"steps": len(rows)} | {f"{k}_p50": statistics.median(r[k] for r in rows) for k in keys}


def by_overlap(rows: list[dict[str, float]], min_kernels: float) -> dict[str, dict[str, float]]:
    """The batched steps (at least `min_kernels` kernels: a step of few rows runs the fused layers' fewer kernels)
    grouped by the share of their span that other streams' kernels overlapped."""
    out, low = {}, 0.0
    batched = [r for r in rows if r["kernels"] >= min_kernels]
    for high in OVERLAP_GROUPS:
        group = [r for r in batched if low <= r["overlap_share"] < high or (high == 1.0 and r["overlap_share"] == 1.0)]
        if group:
            out[f"overlap {low:.2f}-{high:.2f}"] = summary(group)
        low = high
    return out


def busy_shares(events: list[dict[str, Any]]) -> dict[str, float]:
    """Of the recorded time, the share in which each kind of stream ran a kernel, and in which any did."""
    kernels = [e for e in events if e["kind"] == "kernel"]
    start, end = min(e["start"] for e in kernels), max(e["end"] for e in kernels)
    kinds = stream_kinds(events)
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in kernels:
        spans[kinds[e["stream"]]].append((e["start"], e["end"]))
    shares = {kind: union_us(s, start, end) / (end - start) for kind, s in sorted(spans.items())}
    shares["any"] = union_us([span for s in spans.values() for span in s], start, end) / (end - start)
    return shares | {"recorded_s": (end - start) / 1e6}


def host_calls(events: list[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """Per host thread that made CUDA calls in the recording (most calls first): the share of the recorded time it
    spent inside them, and per kind of call (the `top` costliest) how many a second, how much of the thread's time,
    and their p50 / p99 / longest in µs."""
    calls = [e for e in events if e["kind"] in ("cuda_runtime", "cuda_driver")]
    if not calls:
        return {}
    start = min(e["start"] for e in events)
    seconds = (max(e["end"] for e in events) - start) / 1e6
    by_thread: dict[Any, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in calls:
        by_thread[e["tid"]][e["name"]].append(e["end"] - e["start"])
    out: dict[str, Any] = {}
    for tid, kinds in sorted(by_thread.items(), key=lambda item: -sum(len(d) for d in item[1].values())):
        durations = {name: sorted(d) for name, d in kinds.items()}
        costliest = sorted(durations.items(), key=lambda item: -sum(item[1]))[:top]
        out[str(tid)] = {
            "busy_share": sum(sum(d) for d in durations.values()) / 1e6 / seconds,
            "calls": {
                name: {
                    "per_s": len(d) / seconds, "share": sum(d) / 1e6 / seconds, "p50_us": d[len(d) // 2],
                    "p99_us": d[min(len(d) - 1, int(0.99 * len(d)))], "max_us": d[-1],
                }
                for name, d in costliest
            },
        }
    return out


async def profiled_load(engine: Engine, voice: Voice, rate: float, warmup_s: float, record_s: float,
                        frames: int) -> tuple[list[dict[str, Any]], dict[str, object]]:
    """Arrivals at `rate` for warm-up + recording + a tail; CUPTI records `record_s` after `warmup_s`."""
    load = asyncio.create_task(poisson(engine, voice, rate, warmup_s + record_s + 2.0, frames))
    await asyncio.sleep(warmup_s)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    prof.start()
    await asyncio.sleep(record_s)
    prof.stop()
    return gpu_events(chrome_trace(prof)), await load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:0.6b")
    parser.add_argument("--rate", type=float, default=120.0, help="arrivals a second (Poisson)")
    parser.add_argument("--frames", type=int, default=100, help="frames an utterance (8 s at 100)")
    parser.add_argument("--max-streams", default="auto")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds of load before the recording")
    parser.add_argument("--record", type=float, default=2.0, help="seconds recorded")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    official = load_official_model(args.model, device="cuda", dtype=torch.bfloat16)
    max_streams = args.max_streams if args.max_streams == "auto" else int(args.max_streams)
    engine = Engine(official, max_streams=max_streams, max_seq_len=args.max_seq_len)
    engine.warmup(progress=False)
    voice = Voice(prompt=engine.create_voice(demo_reference(), REF_TEXT))
    events, load = asyncio.run(profiled_load(engine, voice, args.rate, args.warmup, args.record, args.frames))
    engine.close()
    rows = step_rows(events)
    if not rows:
        raise SystemExit("the recording holds no frame step: is the engine on a GPU, and loaded?")
    most = max(r["kernels"] for r in rows)
    report = {
        "model": args.model, "rate_per_s": args.rate, "max_streams": engine.max_streams, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "busy": busy_shares(events), "steps": summary(rows),
        "batched_steps_by_overlap": by_overlap(rows, min_kernels=most // 2), "host_calls": host_calls(events),
        "load": load, "rows": rows,
    }
    log(f"busy: {report['busy']}")
    for tid, thread in report["host_calls"].items():
        log(f"thread {tid}: {thread['busy_share']:.1%} in CUDA calls; " + "; ".join(
            f"{name} {c['per_s']:.0f}/s p50 {c['p50_us']:.1f} p99 {c['p99_us']:.1f} max {c['max_us']:.0f} µs"
            for name, c in thread["calls"].items()
        ))
    for name, group in report["batched_steps_by_overlap"].items():
        log(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in group.items()))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
