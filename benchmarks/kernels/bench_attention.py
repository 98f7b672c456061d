"""Time the decode attention kernel's tilings (`decode_layer.AttentionTiles`) at the batched frame's shapes.

A 1.7B frame at 256 rows spends about half its time in `_attention_kernel` (benchmarks/results/2026-12-03-h200-d,
call 3): the talker's 28 launches over its whole cache, and the code predictor's 80 over at most 16 keys. This
times each tiling in the grid below for the talker's and the predictor's attention shapes (16 query heads, 8
key-value heads, head_dim 128), checks that it computes what the default tiling computes, and reports the
fastest per (stack, rows, keys) beside the one `attention_tiles` picks (`--chosen-only`: that one alone). Every row
sits at the last position (`--positions last`), or the rows spread evenly over the positions below it (`spread`: a
talker step under load, its rows at every point of their streams). One CUDA graph holds `--calls` launches
over distinct caches (as a frame's layers read distinct caches); the median replay over the calls is one
launch's time. Programmatic dependent launch is off: in a batched frame a cuBLAS product (which does not
trigger early) comes before every attention launch.

    python -m benchmarks.kernels.bench_attention --out attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.engine.bench_engine import log
from benchmarks.kernels.bench_kernels import time_stack
from qwen3tts_agent.kernels import common, decode_layer
from qwen3tts_agent.kernels.decode_layer import AttentionTiles

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
STACKS = {  # stack -> (keys attended per launch to time, masked by write position, grid of tilings)
    "talker": ((128, 256, 512), True, [
        AttentionTiles(block, per_program, warps, False)
        for block, per_program, warps in itertools.product((32, 64), (64, 128, 256), (4, 8))
    ]),
    "predictor": ((2, 9, 16), False, [
        AttentionTiles(block, decode_layer.KEYS_PER_PROGRAM, warps, early)
        for block, warps, early in itertools.product((16, 32), (1, 2, 4), (False, True))
    ]),
}


def _layer(device: torch.device, dtype: torch.dtype) -> SimpleNamespace:
    """What `_attention` reads of a layer: sizes, norms and scaling (random norm gains)."""
    return SimpleNamespace(
        head_dim=HEAD_DIM, q_size=HEADS * HEAD_DIM, kv_size=KV_HEADS * HEAD_DIM, eps=1e-6, scaling=HEAD_DIM**-0.5,
        q_norm=(1 + 0.1 * torch.randn(HEAD_DIM, device=device)).to(dtype),
        k_norm=(1 + 0.1 * torch.randn(HEAD_DIM, device=device)).to(dtype),
    )


def time_tiles(
    rows: int, read_len: int, masked: bool, grid: list[AttentionTiles], calls: int, replays: int, device: torch.device,
    spread: bool = False,
) -> list[dict[str, Any]]:
    """Each tiling's µs per launch over `calls` distinct caches, and its largest difference from the default's output.
    `spread`: the rows' positions spread evenly below `read_len` (else every row at its last position)."""
    dtype = torch.bfloat16
    layer = _layer(device, dtype)
    n = layer.q_size + 2 * layer.kv_size
    qkv = torch.randn(rows, n, device=device).to(dtype)
    positions = read_len + 1
    angles = torch.randn(positions, HEAD_DIM // 2, device=device)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    if spread:
        pos = torch.arange(rows, device=device, dtype=torch.int64) * read_len // rows
    else:
        pos = torch.full((rows,), read_len - 1, device=device, dtype=torch.int64)
    shape = (rows, KV_HEADS, positions, HEAD_DIM)
    caches = [(torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)) for _ in range(calls)]
    out = torch.empty(rows, layer.q_size, device=device, dtype=dtype)

    def launches(tiles: AttentionTiles | None) -> torch.Tensor:
        for k, v in caches:
            decode_layer._attention(layer, qkv, cos, sin, pos, k, v, out, read_len, masked, False, tiles)
        return out

    reference = launches(None).clone()
    default_us = 1e6 * time_stack(lambda: launches(None), device, replays) / calls
    results = []
    for tiles in grid:
        got = launches(tiles).clone()
        results.append({
            "tiles": tiles.__dict__, "us": 1e6 * time_stack(lambda t=tiles: launches(t), device, replays) / calls,
            "max_abs_diff": float((got.float() - reference.float()).abs().max()),
        })
    chosen = decode_layer.attention_tiles(rows, read_len, dtype)
    return [{"tiles": chosen.__dict__, "us": default_us, "max_abs_diff": 0.0, "chosen": True}, *results]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 192, 256])
    parser.add_argument("--stacks", nargs="+", choices=sorted(STACKS), default=sorted(STACKS))
    parser.add_argument("--calls", type=int, default=20, help="launches per CUDA graph")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--positions", choices=("last", "spread"), default="last",
                        help="every row at the last position, or the rows spread evenly below it")
    parser.add_argument("--chosen-only", action="store_true", help="time the tiling `attention_tiles` picks, no grid")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    common.PROGRAMMATIC_LAUNCH = False
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "positions": args.positions, "cases": []}
    for stack in args.stacks:
        read_lens, masked, grid = STACKS[stack]
        for rows, read_len in itertools.product(args.rows, read_lens):
            results = time_tiles(rows, read_len, masked, [] if args.chosen_only else grid, args.calls, args.replays,
                                 device, spread=args.positions == "spread")
            best = min(results, key=lambda r: r["us"])
            report["cases"].append({"stack": stack, "rows": rows, "read_len": read_len, "results": results, "best": best})
            log(f"{stack:9s} rows={rows:3d} keys={read_len:3d}: chosen {results[0]['us']:6.1f} us, best {best['us']:6.1f} us "
                f"{best['tiles']} (diff {best['max_abs_diff']:.3g})")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
