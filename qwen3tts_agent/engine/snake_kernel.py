"""The codec's SnakeBeta activation, x + 1/β · sin²(αx), as one Triton pass instead of five.

The official module runs five full-size elementwise kernels (x·α, sin, square, ·1/β, +x), two of them
broadcasting [1, C, 1] against [B, C, T] on PyTorch's slow strided path. The decoder's elementwise kernels,
mostly these, took 10 of the 20 ms of a 32-stream × 8-frame decode on an H200; with one pass per activation
the decode took 15 ms (benchmarks/results/2026-11-30-h200/). Here one program per (row, time block) reads x
once and writes once.

Each intermediate is rounded to the model dtype where the module's kernels store it, and fp32 products are
not contracted into FMAs, so the result equals the module's.
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels import _interpreting, _jit, _round, available

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # keeps the module importable without triton; available() reports False
    triton = None

__all__ = ["FusedSnakeBeta"]

BLOCK = 1024  # time steps per program


@_jit
def _sin(x, LIBDEVICE: tl.constexpr):
    """sinf as PyTorch's CUDA kernel computes it (tl.sin may lower to the approximate instruction)."""
    if LIBDEVICE:
        return libdevice.sin(x)
    return tl.sin(x)


@_jit
def _snake_kernel(
    x_ptr, alpha_ptr, inv_beta_ptr, out_ptr, channels, length, stride_b, stride_c,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)  # b * channels + c
    b, c = row // channels, row % channels
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < length
    x = tl.load(x_ptr + b.to(tl.int64) * stride_b + c * stride_c + t, mask=ok, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    scaled = _round(xf * tl.load(alpha_ptr + c).to(tl.float32), dt)
    sine = _round(_sin(scaled, LIBDEVICE), dt)
    bump = _round(tl.load(inv_beta_ptr + c).to(tl.float32) * _round(sine * sine, dt), dt)
    tl.store(out_ptr + row.to(tl.int64) * length + t, (xf + bump).to(dt), mask=ok)


class FusedSnakeBeta:
    """A one-kernel stand-in for one official `SnakeBeta` module (its parameters read once, at construction)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        with torch.no_grad():
            # the module's own per-channel factors, computed by the same ops: exp(α) and 1 / (exp(β) + ε)
            self.alpha = torch.exp(module.alpha).contiguous()
            self.inv_beta = (1.0 / (torch.exp(module.beta) + module.no_div_by_zero)).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] (time contiguous) -> a new contiguous tensor; the module itself where Triton cannot run."""
        if not available(x.device) or x.dim() != 3 or x.stride(-1) != 1:
            return self.module(x)
        batch, channels, length = x.shape
        out = torch.empty(batch, channels, length, device=x.device, dtype=x.dtype)
        _snake_kernel[(batch * channels, triton.cdiv(length, BLOCK))](
            x, self.alpha, self.inv_beta, out, channels, length, x.stride(0), x.stride(1),
            BLOCK=BLOCK, LIBDEVICE=not _interpreting(), enable_fp_fusion=False,
        )
        return out
