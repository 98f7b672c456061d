"""CPU benchmark: the int8 CPU backend beside today's PyTorch CPU path, in one run, on the same cores.

Same text, 3 s reference, ICL voice clone and frame count as benchmarks/engine/bench_engine.py (fixed-length
generation, `ignore_eos`). Per backend: the frame step alone (ms per frame, batch 1 and 4), one stream
through the Engine (first audio, real-time factor, ms per frame; greedy and default sampling), 4 concurrent
streams (each one's real-time factor), peak memory. Also: the memory bandwidth of the machine and the bytes
a frame must read (the floor, for 8- and 4-bit weights), per-op micro benchmarks of the candidate runtimes
(`--micro`), and the int8 backend's (and the opt-in int4's, when among `--backends`) code agreement and audio
difference against the fp32 CPU backend (random weights cannot judge quality: this only says how far the
quantized weights move the numbers).

    python benchmarks/cpu/bench_cpu.py --model synthetic:0.6b --threads 2 --out bench_cpu.json
    python benchmarks/cpu/bench_cpu.py --model synthetic:tiny --quick          # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.engine.bench_engine import (
    BENCH_TEXT,
    REF_TEXT,
    concurrency,
    log,
    loop_profile,
    pct,
    run_stream,
    summarize,
)
from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.engine.types import DEFAULT_CHUNK_SCHEDULE
from qwen3tts_agent.reference import demo_reference


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(fn, reps: int, warmup: int = 1) -> list[float]:
    """Wall ms of each of `reps` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - started))
    return out


def median_ms(fn, reps: int) -> float:
    return statistics.median(timed(fn, reps))


# ----------------------------------------------------------------- the floor
def memory_bandwidth(gib: float = 1.0) -> dict[str, float]:
    """Streaming read (a sum) and copy of a large fp32 tensor: GB/s, the best of 5."""
    a = torch.ones(int(gib * 2**30 / 4))
    b = torch.empty_like(a)
    read = min(timed(lambda: a.sum(), 5)) / 1000
    copy = min(timed(lambda: b.copy_(a), 5)) / 1000
    return {"read_gb_s": a.numel() * 4 / read / 1e9, "copy_gb_s": 2 * a.numel() * 4 / copy / 1e9}


def frame_bytes(model: torch.nn.Module, bytes_per_weight: float) -> dict[str, float]:
    """Weight bytes one batch-1 frame reads: the talker's layers once, the predictor's 15 times, the heads."""
    talker = model.talker
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    predictor = talker.code_predictor
    talker_layers = count(talker.model.layers)
    predictor_layers = count(predictor.model.layers) + count(predictor.small_to_mtp_projection)
    heads = count(predictor.lm_head) + count(talker.codec_head)
    total = bytes_per_weight * (talker_layers + 15 * predictor_layers + heads)
    return {"talker_layers_params": talker_layers, "predictor_layers_params": predictor_layers,
            "heads_params": heads, "bytes_per_weight": bytes_per_weight, "frame_gb": total / 1e9}


