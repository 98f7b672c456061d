"""Where one stream's first audio goes, on the device and on the host: the GPU's own record of every lane.

`bench_engine` gives the first audio's stages as the host sees them (prompt launched, first frame's codes on
the host, first chunk decoded, delivered). This profiles single streams of a named speaker through the engine
(CUPTI records every kernel and copy on every CUDA stream, and the host's graph launches) and lays out, from
the `open_stream` call to the consumer holding the first chunk: each lane's busy span and kernel count (the
prompt lane, the steps' stream, the early codec lane), the idle time between them, and when the host launched
each graph. It also times the early lane's one-frame codec graph alone and counts its kernels by kind.

    python -m benchmarks.engine.first_audio_timeline --model synthetic:0.6b-customvoice --out first-audio.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.bench_engine import log, profile_kernels
from benchmarks.engine.loop_timeline import chrome_trace, gpu_events
from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.engine.audio import GraphedCodecDecode, StreamingCodecDecoder
from qwen3tts_agent.models.loading import load_official_model

TEXT = "Hello there, how can I help you today?"


async def first_chunk(engine: Engine, voice: Voice, seed: int) -> dict[str, float]:
    """One short stream; the host's stage times of its first chunk (ms) and its first audio."""
    submitted = time.perf_counter()
    with torch.profiler.record_function("open_stream"):
        stream = engine.open_stream(TEXT, voice=voice, language="english",
                                    sampling=SamplingParams(seed=seed, max_frames=4, ignore_eos=True))
    stages: dict[str, float] = {}
    async for chunk in stream:
        if not stages:
            with torch.profiler.record_function("first_chunk"):
                now = time.perf_counter()
            t = chunk.timings
            stages = {"first_audio": now - submitted, "prompt": t.prefill_done - t.submitted,
                      "first_frame": t.first_frame - t.prefill_done, "codec": t.ready - t.first_frame,
                      "delivery": now - t.ready}
    return {k: 1000 * v for k, v in stages.items()}


def lane_layout(prof: torch.profiler.profile) -> dict[str, Any]:
    """The device's work between `open_stream` and `first_chunk`, per CUDA stream, in µs from `open_stream`."""
    trace = chrome_trace(prof)
    events = gpu_events(trace)
    marks = [e for e in trace if e.get("name") in ("open_stream", "first_chunk")]
    start = min(float(e["ts"]) for e in marks if e["name"] == "open_stream")
    end = max(float(e["ts"]) for e in marks if e["name"] == "first_chunk")
    lanes: dict[str, dict[str, Any]] = {}
    launches = []
    for e in events:
        if e["end"] < start or e["start"] > end:
            continue
        if e["kind"] in ("cuda_runtime", "cuda_driver"):
            if "Graph" in e["name"] or ("Launch" in e["name"] and e["end"] - e["start"] > 20):
                launches.append({"call": e["name"], "at_us": round(e["start"] - start, 1), "us": round(e["end"] - e["start"], 1)})
            continue
        lane = lanes.setdefault(str(e["stream"]), {"first_us": e["start"] - start, "last_us": 0.0, "kernels": 0, "busy_us": 0.0, "names": {}})
        lane["last_us"] = max(lane["last_us"], e["end"] - start)
        lane["kernels"] += 1
        lane["busy_us"] += e["end"] - e["start"]
        short = e["name"].split("<")[0][:48]
        lane["names"][short] = lane["names"].get(short, 0) + 1
    for lane in lanes.values():
        lane["names"] = dict(sorted(lane["names"].items(), key=lambda kv: -kv[1])[:8])
        lane["first_us"] = round(lane["first_us"], 1)
        lane["last_us"] = round(lane["last_us"], 1)
        lane["busy_us"] = round(lane["busy_us"], 1)
    return {"first_chunk_at_us": round(end - start, 1), "lanes": lanes, "graph_launches": launches[:40]}


# The host-side steps of a first audio, as (owner path on the engine, method name): the caller's thread first,
# then the core's.
HOST_STEPS = (
    ("", "open_stream"), ("core", "_apply"), ("core.prompt_lane", "_set_up"), ("core.runner", "reset_slot"),
    ("core.audio", "start"), ("core.prefills", "copy_head"), ("core.prompt_lane", "_prompt_row"),
    ("core.prompt_lane", "_prefill"), ("core.prefills", "run"), ("core.prompt_lane", "_feed"),
    ("core.launcher", "_queue_step"), ("core.launcher", "collect"),
    ("core.audio", "decode"), ("core.audio", "finished"), ("core", "_deliver_chunk"),
)


