"""Sweep the tile shapes of the decode GEMV (`kernels.gemv.gemv`) over the products of a Qwen3-TTS frame, on CUDA.

A decode product moves megabytes of weights for a few rows; how fast that goes depends on how many bytes each
program keeps in flight and how many programs fill the GPU, which no formula predicts well. For every product
shape of the 0.6B and 1.7B models (with its fused norm, SwiGLU or residual) and a few batch sizes this times
each candidate `GemvTiles` and the PyTorch expression it replaces, each as a CUDA graph of back-to-back
launches over distinct weight copies (so the weights stream from HBM, as in a frame, and launch gaps count),
and prints the best tiles as this GPU's entry of `qwen3tts_agent/kernels/configs/gemv_tiles.json` (keyed by
the name torch reports for the GPU). Compilation runs in worker processes first (Triton caches it on disk),
then the timing runs in this one.

    python -m benchmarks.kernels.sweep_gemv --out gemv-sweep.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_kernels import time_stack
from qwen3tts_agent.kernels import common as kernel_common
from qwen3tts_agent.kernels import gemv
from qwen3tts_agent.kernels.gemv import GemvTiles

# (name, n_out, k_dim, flavour): the products of one decode layer, and the predictor's heads
SHAPES = [
    ("qkv-1024", 4096, 1024, "norm"),
    ("gate_up-1024", 3072, 1024, "gated"),
    ("o-1024", 1024, 2048, "residual"),
    ("down-1024", 1024, 3072, "residual"),
    ("head-1024", 2048, 1024, "norm"),
    ("qkv-2048", 4096, 2048, "norm"),
    ("gate_up-2048", 6144, 2048, "gated"),
    ("o-2048", 2048, 2048, "residual"),
    ("down-2048", 2048, 6144, "residual"),
]
BATCHES = (1, 16, 64)
L2_DEFEAT_BYTES = 256 << 20  # weight copies per graph: more than the L2 cache holds


def candidates(rows: int) -> list[GemvTiles]:
    if rows > 16:
        return [
            GemvTiles(block_n=n, block_k=k, programs_per_sm=p, num_warps=w)
            for n, k, p, w in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (4, 8))
            if not (w == 8 and n * k < 16384)  # 8 warps only for tiles with that much work
        ]
    # a few rows: tiles of 8K-32K weights for 4 warps, 16K-64K for 8, and a deeper pipeline as an option
    return [
        GemvTiles(block_n=n, block_k=k, programs_per_sm=p, num_warps=w, num_stages=s)
        for n, k, p, w, s in itertools.product((32, 64, 128), (256, 512, 1024), (1, 2, 4, 8, 16), (4, 8), (3, 4))
        if 4096 * w // 2 <= n * k <= 8192 * w
    ]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_operands(n_out: int, k_dim: int, flavour: str, rows: int, copies: int) -> dict[str, Any]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    gated = flavour == "gated"
    weights = [torch.randn((2 if gated else 1) * n_out, k_dim, device=dev, dtype=dt) / k_dim**0.5 for _ in range(copies)]
    return {
        "x": torch.randn(rows, k_dim, device=dev, dtype=dt),
        "g": 1 + 0.1 * torch.randn(k_dim, device=dev, dtype=dt),
        "res": torch.randn(rows, n_out, device=dev, dtype=dt),
        "weights": weights,
        "outs": [torch.empty(rows, n_out, device=dev, dtype=dt) for _ in range(copies)],
        "flavour": flavour,
    }


def run_triton(ops: dict[str, Any], tiles: GemvTiles, copies: int | None = None) -> None:
    flavour = ops["flavour"]
    for w, out in list(zip(ops["weights"], ops["outs"], strict=True))[:copies]:
        if flavour == "residual":
            gemv.gemv(ops["x"], w, out, residual=ops["res"], tiles=tiles)
        else:
            gemv.gemv(ops["x"], w, out, norm=ops["g"], eps=1e-6, gated=flavour == "gated", tiles=tiles)


def run_torch(ops: dict[str, Any]) -> None:
    x, flavour = ops["x"], ops["flavour"]
    for w, out in zip(ops["weights"], ops["outs"], strict=True):
        if flavour == "residual":
            out.copy_(ops["res"] + F.linear(x, w))
        else:
            y = F.linear(F.rms_norm(x, (x.shape[-1],), ops["g"], 1e-6), w)
            if flavour == "gated":
                gate, up = y.chunk(2, dim=-1)
                y = F.silu(gate) * up
            out.copy_(y)


def graph_time(fn: Any, launches: int, replays: int = 15) -> float:
    """Median microseconds per launch of a CUDA graph holding `launches` launches of `fn`."""
    return 1e6 * time_stack(fn, torch.device("cuda"), replays) / launches


Job = tuple[int, int, str, int, list[GemvTiles]]


def _compile(job: Job) -> list[GemvTiles]:
    """Worker: run each tile shape once so that Triton compiles it into the on-disk cache; returns the
    tiles that cannot run (too much shared memory, say)."""
    n_out, k_dim, flavour, rows, tiles_list = job
    ops = make_operands(n_out, k_dim, flavour, rows, 1)
    failed = []
    for tiles in tiles_list:
        try:
            run_triton(ops, tiles, copies=1)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - any tile that fails to compile or launch is left out of the sweep
            failed.append(tiles)
    return failed


def _set_pdl(on: bool | None) -> None:
    kernel_common.PROGRAMMATIC_LAUNCH = on


def precompile(jobs: list[Job], workers: int) -> set[tuple[int, int, str, int, GemvTiles]]:
    """Compile every job's tiles in worker processes; returns the (n, k, flavour, rows, tiles) that failed."""
    started = time.perf_counter()
    total, done, failed = sum(len(j[-1]) for j in jobs), 0, set()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_set_pdl, initargs=(kernel_common.PROGRAMMATIC_LAUNCH,)
    ) as pool:
        for job, bad in zip(jobs, pool.map(_compile, jobs), strict=True):
            done += len(job[-1])
            failed |= {(*job[:4], tiles) for tiles in bad}
            log(f"compiled {done}/{total} kernels, {len(failed)} unusable ({time.perf_counter() - started:.0f} s)")
    return failed


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    parser.add_argument("--workers", type=int, default=12, help="compile processes")
    parser.add_argument("--budget-s", type=float, default=420, help="stop timing new cases after this long")
    parser.add_argument("--no-pdl", dest="pdl", action="store_false",
                        help="no programmatic dependent launch (kernels.common.PROGRAMMATIC_LAUNCH)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    import triton

    kernel_common.PROGRAMMATIC_LAUNCH = None if args.pdl else False  # and in the compile workers (`_set_pdl`)
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    jobs = [(n, k, f, b, candidates(b)) for _, n, k, f in shapes for b in args.batches]
    log(f"{len(jobs)} cases, {sum(len(j[-1]) for j in jobs)} kernels to compile with {args.workers} workers")
    failed = precompile(jobs, args.workers)

    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count, "pdl": args.pdl, "cases": [],
    }
    for (name, n_out, k_dim, flavour), rows in itertools.product(shapes, args.batches):
        if time.perf_counter() - started > args.budget_s:
            log(f"time budget spent: skipping {name} b={rows}")
            continue
        weight_bytes = (2 if flavour == "gated" else 1) * n_out * k_dim * 2
        copies = max(4, math.ceil(L2_DEFEAT_BYTES / weight_bytes))
        ops = make_operands(n_out, k_dim, flavour, rows, copies)
        torch_us = graph_time(lambda ops=ops: run_torch(ops), copies)
        timed = []
        for tiles in candidates(rows):
            if (n_out, k_dim, flavour, rows, tiles) in failed:
                continue
            us = graph_time(lambda ops=ops, tiles=tiles: run_triton(ops, tiles), copies)
            timed.append({**tiles.__dict__, "us": us})
        timed.sort(key=lambda t: t["us"])
        best = timed[0]
        default_us = next(
            (t["us"] for t in timed if GemvTiles(**{k: v for k, v in t.items() if k != "us"}) == gemv.DEFAULT_TILES),
            None,
        )
        current = gemv.gemv_tiles(flavour, n_out, k_dim, rows, report["device"])
        current_us = next((t["us"] for t in timed if GemvTiles(**{k: v for k, v in t.items() if k != "us"}) == current), None)
        case = {
            "shape": name, "n_out": n_out, "k_dim": k_dim, "flavour": flavour, "rows": rows,
            "weight_mb": weight_bytes / 1e6, "torch_us": torch_us, "default_us": default_us, "current_us": current_us,
            "best": best,
            "best_tb_per_s": weight_bytes / best["us"] / 1e6, "top": timed[:8],
        }
        report["cases"].append(case)
        log(f"{name:13} b={rows:3d}: torch {torch_us:6.1f} us  default {default_us or float('nan'):6.1f} us  "
            f"current {current_us or float('nan'):6.1f} us  best "
            f"{best['us']:6.1f} us ({case['best_tb_per_s']:.2f} TB/s) {GemvTiles(**{k: v for k, v in best.items() if k != 'us'})}")
        del ops
        torch.cuda.empty_cache()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    table = {
        gemv.tile_key(c["flavour"], c["n_out"], c["k_dim"], c["rows"]): {k: v for k, v in c["best"].items() if k != "us"}
        for c in report["cases"]
    }
    print('\nthis GPU\'s entry under "devices" in qwen3tts_agent/kernels/configs/gemv_tiles.json:')
    print(json.dumps({report["device"]: table}, indent=2))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