# ----------------------------------------------------------------- per-op candidates
def micro_benchmarks(
    hidden: int, ffn: int, q_size: int, kv_size: int, layers: int, threads: int, compile_too: bool = False
) -> dict[str, object]:
    """One talker step's projections (M = 1) for `layers` layers with each candidate runtime: ms and GB/s."""
    shapes = [(q_size + 2 * kv_size, hidden), (hidden, q_size), (2 * ffn, hidden), (hidden, ffn)]
    params = layers * sum(n * k for n, k in shapes)
    weights = [[torch.randn(n, k) * 0.02 for n, k in shapes] for _ in range(layers)]
    xs = {k: torch.randn(1, k) for _, k in shapes}
    out: dict[str, object] = {"layers": layers, "params": params}

    def record(name: str, ms: float, bytes_per_weight: float) -> None:
        out[name] = {"ms": ms, "gb_s": params * bytes_per_weight / ms / 1e6}
        log(f"  micro {name}: {ms:.2f} ms ({params * bytes_per_weight / ms / 1e6:.1f} GB/s)")

    record("torch_fp32_linear", median_ms(lambda: [F.linear(xs[w.shape[1]], w) for ws in weights for w in ws], 5), 4)
    bf16 = [[w.bfloat16() for w in ws] for ws in weights]
    xb = {k: v.bfloat16() for k, v in xs.items()}
    record("torch_bf16_linear", median_ms(lambda: [F.linear(xb[w.shape[1]], w) for ws in bf16 for w in ws], 5), 2)
    packed = []
    for ws in weights:
        for w in ws:
            scale = w.abs().amax(1) / 127
            packed.append((torch.round(w / scale[:, None]).to(torch.int8), scale))
    for dtype in (torch.bfloat16, torch.float32):
        xd = {k: v.to(dtype) for k, v in xs.items()}
        pk = [(q, s.to(dtype)) for q, s in packed]
        record(f"torch_weight_int8pack_mm_{str(dtype)[6:]}",
               median_ms(lambda xd=xd, pk=pk: [torch.ops.aten._weight_int8pack_mm(xd[q.shape[1]], q, s) for q, s in pk], 3), 1)
    try:
        out.update(_ort_micro(weights, xs, threads, record))
    except ImportError as exc:
        out["onnxruntime"] = f"not run: {exc}"
    if compile_too:
        _compile_micro(packed, xs, record)
    return out


def _compile_micro(packed, xs, record) -> None:
    """torch.compile (inductor, CPU codegen) of the same projections with int8 weight-only GEMMs: the
    dequantize-then-linear pattern that inductor lowers to its weight-only-quantized matmul."""

    def projections(xb: dict[int, torch.Tensor], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return [F.linear(xb[q.shape[1]], q.to(torch.bfloat16)) * s for q, s in layers]

    xb = {k: v.bfloat16() for k, v in xs.items()}
    layers = [(q, s.bfloat16()) for q, s in packed]
    compiled = torch.compile(projections, dynamic=False)
    started = time.perf_counter()
    compiled(xb, layers)
    log(f"  torch.compile took {time.perf_counter() - started:.1f} s")
    record("torch_compile_int8_weight_only_bf16", median_ms(lambda: compiled(xb, layers), 5), 1)


def _ort_micro(weights, xs, threads: int, record) -> dict[str, object]:
    import tempfile

    import onnx
    from onnx import TensorProto, helper

    from qwen3tts_agent.backends.cpu.graphs import GraphBuilder, onnx_model
    from qwen3tts_agent.backends.cpu.session import BoundSession

    for fmt, bytes_per_weight in (("int8", 1.03), ("fp32", 4)):
        g = GraphBuilder(fmt)
        outputs = []
        for ws in weights:
            for w in ws:
                y = g.linear(f"x{w.shape[1]}", w)
                outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, w.shape[0]]))
        inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in xs]
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "micro.onnx"
            onnx.save(onnx_model(helper.make_graph(g.nodes, "micro", inputs, outputs, g.initializers)), str(path),
                      save_as_external_data=True, location="micro.data")
            session = BoundSession(path, threads)
            feeds = {f"x{k}": v.numpy() for k, v in xs.items()}
            name = "ort_matmulnbits_int8" if fmt == "int8" else "ort_matmul_fp32"
            record(name, median_ms(lambda session=session, feeds=feeds: session.session.run(None, feeds), 5), bytes_per_weight)
            del session
    return {}


