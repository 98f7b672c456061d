"""What follows each of the codec's audio-rate convolutions, in one Triton pass (`ConvEpilogue`).

In the official decoder every convolution is followed by elementwise work over its whole output: cuDNN does not
add a bias, so PyTorch adds it in a kernel of its own (a broadcast over [B, C, T] on its strided path); a residual
unit's second convolution adds the unit's input; and the next op is a SnakeBeta activation, whose output the
streaming decoder then copies behind the next convolution's history (`kernels.history`). At 128 streams x 8 frames
on an H100 these passes took more of a codec call than the convolutions themselves (docs/gpu.md, "Codec kernels").

Here one program per (row, time block) reads the convolution's output without bias (and the residual) once and
writes the activation's output straight into the next convolution's input, behind the room left for its history,
plus the sum where it is the next unit's residual. Each step is rounded to the model dtype where PyTorch's kernels
store it (the conv's output, output + bias, + residual, and the activation's x·α, sin, its square and the bump
scaled by 1/β, five kernels in the module), sinf is libdevice's as in PyTorch's kernel, and fp32 products are not
contracted into FMAs, so the result equals the PyTorch ops on a GPU, where cuDNN's convolution leaves the bias out
as here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from ..models.compat import OfficialModule
from . import common
from .common import jit, round_to, sinf

try:
    import triton
    import triton.language as tl
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

BLOCK = 1024  # time steps per program


@dataclass(frozen=True)
class Stage:
    """One of the audio decoder's convolutions and what follows it up to the next: the bias, in a residual unit's
    second convolution the unit's input (`adds_residual`), and the SnakeBeta `activation` whose output is the input
    of `next_conv`. `keeps_sum`: the sum before the activation is the next residual unit's input."""

    conv: OfficialModule  # a causal (transposed) conv wrapper: its `.conv` is the nn.Conv1d / nn.ConvTranspose1d
    activation: OfficialModule
    next_conv: OfficialModule
    adds_residual: bool = False
    keeps_sum: bool = False


def decoder_stages(audio_decoder: OfficialModule) -> list[Stage]:
    """The stages of the official `Qwen3TTSTokenizerV2Decoder.decoder` ([conv, blocks..., SnakeBeta, conv]; a block:
    SnakeBeta, transposed conv, residual units of SnakeBeta, conv, SnakeBeta, conv, + input), in order; the last
    convolution, followed by no activation, is not one."""
    first, *blocks, final_activation, last = audio_decoder
    # the activation before each block's upsampling convolution, or before the last convolution
    entries = [(block.block[0], block.block[1]) for block in blocks] + [(final_activation, last)]
    stages = [Stage(first, *entries[0])]
    for block, (after_activation, after_conv) in zip(blocks, entries[1:], strict=True):
        _, upsample, *units = block.block
        stages.append(Stage(upsample, units[0].act1, units[0].conv1, keeps_sum=True))
        for unit, following in itertools.zip_longest(units, units[1:]):
            stages.append(Stage(unit.conv1, unit.act2, unit.conv2))
            if following is None:
                stages.append(Stage(unit.conv2, after_activation, after_conv, adds_residual=True))
            else:
                stages.append(Stage(unit.conv2, following.act1, following.conv1, adds_residual=True, keeps_sum=True))
    return stages


def supports_decoder(audio_decoder: OfficialModule) -> common.Support:
    """Whether the kernel takes every stage of an official audio decoder (`decoder_stages`)."""
    try:
        stages = decoder_stages(audio_decoder)
    except (AttributeError, TypeError, ValueError) as error:
        return common.unsupported(f"an audio decoder of another structure ({error})")
    return next((s for s in (supports(stage.conv.conv, stage.activation) for stage in stages) if not s), common.SUPPORTED)


