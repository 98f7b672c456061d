"""`gemv.gemv` against the PyTorch expressions it replaces, over flavours, shapes, tile splits and dtypes."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
import torch.nn.functional as F

from qwen3tts_agent.kernels import common, gemv

# max |error| / max |reference|. The interpreter truncates fp32 -> bf16 casts (a GPU rounds to nearest even),
# so its bf16 errors run about twice those on a GPU.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SPLIT_TILES = {"block_n": 16, "block_k": 32, "programs_per_sm": 8}

# (name, rows, n_out, k_dim, flavour, dtype, tiles): flavours as the decode layer and the heads use them
CASES = [
    ("norm-b1", 1, 40, 48, "norm", torch.float32, None),
    ("norm-b5-split", 5, 40, 200, "norm", torch.float32, SPLIT_TILES),
    ("gated-b3", 3, 24, 48, "gated", torch.float32, None),
    ("gated-b9-split", 9, 24, 200, "gated", torch.bfloat16, SPLIT_TILES),
    ("residual-b2-split", 2, 48, 80, "residual", torch.float32, {"block_n": 16, "block_k": 16, "programs_per_sm": 8}),
    ("residual-b40", 40, 48, 80, "residual", torch.bfloat16, None),
    ("norm-b70-split", 70, 40, 96, "norm", torch.float32, {"block_n": 32, "block_k": 32, "programs_per_sm": 4}),
    ("gated-b130", 130, 24, 48, "gated", torch.float32, {"block_n": 16, "block_k": 16, "programs_per_sm": 1}),
    # odd widths: an odd head_dim-like width of 120 (5 x 24) and 3 x 40 query rows
    ("norm-odd-b2", 2, 168, 120, "norm", torch.float32, None),
    ("residual-odd-b3-split", 3, 120, 120, "residual", torch.bfloat16, SPLIT_TILES),
    # the 1.7B talker-to-predictor projection: a biased Linear, one rounding after the bias
    ("bias-b2", 2, 40, 96, "bias", torch.bfloat16, None),
    ("bias-b3-split", 3, 40, 96, "bias", torch.float32, {"block_n": 16, "block_k": 16, "programs_per_sm": 8}),
]


def _run(device: str, rows: int, n_out: int, k_dim: int, flavour: str, dtype: torch.dtype, tiles: dict | None) -> tuple[float, gemv.GemvTiles]:
    """The kernel's max relative error against PyTorch, and the tiles it ran with."""
    gen = torch.Generator().manual_seed(rows * 7 + n_out)
    gated = flavour == "gated"
    x = (2 * torch.randn(rows, 2 * k_dim, generator=gen)).to(device, dtype)[:, :k_dim]  # row stride other than k_dim
    w = (torch.randn((2 if gated else 1) * n_out, k_dim, generator=gen) / k_dim**0.5).to(device, dtype)
    g = (1 + 0.3 * torch.randn(k_dim, generator=gen)).to(device, dtype)
    res = torch.randn(rows, n_out, generator=gen).to(device, dtype)
    out = torch.empty(rows, n_out, device=device, dtype=dtype)
    chosen = gemv.GemvTiles(**tiles) if tiles else None
    if flavour == "residual":
        ref = res + F.linear(x, w)
        gemv.gemv(x, w, out, residual=res, tiles=chosen)
    elif flavour == "bias":
        bias = res[0].contiguous()
        ref = F.linear(x, w, bias)
        gemv.gemv(x, w, out, bias=bias, tiles=chosen)
    else:
        ref = F.linear(F.rms_norm(x, (k_dim,), g, 1e-6), w)
        if gated:
            gate, up = ref.split(n_out, dim=-1)
            ref = F.silu(gate) * up
        gemv.gemv(x, w, out, norm=g, eps=1e-6, gated=gated, tiles=chosen)
    used = chosen or gemv.gemv_tiles(flavour, n_out, k_dim, rows, common.device_name(x.device))
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max()), used


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gemv_matches_torch(device: str, case: tuple) -> None:
    _, rows, n_out, k_dim, flavour, dtype, tiles = case
    err, _ = _run(device, rows, n_out, k_dim, flavour, dtype, tiles)
    assert err <= TOLERANCE[dtype]
    assert bool((common.counters(torch.device(device)) == 0).all()), "every launch must leave its arrival counters zeroed"


def test_cases_cover_splits_and_row_tiles() -> None:
    """The grid above reaches both the single-split and the split-K paths, one and several row tiles."""
    grids = [
        gemv.gemv_grid(n, k, rows, dtype, gemv.GemvTiles(**tiles) if tiles else gemv.DEFAULT_TILES, torch.device("cpu"))
        for _, rows, n, k, _, dtype, tiles in CASES
    ]
    assert {g["SPLITS"] > 1 for g in grids} == {True, False}
    assert {g["ROW_TILES"] > 1 for g in grids} == {True, False}


def test_tile_table_is_data_keyed_by_gpu_name() -> None:
    """The shipped table has the H200's tiles; another GPU, or a product not swept, gets the default."""
    shipped = json.loads(resources.files("qwen3tts_agent.kernels").joinpath("configs/gemv_tiles.json").read_text())
    h200 = shipped["devices"]["NVIDIA H200"]
    key, tiles = next(iter(h200.items()))
    flavour, n_out, k_dim, bucket = key.split("/")
    found = gemv.gemv_tiles(flavour, int(n_out), int(k_dim), int(bucket), "NVIDIA H200")
    assert found == gemv.GemvTiles(**tiles) != gemv.DEFAULT_TILES
    assert gemv.gemv_tiles(flavour, int(n_out), int(k_dim), int(bucket), "NVIDIA A100-SXM4-80GB") == gemv.DEFAULT_TILES
    assert gemv.gemv_tiles(flavour, int(n_out) + 8, int(k_dim), int(bucket), "NVIDIA H200") == gemv.DEFAULT_TILES
    assert gemv.gemv_tiles("norm", 4096, 1024, 3, "NVIDIA H200") == gemv.gemv_tiles("norm", 4096, 1024, 1, "NVIDIA H200")


def test_bad_layouts_raise() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="bad shapes"):
        gemv.gemv(x, torch.zeros(4, 9), torch.empty(2, 4))
    with pytest.raises(ValueError, match="gated"):
        gemv.gemv(x, torch.zeros(8, 8), torch.empty(2, 4), gated=True)