# ----------------------------------------------------------------- the frame step alone
def frame_step_ms(engine: Engine, batch: int, kv_len: int, reps: int) -> dict[str, float]:
    """ms of `runner.frame_step` and of its predictor half, every row inactive (same work, no state moves)."""
    runner = engine.core.runner
    saved = runner.active.clone()
    runner.active.zero_()
    with torch.inference_mode():
        frame = timed(lambda: runner.frame_step(batch, kv_len), reps)
        predictor = timed(lambda: runner.predict_codes(batch), reps)
    runner.active.copy_(saved)
    return {"frame_ms_p50": statistics.median(frame), "frame_ms_min": min(frame),
            "predictor_ms_p50": statistics.median(predictor), "codec_1_frame_ms_p50": codec_ms(engine, batch, 1, reps),
            "codec_8_frames_ms_p50": codec_ms(engine, batch, 8, max(2, reps // 2))}


def codec_ms(engine: Engine, batch: int, frames: int, reps: int) -> float:
    codec = engine.core.audio.codec
    codes = torch.randint(0, 2048, (batch, frames, 16))
    slots = list(range(batch))
    for slot in slots:
        codec.reset(slot)
    return median_ms(lambda: codec.decode(slots, codes), reps)


def state_bytes_per_stream(engine: Engine) -> float:
    """Bytes of per-slot state (KV caches, slot tables, text track, codec state) per stream slot."""
    runner, codec = engine.core.runner, engine.core.audio.codec
    tensors = [*runner.k_cache, *runner.v_cache, *runner.pk_cache, *runner.pv_cache, runner.text_embeds, runner.seen]
    total = sum(t.numel() * t.element_size() for t in tensors) / runner.max_slots
    codec_total = sum(h.buffer.numel() * h.buffer.element_size() for h in codec._histories()) / codec.max_streams
    return total + codec_total


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ----------------------------------------------------------------- agreement of int8 (or int4) with fp32
def agreement(official: object, frames: int, reference: tuple[np.ndarray, int], quantized: str = "int8") -> dict[str, object]:
    """The same greedy request on the fp32 and a quantized CPU backend: codes and audio side by side."""
    results = {}
    for backend in ("fp32", quantized):
        engine = Engine(official, max_streams=1, keep_codes=True, backend=backend)
        voice = Voice(prompt=engine.create_voice(reference, REF_TEXT))
        pcm, result = engine.synthesize_blocking(BENCH_TEXT, voice=voice, language="english",
                                                 sampling=SamplingParams.greedy(max_frames=frames, ignore_eos=True))
        results[backend] = (np.asarray(result.codes), pcm)
        engine.close()
    (codes32, pcm32), (codes8, pcm8) = results["fp32"], results[quantized]
    # the codec alone: the fp32 run's codes through the quantized backend's codec and through the fp32 one
    from qwen3tts_agent.backends import create_codec

    decoder = official.model.speech_tokenizer.model.decoder  # type: ignore[attr-defined]
    codec_audio = {}
    for backend in ("fp32", quantized):
        codec = create_codec(decoder, backend, max_streams=1)
        codec_audio[backend] = codec.decode([0], torch.as_tensor(codes32)[None]).float()[0].numpy()
    codec_noise = codec_audio[quantized] - codec_audio["fp32"]
    same = codes32 == codes8
    diverged = np.nonzero(~same.all(axis=1))[0]
    noise = pcm8 - pcm32
    return {
        "frames": frames,
        "codes_equal_fraction": float(same.mean()),
        "codebook0_equal_fraction": float(same[:, 0].mean()),
        "first_frame_that_differs": int(diverged[0]) if len(diverged) else None,
        "frames_equal_before_divergence": int(diverged[0]) if len(diverged) else frames,
        "audio_max_abs_diff": float(np.abs(noise).max()),
        "audio_rms_fp32": float(np.sqrt(np.mean(pcm32**2))),
        "audio_rms_diff": float(np.sqrt(np.mean(noise**2))),
        "codec_only_dtype": str(codec.dtype),
        "codec_only_rms_diff": float(np.sqrt(np.mean(codec_noise**2))),
        "codec_only_max_abs_diff": float(np.abs(codec_noise).max()),
        "note": f"random weights: agreement says how far {quantized} moves the numbers, not whether speech is better or worse",
    }


# ----------------------------------------------------------------- codec beside the frame steps
def overlap_estimate(model: torch.nn.Module, frames: int, threads: int) -> dict[str, float]:
    """What a pipelined engine loop could reach on these cores: frame steps on one thread, the codec on another.

    The batch-1 frame step is bound by memory bandwidth, which one core nearly saturates, while the codec is
    bound by arithmetic. Today's engine runs both on its one thread, one after the other, each with all the
    cores. Here they run at once, the frame steps with `threads - 1` ONNX Runtime threads (at least 1) and the
    codec (8-frame chunks) with the rest: ms per frame = wall time / frames.
    """
    import threading

    from qwen3tts_agent.backends import create_codec, create_runner

    step_threads = max(1, threads // 2)
    runner = create_runner(model, "int8", max_slots=1, max_seq_len=512, max_text_tokens=512, threads=step_threads)
    codec = create_codec(model.speech_tokenizer.model.decoder, "int8", max_streams=1)
    runner.active.zero_()
    codes = torch.randint(0, 2048, (1, 8, 16))

    def steps() -> None:
        with torch.inference_mode():
            for _ in range(frames):
                runner.frame_step(1, 256)

    def decodes() -> None:
        torch.set_num_threads(max(1, threads - step_threads))
        for _ in range(frames // 8):
            codec.decode([0], codes)

    steps(), decodes()  # warm-up
    torch.set_num_threads(threads)
    alone_steps = 1000 * _wall(steps) / frames
    alone_codec = 1000 * _wall(decodes) / frames
    torch.set_num_threads(threads)
    pair = [threading.Thread(target=steps), threading.Thread(target=decodes)]
    started = time.perf_counter()
    for t in pair:
        t.start()
    for t in pair:
        t.join()
    overlapped = 1000 * (time.perf_counter() - started) / frames
    torch.set_num_threads(threads)
    return {"step_threads": step_threads, "codec_threads": max(1, threads - step_threads),
            "frame_step_ms_alone": alone_steps, "codec_ms_per_frame_alone": alone_codec,
            "overlapped_ms_per_frame": overlapped, "load_average": load_average()}


def _wall(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ----------------------------------------------------------------- the peer
def ggml_peer() -> dict[str, str]:
    """faster-qwen3-tts's GGML backend needs the `qwentts-cpp-python` native runtime."""
    try:
        import qwentts_cpp  # noqa: F401
    except ImportError as exc:
        return {"status": "not run", "reason": (
            f"{exc}. faster-qwen3-tts 0.5.4's GGML backend imports qwentts_cpp (PyPI qwentts-cpp-python 0.5.0), "
            "which is published only as a macOS arm64 wheel: no Linux wheel and no sdist. See docs/cpu-backend.md.")}
    return {"status": "qwentts_cpp importable; converting a synthetic checkpoint to GGUF is not automated here"}


# ----------------------------------------------------------------- the engine
async def engine_runs(official: object, backend: str, args: argparse.Namespace, reference) -> dict[str, object]:
    report: dict[str, object] = {"backend": backend}
    started = time.perf_counter()
    engine = Engine(official, max_streams=1, max_seq_len=args.max_seq_len, backend=backend, overlap_codec=args.overlap_codec,
                    chunk_schedule=args.chunk_schedule)
    report["engine_ready_s"] = time.perf_counter() - started
    engine.warmup(progress=False)
    voice = Voice(prompt=engine.create_voice(reference, REF_TEXT))
    report["state_mb_per_stream"] = state_bytes_per_stream(engine) / 1e6
    report["frame_step"] = {str(b): None for b in (1,)}
    report["frame_step"]["1"] = frame_step_ms(engine, 1, min(256, args.max_seq_len), args.frame_reps)
    log(f"{backend}: frame step b=1 {report['frame_step']['1']}  (load {load_average()})")
    spare = getattr(engine.core.runner, "spare_cores", None)  # the CPU backends': graph calls on the codec's cores
    for mode in ("greedy", "default"):
        before = engine.stats()
        lent_before = (spare.lent, spare.calls) if spare is not None else (0, 0)
        timings = []
        for i in range(args.runs + 1):
            sampling = (SamplingParams.greedy(seed=i, max_frames=args.frames, ignore_eos=True) if mode == "greedy"
                        else SamplingParams(seed=i, max_frames=args.frames, ignore_eos=True))
            timings.append(await _one(engine, voice, sampling))
        timings = timings[1:]  # the first is a warm-up
        steady = [1000 * (t.end - t.first) / (args.frames - 1) for t in timings]
        report[f"single_stream_{mode}"] = {**summarize(timings, sum(t.end - t.submitted for t in timings)),
                                           "ms_per_frame_p50": pct(steady, 50), "load_average": load_average(),
                                           "engine_loop": loop_profile(before, engine.stats()),
                                           "graph_calls_on_codec_cores": _lent_share(spare, lent_before)}
        log(f"{backend} single stream ({mode}): first audio p50 {report[f'single_stream_{mode}']['first_audio_ms_p50']:.0f} ms, "
            f"RTF p50 {report[f'single_stream_{mode}']['per_stream_rtf_p50']:.2f}, {pct(steady, 50):.1f} ms/frame (load {load_average()})")
    engine.close()
    report["peak_rss_gib_after_single"] = peak_rss_gib()
    if args.concurrent:
        engine = Engine(official, max_streams=args.concurrent, max_seq_len=args.max_seq_len, backend=backend,
                        overlap_codec=args.overlap_codec, chunk_schedule=args.chunk_schedule)
        engine.warmup(progress=False)
        voice = Voice(prompt=engine.create_voice(reference, REF_TEXT))
        report["frame_step"][str(args.concurrent)] = frame_step_ms(engine, args.concurrent, min(256, args.max_seq_len),
                                                                    max(2, args.frame_reps // 2))
        result = await concurrency(engine, voice, args.concurrent, args.frames)
        result["load_average"] = load_average()
        report[f"concurrent_{args.concurrent}"] = result
        log(f"{backend} {args.concurrent} concurrent: per-stream RTF min {result['per_stream_rtf_min']:.2f}, "
            f"first audio p50 {result['first_audio_ms_p50']:.0f} ms (load {load_average()})")
        engine.close()
    report["peak_rss_gib"] = peak_rss_gib()
    return report


def _lent_share(spare: object, before: tuple[int, int]) -> float | None:
    """The share of the graph calls since `before` that ran on the codec's idle cores too (None: none lent)."""
    if spare is None:
        return None
    calls = spare.calls - before[1]  # type: ignore[attr-defined]
    return (spare.lent - before[0]) / calls if calls else 0.0  # type: ignore[attr-defined]


async def _one(engine: Engine, voice: Voice, sampling: SamplingParams):
    stream_sampling = sampling
    from benchmarks.engine import bench_engine

    # run_stream builds its own default-sampling request; greedy needs the same loop with our sampling
    if sampling.do_sample:
        return await run_stream(engine, voice, sampling.max_frames, seed=sampling.seed or 0)
    timing = bench_engine.StreamTiming(submitted=time.perf_counter())
    stream = engine.open_stream(BENCH_TEXT, voice=voice, language="english", sampling=stream_sampling)
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
    return timing


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    from qwen3tts_agent.models.loading import load_official_model

    torch.set_num_threads(args.threads)
    report: dict[str, object] = {
        "model": args.model, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "frames_per_stream": args.frames, "text_chars": len(BENCH_TEXT),
        "reference_s": 3.0, "load_average_start": load_average(), "overlap_codec": args.overlap_codec,
        "chunk_schedule": list(args.chunk_schedule), "pool": args.pool,
        "spin": os.environ.get("QWEN3TTS_CPU_SPIN", "0") == "1",
    }
    try:
        import onnxruntime

        report["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    report["memory_bandwidth"] = memory_bandwidth()
    log(f"memory bandwidth {report['memory_bandwidth']} (load {load_average()})")
    official = load_official_model(args.model, device="cpu", dtype=torch.float32, progress=True)
    model = official.model
    report["frame_bytes_int8"] = frame_bytes(model, 1 + 4 / 128)  # 8-bit weights + one fp32 scale per 128
    report["frame_bytes_int4"] = frame_bytes(model, 0.5 + 4 / 128)
    report["frame_bytes_fp32"] = frame_bytes(model, 4)
    for fmt in ("int8", "int4"):
        floor_ms = 1000 * report[f"frame_bytes_{fmt}"]["frame_gb"] / report["memory_bandwidth"]["read_gb_s"]
        report[f"{fmt}_frame_floor_ms"] = floor_ms
        log(f"{fmt} frame reads {report[f'frame_bytes_{fmt}']['frame_gb']:.2f} GB: floor {floor_ms:.1f} ms at the "
            "measured read bandwidth")
    if args.micro:
        cfg = model.config.talker_config
        layer = model.talker.model.layers[0]
        report["micro"] = micro_benchmarks(cfg.hidden_size, cfg.intermediate_size, layer.self_attn.q_proj.out_features,
                                           layer.self_attn.k_proj.out_features, cfg.num_hidden_layers, args.threads,
                                           compile_too=args.compile)
    reference = demo_reference()
    report["backends"] = {}
    for backend in args.backends:
        report["backends"][backend] = await engine_runs(official, backend, args, reference)
    names = list(report["backends"])
    if "int8" in names and "torch" in names:
        fast, slow = report["backends"]["int8"], report["backends"]["torch"]
        report["speedup_frame_step_b1"] = slow["frame_step"]["1"]["frame_ms_p50"] / fast["frame_step"]["1"]["frame_ms_p50"]
        report["speedup_ms_per_frame_single_stream"] = (
            slow["single_stream_default"]["ms_per_frame_p50"] / fast["single_stream_default"]["ms_per_frame_p50"])
        log(f"int8 vs torch: frame step {report['speedup_frame_step_b1']:.1f}x, "
            f"engine ms/frame {report['speedup_ms_per_frame_single_stream']:.1f}x")
    if args.agreement:
        for quantized in [b for b in args.backends if b in ("int8", "int4")] or ["int8"]:
            report[f"{quantized}_vs_fp32"] = agreement(official, args.frames, reference, quantized)
            log(f"{quantized} vs fp32: {report[f'{quantized}_vs_fp32']}")
    if args.overlap:
        report["overlap"] = overlap_estimate(model, 48, args.threads)
        log(f"frame steps and codec on separate threads: {report['overlap']}")
    report["ggml_peer"] = ggml_peer()
    report["load_average_end"] = load_average()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:0.6b")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--backends", type=lambda s: [b for b in s.split(",") if b], default=["int8", "torch"],
                        help="engines to run, side by side (empty: none)")
    parser.add_argument("--frames", type=int, default=100, help="fixed frames per stream (100 = 8 s)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--frame-reps", type=int, default=10)
    parser.add_argument("--concurrent", type=int, default=4, help="streams at once (0: skip)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--micro", action="store_true", help="per-op micro benchmarks of the candidate runtimes")
    parser.add_argument("--compile", action="store_true", help="with --micro: also torch.compile (slow to compile)")
    parser.add_argument("--agreement", action="store_true",
                        help="int8 (and int4, if among --backends) against fp32: codes and audio")
    parser.add_argument("--overlap", action="store_true", help="frame steps and codec on two threads at once")
    parser.add_argument("--no-overlap-codec", dest="overlap_codec", action="store_false",
                        help="the engine's codec on its loop's thread, after each step (default: a thread of its own)")
    parser.add_argument("--chunk-schedule", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEFAULT_CHUNK_SCHEDULE,
                        help="frames per chunk, the last repeated (the engine's default: 1,2,4,8)")
    parser.add_argument("--pool", choices=["session", "shared"], default=os.environ.get("QWEN3TTS_CPU_POOL", "session"),
                        help="ONNX Runtime threads: a pool per graph (an in-process engine's default) or the "
                             "process's one shared pool (the engine-core process's)")
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    parser.add_argument("--out", type=Path, default=Path("bench_cpu.json"))
    args = parser.parse_args()
    os.environ["QWEN3TTS_CPU_POOL"] = args.pool  # read by every CpuRunner this run builds
    if args.quick:
        args.frames, args.runs, args.frame_reps, args.concurrent = 12, 1, 3, 2
    report = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
