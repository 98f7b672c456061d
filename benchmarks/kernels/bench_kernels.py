"""Check and time the Triton decode-layer kernels against the PyTorch `FusedDecoderLayer` path.

On CUDA: builds official decoder layers with random weights at the real shapes (0.6B talker, code predictor,
1.7B talker), checks the Triton path against the PyTorch path in bf16 and fp32 (output and KV cache), then
times both inside CUDA graphs: one graph holds a whole stack of layer calls (28 talker layers; 15 steps x 5
predictor layers), distinct weights per layer so that they stream from HBM as in a real frame, and the median
of many replays is reported. Writes a JSON report.

    python -m benchmarks.kernels.bench_kernels --out kernels.json
    python -m benchmarks.kernels.bench_kernels --smoke     # CPU, TRITON_INTERPRET=1, tiny shapes, no timing claims
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Model:
    """A stack of decode-layer calls as one frame runs it."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int  # distinct layers
    calls: int  # layer calls per frame (the predictor cycles its 5 layers 15 times)
    talker: bool  # talker: mask by write position; predictor: mask=None
    read_lens: tuple[int, ...]


MODELS = {
    "talker-0.6b": Model("talker-0.6b", 1024, 16, 8, 128, 3072, 28, 28, True, (128, 512)),
    "predictor": Model("predictor", 1024, 16, 8, 128, 3072, 5, 75, False, (16, 128, 512)),
    "talker-1.7b": Model("talker-1.7b", 2048, 16, 8, 128, 6144, 28, 28, True, (128, 512)),
}
TINY = [Model("tiny-talker", 48, 6, 2, 16, 80, 3, 6, True, (37,)), Model("tiny-predictor", 48, 6, 2, 16, 80, 2, 4, False, (5,))]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # max |error| / max |reference|


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_layers(model: Model, count: int, dtype: torch.dtype, device: torch.device) -> list[Any]:
    """Official decoder layers (talker or predictor class) with random weights and norm gains."""
    from qwen3tts_agent.engine.runner.layers import FusedDecoderLayer
    from qwen3tts_agent.models.compat import import_qwen_tts

    import_qwen_tts()
    from qwen_tts.core.models import configuration_qwen3_tts as conf
    from qwen_tts.core.models import modeling_qwen3_tts as modeling

    config_cls, layer_cls = (
        (conf.Qwen3TTSTalkerConfig, modeling.Qwen3TTSTalkerDecoderLayer) if model.talker
        else (conf.Qwen3TTSTalkerCodePredictorConfig, modeling.Qwen3TTSDecoderLayer)
    )
    config = config_cls(
        hidden_size=model.hidden, intermediate_size=model.ffn, num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads, head_dim=model.head_dim, num_hidden_layers=1,
    )
    layers = []
    with torch.device(device), torch.no_grad():
        for _ in range(count):
            layer = layer_cls(config, 0).to(dtype).eval()
            for p in layer.parameters():
                if p.dim() == 1:
                    p.copy_(1 + 0.3 * torch.randn_like(p))
            layers.append(FusedDecoderLayer(layer))
    return layers


@dataclass
class Step:
    """Inputs of one decode step for rows 0..b-1, over caches with max_len + 1 columns."""

    x: torch.Tensor
    rows: torch.Tensor  # arange(b)[:, None]: row r uses cache slot r
    cos: torch.Tensor  # RoPE tables [max_len + 1, head_dim], row p for position p
    sin: torch.Tensor
    write_pos: torch.Tensor
    mask: torch.Tensor | None
    read_len: int


