"""The decode GEMV: out = x · wᵀ for a few rows, with the RMSNorm, SwiGLU, residual or bias of a decoder layer
fused in (`gemv`).

A decode GEMV moves megabytes of weights for a handful of rows, so its time is the latency of getting those
bytes in flight: the kernel streams row-major weights [N, K] in [BLOCK_N, BLOCK_K] tiles (K contiguous, so
loads vectorise) through `tl.dot` against the rows padded to 16..64, accumulating in fp32, and splits K
until the grid fills the GPU; the last split of a tile to arrive reduces the partial sums in a fixed order
(deterministic, no atomics on data). Which tiles are fastest depends on the GPU and the product shape, and no
formula predicts it well, so they are data: `configs/gemv_tiles.json`, per GPU name and product shape, swept
by `benchmarks/kernels/sweep_gemv.py`; other GPUs and shapes use DEFAULT_TILES.

Under programmatic dependent launch the kernel loads its first weight block, which no kernel writes, before
waiting for the kernel before it; it loads its residual tile with its inputs rather than after the split
reduction, so that the reduction does not wait for another memory round trip.

Grids and block sizes depend only on Python ints, nothing is autotuned at run time, and nothing synchronises
with the host, so launches are CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

import torch

from . import common
from .common import arrived_last, dot, jit, round_to

try:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

# Up to this many rows a decoder layer's products run as `gemv`; above it cuBLAS GEMMs tile the batch better
# (benchmarks/kernels/sweep_gemv.py compares both).
GEMV_MAX_ROWS = 64
FP32_BLOCK_K = 64  # exact fp32 FMA products (no tensor cores) spill registers beyond this
MAX_BLOCK_M = 64  # rows per program; larger batches take several row tiles


@dataclass(frozen=True)
class GemvTiles:
    """How one GEMV is cut: outputs and K per program, and how far K is split to fill the GPU."""

    block_n: int = 32
    block_k: int = 256  # 16-bit elements; fp32 tiles are capped at FP32_BLOCK_K
    programs_per_sm: int = 8  # K is split until the grid has about this many programs per SM
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILES = GemvTiles()  # for GPUs and products without swept tiles


def rows_bucket(rows: int) -> int:
    """The row count a tile table entry stands for: 1 (1-4 rows), 16 (5-16) or 64 (more)."""
    return 1 if rows <= 4 else 16 if rows <= 16 else 64


def tile_key(flavour: str, n_out: int, k_dim: int, rows: int) -> str:
    """A product's key in `configs/gemv_tiles.json`: "flavour/n_out/k_dim/rows bucket"."""
    return f"{flavour}/{n_out}/{k_dim}/{rows_bucket(rows)}"


@functools.cache
def tile_tables() -> dict[str, dict[str, GemvTiles]]:
    """The swept tiles by GPU name, then by `tile_key`, as shipped in `configs/gemv_tiles.json`."""
    text = resources.files(__package__).joinpath("configs", "gemv_tiles.json").read_text(encoding="utf-8")
    devices = json.loads(text)["devices"]
    return {name: {key: GemvTiles(**tiles) for key, tiles in table.items()} for name, table in devices.items()}


def gemv_tiles(flavour: str, n_out: int, k_dim: int, rows: int, device_name: str) -> GemvTiles:
    """The tiles for one product on the GPU called `device_name` (as torch reports it; "" off the GPU)."""
    return tile_tables().get(device_name, {}).get(tile_key(flavour, n_out, k_dim, rows), DEFAULT_TILES)


def supports(dtype: torch.dtype) -> common.Support:
    """Any product shape runs; the dtype must be one the kernels are tested in."""
    return common.dtype_support(dtype)


# ----------------------------------------------------------------------------------------------- kernel


@jit
def _gemv_epilogue(
    acc, acc_up, sumsq, res, out_ptr, n, m, n_ok, m_ok, eps, stride_out,
    K_DIM: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, BIAS: tl.constexpr,
):
    """Scale by 1/rms (NORM), SiLU(gate)*up (GATED), add the residual tile `res` (RESIDUAL), store [m, n]
    transposed.

    Each rounding to the model dtype is one the PyTorch path makes when it stores an intermediate; a bias
    (BIAS: the residual is the bias, row stride 0) is added before the one rounding, as in cuBLAS's epilogue.
    """
    dt = out_ptr.dtype.element_ty
    mask = n_ok[:, None] & m_ok[None, :]
    if NORM:
        rstd = tl.math.rsqrt(sumsq / K_DIM + eps)[None, :]
        y = round_to(acc * rstd, dt)
        if GATED:
            up = round_to(acc_up * rstd, dt)
            y = round_to(round_to(y / (1.0 + tl.exp(-y)), dt) * up, dt)
    elif BIAS:
        y = acc
    else:
        y = round_to(acc, dt)
    if RESIDUAL:
        y = y + res
    tl.store(out_ptr + m[None, :] * stride_out + n[:, None], y.to(dt), mask=mask)