async def host_timeline(engine: Engine, voice: Voice, runs: int) -> dict[str, Any]:
    """Each host step's first start and end (ms after `open_stream` was called), per stream; the median over
    `runs` streams. Steps that ran more than once report their first call, and their calls' count."""
    calls: list[tuple[str, float, float]] = []
    originals = []
    for path, name in HOST_STEPS:
        owner: Any = engine
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        original = getattr(owner, name)
        originals.append((owner, name, original))

        def timed(*args: Any, _f: Any = original, _n: str = f"{path}.{name}".lstrip(".") , **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                calls.append((_n, begin, time.perf_counter()))
        setattr(owner, name, timed)
    per_stream: list[dict[str, tuple[float, float, int]]] = []
    try:
        for seed in range(runs):
            calls.clear()
            submitted = time.perf_counter()
            await first_chunk(engine, voice, 200 + seed)
            steps: dict[str, tuple[float, float, int]] = {}
            for name, begin, end in calls:
                if name in steps:
                    first = steps[name]
                    steps[name] = (first[0], first[1], first[2] + 1)
                else:
                    steps[name] = (1000 * (begin - submitted), 1000 * (end - submitted), 1)
            per_stream.append(steps)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    names = [n for n in per_stream[0] if all(n in s for s in per_stream)]
    return {n: {"start_ms": statistics.median(s[n][0] for s in per_stream), "end_ms": statistics.median(s[n][1] for s in per_stream),
                "calls": statistics.median(s[n][2] for s in per_stream)} for n in sorted(names, key=lambda n: per_stream[0][n][0])}


def codec_one_frame(engine: Engine, reps: int = 200) -> dict[str, Any]:
    """The early lane's one-frame decode: graph replay time (CUDA events, median), and its kernels by kind."""
    audio = engine.core.audio
    graphs = audio._early_graphs or audio._graphs
    assert graphs is not None
    codec = audio.codec
    out: dict[str, Any] = {}
    for frames in graphs.frame_sizes:
        codes = torch.randint(0, 2048, (1, frames, codec.num_quantizers), device=engine.device)
        codec.reset(0)
        out[f"graph_b1_t{frames}_ms"] = _median_ms(lambda c=codes: graphs.decode([0], c), reps)
    codes = torch.randint(0, 2048, (1, 1, codec.num_quantizers), device=engine.device)
    slots = torch.zeros(1, dtype=torch.long, device=engine.device)
    out["transformer_path"] = codec.transformer_path
    out["eager_b1_t1_kernels"] = profile_kernels(lambda: codec.decode(slots, codes))
    out["eager_b1_t1_latent_kernels"] = profile_kernels(lambda: codec._latent(slots, codes))
    # the same one-frame graph with the transformer on the official layers, on this machine
    official_layers = StreamingCodecDecoder(codec._decoder, 2, fused_transformer=False)
    with torch.cuda.stream(torch.cuda.Stream(engine.device)):
        graphed = GraphedCodecDecode(official_layers, 1, [1], [1], name="official-layer codec")
        graphed.capture(progress=False)
        official_layers.reset(0)
        out["graph_b1_t1_official_layers_ms"] = _median_ms(lambda: graphed.decode([0], codes), reps)
    return out


def _median_ms(call: Any, reps: int) -> float:
    """The median device time of `call()` on the current CUDA stream (events around each call)."""
    times = []
    for _ in range(reps):
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        done.record()
        done.synchronize()
        times.append(begin.elapsed_time(done))
    return statistics.median(times)


async def stage_medians(engine: Engine, voice: Voice, runs: int, label: str) -> dict[str, float]:
    """First audio's host stages, p50 over `runs` streams after 3 unmeasured ones (logged under `label`)."""
    for seed in range(3):
        await first_chunk(engine, voice, seed)
    measured = [await first_chunk(engine, voice, seed) for seed in range(3, 3 + runs)]
    stages = {k: statistics.median(r[k] for r in measured) for k in measured[0]}
    log(f"{label}: first audio stages p50 (ms) {json.dumps({k: round(v, 2) for k, v in stages.items()})}")
    return stages


async def stages_only(official: object, args: argparse.Namespace, **engine_kwargs: Any) -> dict[str, Any]:
    """First audio's host stages (p50 over `args.runs` streams) on an engine built with `engine_kwargs`."""
    engine = Engine(official, max_streams=args.max_streams, max_seq_len=512, **engine_kwargs)  # type: ignore[arg-type]
    engine.warmup(progress=False)
    stages = await stage_medians(engine, Voice(speaker=engine.speakers[0]), args.runs, str(engine_kwargs))
    engine.close()
    return {"engine": {k: str(v) for k, v in engine_kwargs.items()}, "stages_ms_p50": stages}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "models": {}}
    for model in args.model.split(","):
        log(f"loading {model}")
        official = load_official_model(model, device="cuda", dtype=torch.bfloat16, progress=False)
        if args.ab_first_audio_alone:
            report["models"][f"{model} first_audio_alone=False"] = await stages_only(official, args, first_audio_alone=False)
        engine = Engine(official, max_streams=args.max_streams, max_seq_len=512)  # type: ignore[arg-type]
        started = time.perf_counter()
        engine.warmup(progress=False)
        result: dict[str, Any] = {"warmup_s": time.perf_counter() - started}
        voice = Voice(speaker=engine.speakers[0])
        result["stages_ms_p50"] = await stage_medians(engine, voice, args.runs, model)
        result["host_timeline_ms_p50"] = await host_timeline(engine, voice, args.runs)
        for name, step in result["host_timeline_ms_p50"].items():
            log(f"  host {name:28s} {step['start_ms']:7.3f} -> {step['end_ms']:7.3f} ms ({step['calls']:g} calls)")
        layouts = []
        for seed in range(3):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                stages = await first_chunk(engine, voice, 100 + seed)
            layout = lane_layout(prof)
            layout["host_stages_ms"] = stages
            layouts.append(layout)
        result["profiled"] = layouts
        log(f"{model}: profiled first audio: {json.dumps(layouts[-1])}")
        result["codec_one_frame"] = codec_one_frame(engine)
        log(f"{model}: codec {json.dumps(result['codec_one_frame'])}")
        report["models"][model] = result
        engine.close()
        del engine, official
        torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="synthetic:0.6b-customvoice", help="comma-separated")
    parser.add_argument("--max-streams", type=int, default=4)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ab-first-audio-alone", action="store_true",
                        help="also measure the stages on an engine with Engine(first_audio_alone=False)")
    parser.add_argument("--out", type=Path, default=Path("first-audio.json"))
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(report, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