def make_step(model: Model, b: int, read_len: int, max_len: int, dtype: torch.dtype, device: torch.device) -> Step:
    """Row 0 writes the last key it reads, the others somewhere before, and with b > 1 the last row is inactive."""
    from qwen3tts_agent.engine.runner.layers import rope_tables

    write_pos = torch.randint(0, read_len, (b, 1), device=device)
    write_pos[0] = read_len - 1
    if b > 1 and model.talker:
        write_pos[-1] = max_len
    if not model.talker:  # the predictor writes at read_len - 1 and attends everything below read_len
        write_pos.fill_(read_len - 1)
    d = model.head_dim
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
    cos, sin = rope_tables(inv_freq, torch.arange(max_len + 1, device=device), dtype)  # rows by position
    mask = (torch.arange(read_len, device=device) <= write_pos).view(b, 1, 1, read_len) if model.talker else None
    x = torch.randn(b, 1, model.hidden, device=device).to(dtype)
    return Step(x, torch.arange(b, device=device).unsqueeze(1), cos, sin, write_pos, mask, read_len)


def torch_layer(layer: Any, x: torch.Tensor, step: Step, ck: torch.Tensor, cv: torch.Tensor) -> torch.Tensor:
    return layer(x, step.cos[step.write_pos], step.sin[step.write_pos], ck, cv, step.rows, step.write_pos, slice(0, x.shape[0]), step.read_len, step.mask)


