"""The codec's SnakeBeta activation, x + 1/β · sin²(αx), as one Triton pass instead of five (`FusedSnakeBeta`).

The official module runs five full-size elementwise kernels (x·α, sin, square, ·1/β, +x), two of them
broadcasting [1, C, 1] against [B, C, T] on PyTorch's slow strided path, and these activations are the
largest elementwise work of an audio decode. Here one program per (row, time block) reads x once and
writes once.

Each intermediate is rounded to the model dtype where the module's kernels store it, and fp32 products are
not contracted into FMAs, so the result equals the module's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.compat import OfficialModule
from . import common
from .common import jit, round_to

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

BLOCK = 1024  # time steps per program


def snake_modules(decoder: nn.Module) -> list[nn.Module]:
    """The SnakeBeta modules of an official codec decoder (by class name: the class lives in qwen_tts)."""
    return [module for module in decoder.modules() if type(module).__name__ == "SnakeBeta"]


def supports(module: nn.Module) -> common.Support:
    """Whether one official `SnakeBeta` module can run as the kernel: per-channel α and β in a tested dtype."""
    alpha, beta = getattr(module, "alpha", None), getattr(module, "beta", None)
    if not isinstance(alpha, torch.Tensor) or not isinstance(beta, torch.Tensor):
        return common.unsupported(f"{type(module).__name__} has no alpha and beta parameters")
    if alpha.dim() != 1 or alpha.shape != beta.shape:
        return common.unsupported(f"SnakeBeta parameters of shape {tuple(alpha.shape)} not supported")
    return common.dtype_support(alpha.dtype)


@jit
def _sin(x, LIBDEVICE: tl.constexpr):
    """sinf as PyTorch's CUDA kernel computes it (tl.sin may lower to the approximate instruction)."""
    if LIBDEVICE:
        return libdevice.sin(x)
    return tl.sin(x)


@jit
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
    scaled = round_to(xf * tl.load(alpha_ptr + c).to(tl.float32), dt)
    sine = round_to(_sin(scaled, LIBDEVICE), dt)
    bump = round_to(tl.load(inv_beta_ptr + c).to(tl.float32) * round_to(sine * sine, dt), dt)
    tl.store(out_ptr + row.to(tl.int64) * length + t, (xf + bump).to(dt), mask=ok)


class FusedSnakeBeta:
    """A one-kernel stand-in for one official `SnakeBeta` module `supports` takes (its parameters read once,
    at construction)."""

    def __init__(self, module: OfficialModule) -> None:
        self.module = module
        with torch.no_grad():
            # the module's own per-channel factors, computed by the same ops: exp(α) and 1 / (exp(β) + ε)
            self.alpha = torch.exp(module.alpha).contiguous()
            self.inv_beta = (1.0 / (torch.exp(module.beta) + module.no_div_by_zero)).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] (time contiguous) -> a new contiguous tensor; the module itself where Triton cannot run."""
        if not common.available(x.device) or x.dim() != 3 or x.stride(-1) != 1:
            return self.module(x)
        batch, channels, length = x.shape
        out = torch.empty(batch, channels, length, device=x.device, dtype=x.dtype)
        _snake_kernel[(batch * channels, triton.cdiv(length, BLOCK))](
            x, self.alpha, self.inv_beta, out, channels, length, x.stride(0), x.stride(1),
            BLOCK=BLOCK, LIBDEVICE=not common.interpreting(), enable_fp_fusion=False,
        )
        return out
