"""Time the sampling kernel at a frame's shapes, per warp count, inside CUDA graphs (H200 tuning aid).

Modes: "top-k" (the official defaults: top-k 50, top-p 1.0), "top-p" (the same with top-p 0.9), "greedy".
A frame samples 15 predictor codes (bf16 logits over 2048 codes, top-k cap 64) and one talker token (3072
codes, with the repetition penalty, so fp32 scores). One graph holds 15 launches one after another; the
median replay over 15 is one sampling's latency. This times `fused_sample` alone; inside a frame the
warp count matters more (`kernels.frame.TALKER_CODE0_WARPS`, measured with benchmarks/engine/frame_timeline.py).

    python -m benchmarks.kernels.bench_sampling --out sampling.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.kernels.bench_kernels import log, time_stack
from qwen3tts_agent.kernels import sampling as sampling_kernel

LAUNCHES = 15


def rows(b: int, mode: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The official defaults (temperature 0.9, top-k 50, top-p 1.0), the same with top-p 0.9, or greedy rows."""
    return {
        "do_sample": torch.full((b,), mode != "greedy", device=device),
        "temperature": torch.full((b,), 0.9, device=device),
        "top_k": torch.full((b,), 50, device=device, dtype=torch.int64),
        "top_p": torch.full((b,), 0.9 if mode == "top-p" else 1.0, device=device),
        "seed": torch.arange(b, device=device) + 7,
        "counter": torch.arange(b, device=device),
    }


def time_case(vocab: int, talker: bool, b: int, mode: str, warps: int, device: torch.device) -> float:
    dtype = torch.float32 if talker else torch.bfloat16
    scores = torch.randn(b, vocab, device=device).to(dtype)
    out = torch.empty(b, device=device, dtype=torch.int64)
    extra = {}
    if talker:
        extra = {
            "seen": torch.rand(b, vocab, device=device) < 0.05, "penalty": torch.full((b,), 1.05, device=device),
            "suppress": torch.zeros(vocab, device=device, dtype=torch.bool), "eos_id": vocab - 1,
            "eos_blocked": torch.zeros(b, device=device, dtype=torch.bool),
        }
    params = rows(b, mode, device)
    saved = sampling_kernel.sampling_warps
    sampling_kernel.sampling_warps = lambda _vocab: warps
    try:
        def launches() -> torch.Tensor:
            for _ in range(LAUNCHES):
                sampling_kernel.fused_sample(scores, **params, cap=64, out=out, **extra)
            return out

        return time_stack(launches, device, 100) / LAUNCHES
    finally:
        sampling_kernel.sampling_warps = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for name, vocab, talker in (("predictor", 2048, False), ("talker", 3072, True)):
        for b in args.batches:
            for mode in ("top-k", "top-p", "greedy"):
                default = sampling_kernel.sampling_warps(vocab)
                for warps in args.warps:
                    us = 1e6 * time_case(vocab, talker, b, mode, warps, device)
                    results.append({"case": name, "b": b, "mode": mode, "warps": warps, "us": us, "default": warps == default})
                    log(f"{name} b={b} {mode:6s} warps={warps:2d}: {us:6.2f} us{' (default)' if warps == default else ''}")
    if args.out:
        args.out.write_text(json.dumps({"launches_per_graph": LAUNCHES, "results": results}, indent=1))


if __name__ == "__main__":
    main()