def triton_layer(layer: Any, x: torch.Tensor, step: Step, ck: torch.Tensor, cv: torch.Tensor) -> torch.Tensor:
    from qwen3tts_agent.kernels.decode_layer import decode_layer

    return decode_layer(layer, x, step.cos, step.sin, ck, cv, step.write_pos, step.read_len, masked=step.mask is not None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@torch.inference_mode()
def check(model: Model, dtype: torch.dtype, device: torch.device, batches: tuple[int, ...]) -> list[dict[str, Any]]:
    """Triton vs PyTorch on one layer: output and the written cache columns, everything else untouched."""
    layer = build_layers(model, 1, dtype, device)[0]
    max_len = max(model.read_lens)
    results = []
    for b in batches:
        for read_len in model.read_lens:
            step = make_step(model, b, read_len, max_len, dtype, device)
            ck = torch.randn(b + 1, model.kv_heads, max_len + 1, model.head_dim, device=device).to(dtype)
            cv = torch.randn_like(ck)
            ref_k, ref_v, out_k, out_v = ck.clone(), cv.clone(), ck.clone(), cv.clone()
            ref = torch_layer(layer, step.x, step, ref_k, ref_v)
            out = triton_layer(layer, step.x, step, out_k, out_v)
            written = torch.zeros_like(ck, dtype=torch.bool)
            written[torch.arange(b, device=device), :, step.write_pos[:, 0]] = True
            errors = {
                "out": rel_err(out, ref), "k": rel_err(out_k[written], ref_k[written]),
                "v": rel_err(out_v[written], ref_v[written]),
            }
            untouched = bool(torch.equal(out_k[~written], ck[~written]) and torch.equal(out_v[~written], cv[~written]))
            ok = untouched and max(errors.values()) <= TOLERANCE[dtype]
            results.append({"model": model.name, "dtype": str(dtype).removeprefix("torch."), "b": b,
                            "read_len": read_len, **errors, "untouched": untouched, "ok": ok})
            log(f"check {model.name} {results[-1]['dtype']} b={b} len={read_len}: out {errors['out']:.1e} "
                f"k {errors['k']:.1e} v {errors['v']:.1e} untouched={untouched} -> {'ok' if ok else 'FAIL'}")
    return results


def run_stack(
    layer_fn: Callable[..., torch.Tensor], layers: list[Any], caches: list[tuple[torch.Tensor, torch.Tensor]],
    step: Step, calls: int,
) -> torch.Tensor:
    """One frame's layer calls, cycling through the distinct layers and their caches."""
    x = step.x
    for i in range(calls):
        k, v = caches[i % len(layers)]
        x = layer_fn(layers[i % len(layers)], x, step, k, v)
    return x


def time_stack(fn: Callable[[], torch.Tensor], device: torch.device, replays: int) -> float:
    """Median seconds per call of `fn`: replays of its CUDA graph on CUDA, eager calls elsewhere."""
    if device.type != "cuda":
        times = []
        for _ in range(replays):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: triton compilation, counters, cuBLAS workspaces
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1000


@torch.inference_mode()
def bench(model: Model, dtype: torch.dtype, device: torch.device, batches: tuple[int, ...], replays: int) -> list[dict[str, Any]]:
    """Per (b, read_len): one frame's stack of layer calls, PyTorch vs Triton, each as one CUDA graph."""
    log(f"building {model.layers} {model.name} layers ({dtype})")
    layers = build_layers(model, model.layers, dtype, device)
    max_len, slots = max(model.read_lens), max(batches)
    shape = (slots, model.kv_heads, max_len + 1, model.head_dim)
    caches = [(torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)) for _ in layers]
    rows = []
    for b in batches:
        for read_len in model.read_lens:
            step = make_step(model, b, read_len, max_len, dtype, device)
            result = {"model": model.name, "dtype": str(dtype).removeprefix("torch."), "b": b, "read_len": read_len,
                      "calls": model.calls}
            for name, layer_fn in (("torch", torch_layer), ("triton", triton_layer)):
                stack = functools.partial(run_stack, layer_fn, layers, caches, step, model.calls)
                result[f"{name}_us"] = 1e6 * time_stack(stack, device, replays)
            result["speedup"] = result["torch_us"] / result["triton_us"]
            rows.append(result)
            log(f"time {model.name} b={b:2d} len={read_len:4d}: torch {result['torch_us']:8.1f} us  triton "
                f"{result['triton_us']:8.1f} us  ({result['speedup']:.2f}x, {result['triton_us'] / model.calls:.1f} us/layer)")
    del layers, caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes, correctness only")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["talker-0.6b", "predictor"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--no-fp32-timing", action="store_true", help="time bf16 only (fp32 is still checked)")
    parser.add_argument("--no-pdl", dest="pdl", action="store_false",
                        help="no programmatic dependent launch for the Triton kernels (kernels.common.PROGRAMMATIC_LAUNCH)")
    args = parser.parse_args()

    if args.smoke:  # before anything imports triton: the kernels are decorated for the interpreter then
        os.environ["TRITON_INTERPRET"] = "1"
        device, models, batches, replays = torch.device("cpu"), TINY, (1, 3), 2
    elif not torch.cuda.is_available():
        parser.error("needs CUDA (or --smoke)")
    else:
        device, models, batches, replays = torch.device("cuda"), [MODELS[m] for m in args.models], tuple(args.batches), args.replays
    import triton

    from qwen3tts_agent.kernels import common as kernel_common

    if not kernel_common.available(device):
        parser.error(f"the Triton kernels are not available on {device}")
    kernel_common.PROGRAMMATIC_LAUNCH = None if args.pdl else False
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke, "pdl": args.pdl,
        "checks": [], "timings": [],
    }
    timing_dtypes = [torch.bfloat16] if args.no_fp32_timing else [torch.bfloat16, torch.float32]
    for model in models:
        for dtype in (torch.bfloat16, torch.float32):
            log(f"checking {model.name} {dtype}")
            report["checks"] += check(model, dtype, device, batches)
        for dtype in timing_dtypes:
            report["timings"] += bench(model, dtype, device, batches, replays)

    print(f"\n{'model':14} {'dtype':9} {'b':>3} {'len':>5} {'torch us':>10} {'triton us':>10} {'speedup':>8}")
    for r in report["timings"]:
        print(f"{r['model']:14} {r['dtype']:9} {r['b']:3d} {r['read_len']:5d} {r['torch_us']:10.1f} "
              f"{r['triton_us']:10.1f} {r['speedup']:7.2f}x")
    failed = [c for c in report["checks"] if not c["ok"]]
    print(f"\nchecks: {len(report['checks']) - len(failed)}/{len(report['checks'])} ok")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        log(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