@jit
def _epilogue_kernel(
    raw_ptr, bias_ptr, residual_ptr, alpha_ptr, inv_beta_ptr, sum_ptr, out_ptr, channels, length,
    stride_rb, stride_rc, stride_sb, stride_sc, stride_ob, stride_oc,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, KEEP_SUM: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """out = snake(raw + bias (+ residual)), and the sum itself into `sum_ptr` (dense) when KEEP_SUM. Every tensor
    is [B, C, T] with its time steps contiguous; the residual has the dense sum's shape and strides."""
    row = tl.program_id(0)  # b * channels + c
    b, c = (row // channels).to(tl.int64), row % channels
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < length
    raw = tl.load(raw_ptr + b * stride_rb + c * stride_rc + t, mask=ok, other=0.0)
    dt = raw.dtype
    h = round_to(raw.to(tl.float32) + tl.load(bias_ptr + c).to(tl.float32), dt)
    dense = b * stride_sb + c * stride_sc + t
    if RESIDUAL:
        h = round_to(h + tl.load(residual_ptr + dense, mask=ok, other=0.0).to(tl.float32), dt)
    if KEEP_SUM:
        tl.store(sum_ptr + dense, h.to(dt), mask=ok)
    scaled = round_to(h * tl.load(alpha_ptr + c).to(tl.float32), dt)
    sine = round_to(sinf(scaled, LIBDEVICE), dt)
    bump = round_to(tl.load(inv_beta_ptr + c).to(tl.float32) * round_to(sine * sine, dt), dt)
    tl.store(out_ptr + b * stride_ob + c * stride_oc + t, (h + bump).to(dt), mask=ok)


def supports(conv: nn.Module, activation: nn.Module) -> common.Support:
    """Whether the kernel takes a convolution (`nn.Conv1d` or `nn.ConvTranspose1d` with a bias) followed by a
    SnakeBeta module (per-channel α and β), in a tested dtype."""
    if not isinstance(conv, (nn.Conv1d, nn.ConvTranspose1d)) or conv.bias is None:
        return common.unsupported(f"{type(conv).__name__} without a bias not supported")
    alpha, beta = getattr(activation, "alpha", None), getattr(activation, "beta", None)
    if not isinstance(alpha, torch.Tensor) or not isinstance(beta, torch.Tensor):
        return common.unsupported(f"{type(activation).__name__} has no alpha and beta parameters")
    if alpha.dim() != 1 or alpha.shape != beta.shape or alpha.shape[0] != conv.out_channels:
        return common.unsupported(f"SnakeBeta parameters of shape {tuple(alpha.shape)} not supported")
    if alpha.dtype != conv.bias.dtype:
        return common.unsupported("the activation's dtype differs from the convolution's")
    return common.dtype_support(alpha.dtype)


class ConvEpilogue:
    """The bias of `conv`, an optional residual and the SnakeBeta `activation` after it, as one kernel (both
    modules' parameters read once, at construction; `supports` must hold)."""

    def __init__(self, conv: nn.Conv1d | nn.ConvTranspose1d, activation: OfficialModule) -> None:
        if not (support := supports(conv, activation)):
            raise ValueError(f"the conv epilogue kernel does not take this: {support.reason}")
        assert conv.bias is not None
        with torch.no_grad():
            self.bias = conv.bias.detach().contiguous()
            # the module's own per-channel factors, computed by the same ops: exp(α) and 1 / (exp(β) + ε)
            self.alpha = torch.exp(activation.alpha).contiguous()
            self.inv_beta = (1.0 / (torch.exp(activation.beta) + activation.no_div_by_zero)).contiguous()

    def __call__(
        self, raw: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None, keep_sum: bool = False,
    ) -> torch.Tensor | None:
        """Write activation(raw + bias (+ residual)) into `out` ([B, C, T], time contiguous, e.g. the chunk's part
        of the next convolution's input). `raw`: the convolution's output without its bias, [B, C, T], time
        contiguous (a slice in time is fine); `residual`: dense [B, C, T]. Returns the sum before the activation
        (dense) when `keep_sum`, else None."""
        batch, channels, length = raw.shape
        if out.shape != raw.shape or length > 1 and (raw.stride(-1) != 1 or out.stride(-1) != 1):
            raise ValueError(f"raw {tuple(raw.shape)} and out {tuple(out.shape)} need one shape, time contiguous")
        if residual is not None and (residual.shape != raw.shape or not residual.is_contiguous()):
            raise ValueError(f"the residual must be dense and of shape {tuple(raw.shape)}")
        total = torch.empty(raw.shape, device=raw.device, dtype=raw.dtype) if keep_sum else None
        _epilogue_kernel[(batch * channels, triton.cdiv(length, BLOCK))](  # unused pointers: any tensor
            raw, self.bias, raw if residual is None else residual, self.alpha, self.inv_beta,
            out if total is None else total, out, channels, length, raw.stride(0), raw.stride(1),
            channels * length, length, out.stride(0), out.stride(1),
            BLOCK=BLOCK, RESIDUAL=residual is not None, KEEP_SUM=keep_sum, LIBDEVICE=not common.interpreting(),
            enable_fp_fusion=False,
        )
        return total
