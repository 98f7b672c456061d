"""Benchmark qwen3tts-agent: single-stream latency, frame cost, concurrency, Poisson load and cancel latency.

Fixed-length generation (`ignore_eos`), ICL voice clone with a cached 3 s reference, the same text for every
stream. Latencies are measured where a caller sees them: from just before `open_stream` to the first chunk
arriving in an asyncio consumer. Writes a JSON report and prints a summary.

    python -m benchmarks.engine.bench_engine --model synthetic:0.6b --out results.json
    python -m benchmarks.engine.bench_engine --model synthetic:tiny --device cpu --quick   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.kernels.bench_kernels import time_stack
from qwen3tts_agent import Engine, EngineStats, SamplingParams, Voice
from qwen3tts_agent.engine.types import DEFAULT_CHUNK_SCHEDULE
from qwen3tts_agent.kernels import common as kernel_common
from qwen3tts_agent.reference import demo_reference

BENCH_TEXT = (
    "Thanks for calling. I can help you change your booking today; could you tell me the reference "
    "number and the name it was made under, please? Thank you."
)
REF_TEXT = "This is a short reference recording of my voice."


@dataclass
class StreamTiming:
    submitted: float
    first: float = 0.0
    end: float = 0.0
    audio_s: float = 0.0
    worst_lag: float = 0.0  # max over chunks of arrival - (first arrival + audio played before it)
    stages_ms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # first chunk: see STAGES

    @property
    def first_audio_ms(self) -> float:
        return 1000 * (self.first - self.submitted)

    @property
    def rtf(self) -> float:
        return self.audio_s / (self.end - self.submitted)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def run_stream(engine: Engine, voice: Voice, frames: int, seed: int) -> StreamTiming:
    timing = StreamTiming(submitted=time.perf_counter())
    stream = engine.open_stream(BENCH_TEXT, voice=voice, language="english",
                                sampling=SamplingParams(seed=seed, max_frames=frames, ignore_eos=True))
    played = 0.0
    async for chunk in stream:
        now = time.perf_counter()
        if not timing.first:
            timing.first = now
            t = chunk.timings
            timing.stages_ms = tuple(1000 * d for d in (
                t.prefill_done - t.submitted, t.first_frame - t.prefill_done, t.ready - t.first_frame, now - t.ready))
        timing.worst_lag = max(timing.worst_lag, now - (timing.first + played))
        played += chunk.duration
    timing.end = time.perf_counter()
    timing.audio_s = played
    assert stream.result.frames == frames, (stream.result.frames, frames)
    return timing


STAGES = ("admission_and_prefill", "first_frame", "codec_decode", "delivery")


def summarize(timings: list[StreamTiming], wall: float) -> dict[str, object]:
    first = [t.first_audio_ms for t in timings]
    rtfs = [t.rtf for t in timings]
    return {
        # where the first audio's time goes (ms): submit -> prompt prefilled -> first frame's codes on the
        # host -> its PCM decoded -> the consumer holds it
        "first_audio_stages_ms": {
            stage: {q: pct([t.stages_ms[i] for t in timings], int(q[1:])) for q in ("p50", "p95")}
            for i, stage in enumerate(STAGES)
        },
        "streams": len(timings),
        "first_audio_ms_p50": pct(first, 50),
        "first_audio_ms_p95": pct(first, 95),
        "per_stream_rtf_min": min(rtfs),
        "per_stream_rtf_p50": pct(rtfs, 50),
        "streams_slower_than_real_time": sum(r < 1.0 for r in rtfs),
        "streams_with_playback_stall": sum(t.worst_lag > 0.005 for t in timings),
        "aggregate_audio_s_per_s": sum(t.audio_s for t in timings) / wall,
        "wall_s": wall,
    }


async def concurrency(engine: Engine, voice: Voice, n: int, frames: int) -> dict[str, object]:
    before = engine.stats()
    started = time.perf_counter()
    timings = await asyncio.gather(*(run_stream(engine, voice, frames, seed=i) for i in range(n)))
    return {**summarize(list(timings), time.perf_counter() - started), "engine_loop": loop_profile(before, engine.stats())}


async def closed_loop(engine: Engine, voice: Voice, n: int, window_s: float, frames: int) -> dict[str, object]:
    """n clients, each opening a new stream as soon as its last one ends: the engine holds n streams throughout.

    This is "the first audio at a load of n streams". The clients start spread over the first quarter of the
    window and only streams submitted after it are reported, so the figures are the steady state's.
    """
    started = time.perf_counter()
    settle = window_s / 4
    timings: list[StreamTiming] = []
    settled: list[EngineStats] = []

    async def client(i: int) -> None:
        await asyncio.sleep(settle * i / n)
        k = 0
        while time.perf_counter() - started < window_s:
            if not settled and time.perf_counter() - started >= settle:
                settled.append(engine.stats())
            timings.append(await run_stream(engine, voice, frames, seed=1_000_000 + i * 1000 + k))
            k += 1

    await asyncio.gather(*(client(i) for i in range(n)))
    steady = [t for t in timings if t.submitted - started >= settle]
    if not steady:
        raise RuntimeError(f"no stream started after the first {settle:.1f} s: lengthen --closed-window")
    result: dict[str, object] = {**summarize(steady, time.perf_counter() - started - settle), "clients": n}
    result["engine_loop"] = loop_profile(settled[0], engine.stats())
    return result


def loop_profile(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """The engine loop between two stats: steps, mean batch, and ms per step in each part of the loop."""
    steps = max(1, after.steps - before.steps)
    profile = {"steps": after.steps - before.steps, "mean_batch": (after.frames_generated - before.frames_generated) / steps}
    for phase, seconds in after.loop_seconds.items():
        profile[f"{phase}_ms_per_step"] = 1000 * (seconds - before.loop_seconds[phase]) / steps
    return profile


async def poisson(engine: Engine, voice: Voice, rate: float, window_s: float, frames: int, seed: int = 0) -> dict[str, object]:
    rng = random.Random(seed)
    before = engine.stats()
    tasks = []
    started = time.perf_counter()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > window_s:
            break
        delay = started + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_stream(engine, voice, frames, seed=len(tasks))))
    timings = await asyncio.gather(*tasks)
    result: dict[str, object] = {**summarize(list(timings), time.perf_counter() - started), "rate_per_s": rate}
    result["engine_loop"] = loop_profile(before, engine.stats())
    return result


async def cancel_latency(engine: Engine, voice: Voice, background: int, trials: int) -> dict[str, float]:
    """cancel() -> the engine thread has dropped the request, with `background` other streams running."""
    sampling = SamplingParams(max_frames=100_000 // 80, ignore_eos=True)
    others = [engine.open_stream(BENCH_TEXT, voice=voice, sampling=sampling) for _ in range(background)]
    latencies, frames_after = [], []
    for i in range(trials):
        stream = engine.open_stream(BENCH_TEXT, voice=voice, sampling=SamplingParams(seed=i, max_frames=2000, ignore_eos=True))
        async for chunk in stream:
            if chunk.frame_end >= 4:
                break
        latencies.append(1000 * await stream.acancel())
        frames_after.append(0 if not [c async for c in stream] else 1)
    for other in others:
        await other.acancel()
    return {"background_streams": background, "cancel_ms_p50": pct(latencies, 50), "cancel_ms_p95": pct(latencies, 95),
            "cancel_ms_max": max(latencies), "chunks_after_cancel": sum(frames_after)}


def graph_frame_ms(engine: Engine, sizes: list[int], kv_len: int, reps: int) -> dict[str, dict[str, float]]:
    """GPU time of one whole-frame graph replay, and of its two halves, per batch bucket (events, median).

    With the Triton layer kernels on, the same graphs are also timed on the PyTorch layer path (`*_torch_ms`).
    """
    runner = engine.core.runner
    fused = runner.fused_talker and runner.fused_predictor
    out: dict[str, dict[str, float]] = {}
    saved_active = runner.active.clone()
    runner.active.zero_()  # every row inactive: the same work, but no slot's state moves
    for b in sizes:
        row = {}
        for kernels_on in (True, False) if fused else (False,):
            runner.fused_talker = runner.fused_predictor = kernels_on
            suffix = "_ms" if kernels_on == fused else "_torch_ms"
            for name, fn in {
                "frame": lambda b=b: runner.frame_step(b, kv_len),
                "predictor_15_steps": lambda b=b: runner.predict_codes(b),
                "talker_step": lambda b=b: runner.talker_step(b, kv_len),
            }.items():
                with torch.inference_mode():
                    row[name + suffix] = 1000 * time_stack(fn, engine.device, reps)
        runner.fused_talker = runner.fused_predictor = fused
        out[str(b)] = row
        log(f"  graph batch {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    runner.active.copy_(saved_active)
    return out


KERNEL_KINDS = (  # substrings of kernel names, first match wins
    ("matmul", ("gemm", "gemv", "cutlass", "sm90_", "nvjet", "cublas", "splitk")),
    ("attention", ("flash", "attention", "fmha", "softmax")),
    ("sampling and top-k", ("_sample_kernel", "_code_kernel", "_code0_kernel", "topk", "sort", "radix", "argmax", "cumsum", "scan", "gather", "scatter")),
    ("norm and reductions", ("norm", "reduce")),
    ("indexing and copies", ("index", "copy", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_breakdown(engine: Engine, kv_len: int, batch: int = 1) -> dict[str, object]:
    """Every kernel of one eager frame: count and GPU time, by kind and by name.

    The graph replays the same kernels; the gap between their summed time and the replay's wall time is the
    per-kernel launch and dependency cost that only fusion removes. Rows are inactive (no slot moves).
    """
    runner = engine.core.runner
    saved_active = runner.active.clone()
    runner.active.zero_()
    breakdown = profile_kernels(lambda: runner.frame_step(batch, kv_len))
    runner.active.copy_(saved_active)
    return breakdown


def profile_kernels(fn: Callable[[], object], top: int = 15, ops: bool = False) -> dict[str, object]:
    """The kernels of one call of `fn` after a warm-up call (torch.profiler), by kind and by name; with `ops`,
    also the PyTorch ops that launched the most GPU time, by input shapes (which conv is slow, say)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        with profile(activities=activities, record_shapes=ops) as prof:
            fn()
            torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    by_kind: dict[str, list[float]] = {}
    for e in kernels:
        name = e.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")
        count_us = by_kind.setdefault(kind, [0, 0.0])
        count_us[0] += e.count
        count_us[1] += e.self_device_time_total
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    report: dict[str, object] = {
        "kernels_per_frame": sum(e.count for e in kernels),
        "kernel_time_ms": sum(e.self_device_time_total for e in kernels) / 1000,
        "by_kind": {k: {"kernels": c, "ms": us / 1000} for k, (c, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "top_kernels": [{"name": e.key[:100], "count": e.count, "ms": e.self_device_time_total / 1000} for e in ranked],
    }
    if ops:
        launched = [e for e in prof.key_averages(group_by_input_shape=True) if e.device_type == DeviceType.CPU]
        report["top_ops"] = [
            {"op": e.key, "shapes": str(e.input_shapes)[:200], "count": e.count, "ms": e.self_device_time_total / 1000}
            for e in sorted(launched, key=lambda e: -e.self_device_time_total)[:top]
        ]
    return report


def codec_call(engine: Engine, batch: int, frames: int, graphed: bool) -> Callable[[], object]:
    """One streaming-codec call on fresh slots (eager, or graph replays)."""
    codec = engine.core.audio.codec
    decode = engine.core.audio._graphs.decode if graphed else codec.decode
    codes = torch.randint(0, 2048, (batch, frames, 16), device=engine.device)
    slots = list(range(batch))
    for s in slots:
        codec.reset(s)
    return lambda: decode(slots, codes)


def codec_ms(engine: Engine, batch: int, frames: int, reps: int, graphed: bool) -> float:
    """Wall time of one streaming-codec call (eager, or a graph replay), host launch included."""
    call = codec_call(engine, batch, frames, graphed)
    call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - started) / reps


async def prefix_cache_ab(official: object, args: argparse.Namespace) -> dict[str, object]:
    """One stream at a time on a one-slot engine, with the voice-prefix cache off, on, and on with the staged
    prefill: first audio of the voices that have a text-independent prompt head worth caching (x-vector and
    ICL clones on Base models, a named speaker on CustomVoice ones). Each voice speaks once unmeasured first
    (which fills the cache)."""
    results: dict[str, object] = {}
    for mode, cached, staged in (("off", False, False), ("on", True, False), ("staged", True, True)):
        engine = Engine(official, max_streams=1, max_seq_len=args.max_seq_len, overlap_codec=args.overlap_codec,  # type: ignore[arg-type]
                        fused_kernels=args.fused_kernels, chunk_schedule=args.chunk_schedule, prefix_cache=cached,
                        staged_prefill=staged)
        engine.warmup(progress=False)
        if engine.model_type == "base":
            reference = demo_reference()
            voices = {"xvector": Voice(prompt=engine.create_voice(reference, None, x_vector_only=True)),
                      "icl": Voice(prompt=engine.create_voice(reference, REF_TEXT))}
        else:
            voices = {"speaker": Voice(speaker=engine.speakers[0])}
        for name, voice in voices.items():
            await run_stream(engine, voice, args.frames, seed=0)
            singles = [await run_stream(engine, voice, args.frames, seed=i) for i in range(1, args.runs + 1)]
            key = f"{name}_prefix_cache_{mode}"
            results[key] = summarize(singles, sum(t.end - t.submitted for t in singles))
            log(f"{key}: first audio p50 {results[key]['first_audio_ms_p50']:.2f} ms, "  # type: ignore[index]
                f"p95 {results[key]['first_audio_ms_p95']:.2f} ms")  # type: ignore[index]
        engine.close()
    return results


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    from qwen3tts_agent.models.loading import load_official_model

    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype)
    log(f"loading {args.model} on {args.device} ({args.dtype})")
    official = load_official_model(args.model, device=args.device, dtype=dtype, progress=True)
    if cuda:
        torch.cuda.synchronize()
    weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    report: dict[str, object] = {
        "model": args.model, "dtype": args.dtype, "device": torch.cuda.get_device_name() if cuda else platform.processor(),
        "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "frames_per_stream": args.frames, "chunk_schedule": args.chunk_schedule, "overlap_codec": args.overlap_codec, "text_chars": len(BENCH_TEXT), "reference_s": 3.0, "weights_gib": weights_gib,
        "switch_interval_ms": 1000 * sys.getswitchinterval(), "pdl": kernel_common.programmatic_launch(torch.device(args.device)),
    }
    reference = demo_reference()
    if args.prefix_ab:
        report["runs_per_voice"] = args.runs
        report["prefix_cache_ab"] = await prefix_cache_ab(official, args)
        return report

    if not args.load_only:
        # --- single stream, on an engine with one slot (its memory is what one stream costs)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        engine = Engine(official, max_streams=1, max_seq_len=args.max_seq_len, overlap_codec=args.overlap_codec,
                        fused_kernels=args.fused_kernels, chunk_schedule=args.chunk_schedule)
        engine.warmup(progress=False)
        voice = Voice(prompt=engine.create_voice(reference, REF_TEXT))
        await run_stream(engine, voice, args.frames, seed=0)  # warm-up run
        before = engine.stats()
        singles = [await run_stream(engine, voice, args.frames, seed=i) for i in range(1, args.runs + 1)]
        steady_ms = [1000 * (t.end - t.first) / (args.frames - 1) for t in singles]
        report["single_stream"] = {
            **summarize(singles, sum(t.end - t.submitted for t in singles)),
            "loop_ms_per_frame_p50": pct(steady_ms, 50),
            "engine_loop": loop_profile(before, engine.stats()),
            "peak_gpu_gib_one_stream": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        }
        log(f"single stream: {report['single_stream']}")
        if cuda:
            report["kernel_paths"] = dict(engine.core.runner.kernel_paths)
            report["graph_replay"] = graph_frame_ms(engine, [1], kv_len=min(256, args.max_seq_len), reps=50)
            runner = engine.core.runner
            fused = runner.fused_talker and runner.fused_predictor
            report["kernel_breakdown_b1"] = {}
            for kernels_on in (True, False) if fused else (False,):
                runner.fused_talker = runner.fused_predictor = kernels_on
                name = "triton_layers" if kernels_on else "torch_layers"
                report["kernel_breakdown_b1"][name] = kernel_breakdown(engine, kv_len=min(256, args.max_seq_len))
                log(f"kernels of one frame, {name}: {json.dumps(report['kernel_breakdown_b1'][name])}")
            runner.fused_talker = runner.fused_predictor = fused
        engine.close()
        del engine

    if args.single_only:
        return report
    # --- many streams on one engine
    engine = Engine(official, max_streams=args.max_streams, max_seq_len=args.max_seq_len, overlap_codec=args.overlap_codec,
                    fused_kernels=args.fused_kernels, chunk_schedule=args.chunk_schedule)
    started = time.perf_counter()
    engine.warmup(progress=True)
    report["warmup_s"] = time.perf_counter() - started
    voice = Voice(prompt=engine.create_voice(reference, REF_TEXT))
    if cuda:
        report["graph_replay_batched"] = graph_frame_ms(
            engine, [b for b in (4, 16, 32, 64, 128, 256) if b <= args.max_streams], kv_len=min(256, args.max_seq_len), reps=20
        )
        report["codec_decode_ms"] = {
            f"{mode}_batch{b}_frames{f}": codec_ms(engine, b, f, 10, graphed=mode == "graphed")
            for mode in ("eager", "graphed") for b in (1, 32, 256) for f in (1, 8) if b <= args.max_streams
        }
        # cuDNN's own algorithm search for the codec's convolutions (the engine leaves it off)
        with torch.backends.cudnn.flags(enabled=True, benchmark=True):
            report["codec_decode_ms"].update({
                f"eager_cudnn_benchmark_batch{b}_frames{f}": codec_ms(engine, b, f, 10, graphed=False)
                for b, f in ((32, 8), (256, 1), (256, 8)) if b <= args.max_streams
            })
        log(f"codec: {report['codec_decode_ms']}")
        b = min(32, args.max_streams)
        report["kernel_breakdown_codec"] = profile_kernels(codec_call(engine, b, 8, graphed=False), ops=True)
        log(f"kernels of one codec call, {b} streams x 8 frames: {json.dumps(report['kernel_breakdown_codec'])}")
        report["kernel_breakdown_batched"] = kernel_breakdown(engine, kv_len=min(256, args.max_seq_len), batch=args.max_streams)
        log(f"kernels of one frame at batch {args.max_streams}: {json.dumps(report['kernel_breakdown_batched'])}")
    report["concurrency"] = {}
    for n in args.concurrency:
        if n > args.max_streams:
            continue
        result = await concurrency(engine, voice, n, args.frames)
        report["concurrency"][str(n)] = result  # type: ignore[index]
        log(f"concurrency {n}: {result}")
    report["poisson"] = []
    for rate in args.rates:
        result = await poisson(engine, voice, rate, args.window, args.frames)
        report["poisson"].append(result)  # type: ignore[union-attr]
        log(f"poisson {rate}/s: {result}")
    report["closed_loop"] = []
    for n in args.closed_loop:
        if n > args.max_streams:
            continue
        result = await closed_loop(engine, voice, n, args.closed_window, args.frames)
        report["closed_loop"].append(result)  # type: ignore[union-attr]
        log(f"closed loop, {n} streams: {result}")
    report["cancel"] = [await cancel_latency(engine, voice, bg, args.cancel_trials) for bg in args.cancel_background]
    log(f"cancel: {report['cancel']}")
    report["engine_stats"] = engine.stats().__dict__
    engine.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:0.6b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--frames", type=int, default=100, help="fixed frames per stream (100 = 8 s)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-streams", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[4, 8, 16, 24, 32])
    parser.add_argument("--window", type=float, default=8.0, help="Poisson arrival window, seconds")
    parser.add_argument("--closed-window", type=float, default=8.0, help="closed-loop window, seconds")
    parser.add_argument("--closed-loop", type=lambda s: [int(x) for x in s.split(",") if x], default=[64, 128, 256],
                        help="hold this many streams at once (a new one as each ends) and time first audio")
    parser.add_argument("--cancel-trials", type=int, default=10)
    parser.add_argument("--cancel-background", type=lambda s: [int(x) for x in s.split(",")], default=[0, 32])
    parser.add_argument("--chunk-schedule", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_CHUNK_SCHEDULE),
                        help="frames per audio chunk, in order; the last repeats")
    parser.add_argument("--single-only", action="store_true")
    parser.add_argument("--prefix-ab", action="store_true",
                        help="only one stream at a time, voice-prefix cache off then on (x-vector, ICL or a speaker)")
    parser.add_argument("--load-only", action="store_true", help="skip the single-stream part")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="sys.setswitchinterval for this process (Python's default is 5 ms): how long the engine "
                             "thread can wait for the GIL while the asyncio consumers hold it")
    parser.add_argument("--no-overlap-codec", dest="overlap_codec", action="store_false",
                        help="decode audio on the frame steps' CUDA stream")
    parser.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_false",
                        help="PyTorch layers instead of the Triton decode kernels")
    parser.add_argument("--no-pdl", dest="pdl", action="store_false",
                        help="no programmatic dependent launch for the Triton kernels (kernels.common.PROGRAMMATIC_LAUNCH)")
    parser.add_argument("--smoke", action="store_true", help="a short GPU run that exercises every path")
    parser.add_argument("--quick", action="store_true", help="tiny settings for a CPU smoke test")
    parser.add_argument("--out", type=Path, default=Path("bench_engine.json"))
    args = parser.parse_args()
    kernel_common.PROGRAMMATIC_LAUNCH = None if args.pdl else False
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.smoke:
        args.frames, args.runs, args.max_streams = 30, 2, 8
        args.concurrency, args.rates, args.cancel_trials, args.cancel_background = [8], [], 2, [2]
        args.closed_loop = []
    if args.quick:
        args.frames, args.runs, args.max_streams, args.max_seq_len = 12, 2, 4, 256
        args.concurrency, args.rates, args.window, args.cancel_trials, args.cancel_background = [1, 4], [2.0], 1.5, 2, [0, 2]
        args.closed_loop, args.closed_window = [2], 20.0
        args.dtype = "float32"
    report = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