@jit
def _gemv_residual(res_ptr, n, m, n_ok, m_ok, stride_res, RESIDUAL: tl.constexpr):
    """The residual tile [BLOCK_N, BLOCK_M] in fp32 (RESIDUAL), loaded with the inputs so that it is at hand
    when the reduction ends: a load after it would add a memory round trip to the kernel's latency."""
    res = 0.0
    if RESIDUAL:
        res = tl.load(res_ptr + m[None, :] * stride_res + n[:, None], mask=n_ok[:, None] & m_ok[None, :], other=0.0)
        res = res.to(tl.float32)
    return res


@jit
def _gemv_inputs(
    x_ptr, g_ptr, k, m, m_ok, stride_x, sumsq, K_DIM: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr
):
    """The rows' inputs at k, transposed for the product ([BLOCK_K, BLOCK_M]): times the norm gains when NORM,
    with Σx² accumulated alongside (only without K splits: split programs see part of the row)."""
    k_ok = k < K_DIM
    x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        if SPLITS == 1:
            sumsq += tl.sum(xf * xf, axis=1)
        x = (xf * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
    return tl.trans(x), sumsq


@jit
def _gemv_weights(w_ptr, n, n_ok, k, K_DIM: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile of output rows n at inputs k."""
    return tl.load(w_ptr + n[:, None] * K_DIM + k[None, :], mask=n_ok[:, None] & (k < K_DIM)[None, :], other=0.0)


@jit
def _gemv_kernel(
    x_ptr, g_ptr, w_ptr, res_ptr, out_ptr, part_ptr, count_ptr, rows, eps, stride_x, stride_res, stride_out,
    N_OUT: tl.constexpr, K_DIM: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    BIAS: tl.constexpr, ROW_TILES: tl.constexpr, SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr,
):
    """out = epilogue(x' · w[:N_OUT]ᵀ) with x' = x∘g when NORM (the 1/rms factor is applied at the end).

    Program (tile, split) takes BLOCK_N outputs of BLOCK_M rows over SPLIT_BLOCKS K blocks. With SPLITS > 1
    the partial sums go to `part_ptr` and the tile's last split to arrive adds them in a fixed order
    (deterministic, no atomics on data) and runs the epilogue; it then recomputes Σx² over the whole row.
    Row tiles vary fastest over program ids, so the programs that share a weight tile run together.

    PDL (programmatic dependent launch): the kernel may start while the previous one still runs; it loads
    its first weight block, which nothing before it writes, and only then waits for that kernel's results.
    It lets the next kernel start before that wait, or after it with LATE_TRIGGER, which lets the next kernel
    read early whatever was written before this one's inputs.
    """
    tile, split = tl.program_id(0), tl.program_id(1)
    n = (tile // ROW_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (tile % ROW_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N_OUT, m < rows
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first: tl.constexpr = 1 if PDL else 0
    if PDL:
        k = split * SPLIT_BLOCKS * BLOCK_K + tl.arange(0, BLOCK_K)
        w = _gemv_weights(w_ptr, n, n_ok, k, K_DIM)
        w_up = _gemv_weights(w_ptr, n + N_OUT, n_ok, k, K_DIM) if GATED else w
        if not LATE_TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
        if LATE_TRIGGER:
            gdc_launch_dependents()
    sumsq = tl.zeros((BLOCK_M,), tl.float32)
    res = _gemv_residual(res_ptr, n, m, n_ok, m_ok, stride_res, RESIDUAL)
    if PDL:
        xt, sumsq = _gemv_inputs(x_ptr, g_ptr, k, m, m_ok, stride_x, sumsq, K_DIM, NORM, SPLITS)
        acc = dot(w, xt, acc, DOT_F32, PRECISION)
        if GATED:
            acc_up = dot(w_up, xt, acc_up, DOT_F32, PRECISION)
    for i in range(first, SPLIT_BLOCKS):
        k = (split * SPLIT_BLOCKS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        xt, sumsq = _gemv_inputs(x_ptr, g_ptr, k, m, m_ok, stride_x, sumsq, K_DIM, NORM, SPLITS)
        acc = dot(_gemv_weights(w_ptr, n, n_ok, k, K_DIM), xt, acc, DOT_F32, PRECISION)
        if GATED:
            acc_up = dot(_gemv_weights(w_ptr, n + N_OUT, n_ok, k, K_DIM), xt, acc_up, DOT_F32, PRECISION)
    if SPLITS == 1:
        _gemv_epilogue(
            acc, acc_up, sumsq, res, out_ptr, n, m, n_ok, m_ok, eps, stride_out, K_DIM, NORM, GATED, RESIDUAL, BIAS,
        )
    else:
        # partials [SPLITS, 1 + GATED, N_OUT, ROW_TILES * BLOCK_M] in fp32
        rows_pad: tl.constexpr = ROW_TILES * BLOCK_M
        part = part_ptr + n[:, None] * rows_pad + m[None, :]
        stride_split: tl.constexpr = (1 + GATED) * N_OUT * rows_pad
        tl.store(part + split * stride_split, acc, mask=n_ok[:, None])
        if GATED:
            tl.store(part + split * stride_split + N_OUT * rows_pad, acc_up, mask=n_ok[:, None])
        if arrived_last(count_ptr + tile, SPLITS):
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(part + s * stride_split, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(
                        part + s * stride_split + N_OUT * rows_pad, mask=n_ok[:, None], other=0.0, cache_modifier=".cg"
                    )
            if NORM:
                for k0 in range(0, K_DIM, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    xs = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & (k < K_DIM)[None, :], other=0.0)
                    xs = xs.to(tl.float32)
                    sumsq += tl.sum(xs * xs, axis=1)
            _gemv_epilogue(
                acc, acc_up, sumsq, res, out_ptr, n, m, n_ok, m_ok, eps, stride_out, K_DIM, NORM, GATED, RESIDUAL, BIAS,
            )
            tl.store(count_ptr + tile, 0)  # ready for the next launch


# ----------------------------------------------------------------------------------------------- launcher


def gemv_grid(n_out: int, k_dim: int, rows: int, dtype: torch.dtype, tiles: GemvTiles, device: torch.device) -> dict[str, int]:
    """The launch's block constexprs: rows per program, K per block, and the K split that fills the GPU."""
    block_m = min(MAX_BLOCK_M, max(16, common.next_power_of_2(rows)))
    block_k = tiles.block_k if dtype != torch.float32 else min(tiles.block_k, FP32_BLOCK_K)
    block_k = max(16, min(block_k, common.next_power_of_2(k_dim)))
    programs = common.cdiv(n_out, tiles.block_n) * common.cdiv(rows, block_m)
    k_blocks = common.cdiv(k_dim, block_k)
    want = min(max(1, common.cdiv(tiles.programs_per_sm * common.sm_count(device), programs)), k_blocks)
    per_split = common.cdiv(k_blocks, want)
    return {
        "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": block_k, "ROW_TILES": common.cdiv(rows, block_m),
        "SPLITS": common.cdiv(k_blocks, per_split), "SPLIT_BLOCKS": per_split,
    }


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
    late_trigger: bool = False,
) -> None:
    """out = x · wᵀ for a few rows x [rows, K] (row stride free), with optional fusions:

    `norm` (gains [K]): RMSNorm(x) first; `gated`: w holds [gate; up] and out = SiLU(gate)·up (needs `norm`);
    `residual` [rows, N]: out = residual + product; `bias` [N]: out = product + bias, as `F.linear` rounds it.
    out [rows, N] must be a distinct buffer. `tiles`: instead of the device's table. `late_trigger`: under PDL
    the next kernel starts only once this one's inputs are complete (see `_gemv_kernel`).
    """
    rows, k_dim = x.shape
    n_out = out.shape[1]
    if gated and norm is None:
        raise ValueError("the gated product is only fused behind a norm")
    if bias is not None:
        if norm is not None or residual is not None or bias.shape != (n_out,) or bias.stride(0) != 1:
            raise ValueError("a bias [N] (contiguous) goes on a plain product only")
        residual = bias.expand(rows, n_out)  # row stride 0
    if w.shape != ((2 if gated else 1) * n_out, k_dim) or not w.is_contiguous() or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"bad shapes or layouts: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    # a bias costs what a residual does: same tiles
    flavour = "gated" if gated else "norm" if norm is not None else "residual" if residual is not None else "plain"
    tiles = tiles or gemv_tiles(flavour, n_out, k_dim, rows, common.device_name(x.device))
    grid = gemv_grid(n_out, k_dim, rows, x.dtype, tiles, x.device)
    programs = common.cdiv(n_out, grid["BLOCK_N"]) * grid["ROW_TILES"]
    splits = grid["SPLITS"]
    partials = None
    if splits > 1:
        rows_pad = grid["ROW_TILES"] * grid["BLOCK_M"]
        partials = torch.empty(splits, 2 if gated else 1, n_out, rows_pad, device=x.device, dtype=torch.float32)
    _gemv_kernel[(programs, splits)](
        x, norm if norm is not None else x, w, residual if residual is not None else out, out, partials if partials is not None else out,
        common.counters(x.device), rows, eps, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        N_OUT=n_out, K_DIM=k_dim, NORM=norm is not None, GATED=gated, RESIDUAL=residual is not None, BIAS=bias is not None,
        DOT_F32=common.interpreting(), PRECISION=common.dot_precision(x.dtype), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, LATE_TRIGGER=late_trigger, **grid, **common.pdl_options(x.device),
    )
