"""The codec's codebook lookups summed in one Triton pass (`codebook_sum`) instead of two kernels a codebook.

`engine/audio/codebooks.py` sums a group of codebooks' lookups as the official quantizer does: the first
codebook's row, then each next one's added in the model dtype. Here one program per (block of frames, block of
the width) gathers every codebook's row and adds them in the same order, each partial sum rounded to the model
dtype as PyTorch stores it, so the result equals the PyTorch path's.
"""

from __future__ import annotations

import torch

from . import common
from .common import jit, round_to

try:
    import triton
    import triton.language as tl
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

BLOCK_ROWS, BLOCK_WIDTH = 16, 128


@jit
def _codebook_sum_kernel(
    codes_ptr, tables_ptr, out_ptr, rows, frames, stride_b, stride_t, stride_q, first, bins, width,
    COUNT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_WIDTH: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # b * frames + t
    d = tl.program_id(1) * BLOCK_WIDTH + tl.arange(0, BLOCK_WIDTH)
    ok_r = r < rows
    ok = ok_r[:, None] & (d < width)[None, :]
    code_at = codes_ptr + (r // frames).to(tl.int64) * stride_b + (r % frames).to(tl.int64) * stride_t
    code = tl.load(code_at + first * stride_q, mask=ok_r, other=0)
    code = tl.minimum(tl.maximum(code, 0), bins - 1)  # never a read outside the table (codes come < bins)
    first_row = tl.load(tables_ptr + code[:, None] * width + d[None, :], mask=ok, other=0.0)
    dt = first_row.dtype
    acc = first_row.to(tl.float32)
    for i in tl.static_range(1, COUNT):  # a group's codebooks (1 or 15): unrolled
        code = tl.load(code_at + (first + i) * stride_q, mask=ok_r, other=0)
        code = tl.minimum(tl.maximum(code, 0), bins - 1)
        row = tl.load(tables_ptr + (i * bins + code[:, None]).to(tl.int64) * width + d[None, :], mask=ok, other=0.0)
        acc = round_to(acc + row.to(tl.float32), dt)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * width + d[None, :], acc.to(dt), mask=ok)


def supports(tables: torch.Tensor) -> common.Support:
    """Whether a group's tables [count, bins, width] can be summed by the kernel here."""
    if not common.available(tables.device):
        return common.unsupported(f"no Triton kernels on {tables.device.type}")
    if not tables.is_contiguous():
        return common.unsupported("the tables must be contiguous")
    return common.dtype_support(tables.dtype)


def codebook_sum(codes: torch.Tensor, first: int, tables: torch.Tensor) -> torch.Tensor:
    """codes [B, T, Q] (int64, any strides), tables [count, bins, width] -> [B, T, width]: the sum over i of
    tables[i][codes[..., first + i]], added in order in the tables' dtype."""
    batch, frames, _ = codes.shape
    count, bins, width = tables.shape
    out = torch.empty(batch, frames, width, device=tables.device, dtype=tables.dtype)
    rows = batch * frames
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(width, BLOCK_WIDTH))
    _codebook_sum_kernel[grid](
        codes, tables, out, rows, frames, codes.stride(0), codes.stride(1), codes.stride(2), first, bins, width,
        COUNT=count, BLOCK_ROWS=BLOCK_ROWS, BLOCK_WIDTH=BLOCK_WIDTH, enable_fp_fusion=False,
    )
    return out
