"""What follows each of the codec's audio-rate convolutions, in one Triton pass (`ConvEpilogue`).

In the official decoder every convolution is followed by elementwise work over its whole output: cuDNN does not
add a bias, so PyTorch adds it in a kernel of its own (a broadcast over [B, C, T] on its strided path); a residual
unit's second convolution adds the unit's input; and the next op is a SnakeBeta activation, whose output the
streaming decoder then copies behind the next convolution's history (`kernels.history`). At 128 streams x 8 frames
on an H100 these passes took more of a codec call than the convolutions themselves (docs/gpu.md, "Codec kernels").

Here one program per tile (a row's block of time steps by a block of channels) reads the convolution's output
without bias (and the residual) once and writes the activation's output straight into the next convolution's
input, behind the room left for its history, plus the sum where it is the next unit's residual. The codec keeps
these tensors channels-contiguous, as cuDNN's tensor-core convolutions read and write them
(`engine/audio/codec.py`, `channels_last_conv`); the kernel takes any strides. Each step is rounded to the model
dtype where PyTorch's kernels store it (the conv's output, output + bias, + residual, and the activation's x·α,
sin, its square and the bump scaled by 1/β, five kernels in the module), sinf is libdevice's as in PyTorch's
kernel, and fp32 products are not contracted into FMAs, so the result equals the PyTorch ops on a GPU, where
cuDNN's convolution leaves the bias out as here.

The decoder's last convolution (its channels to one, then a clamp to [-1, 1]) is a kernel of its own here too
(`OutputConv`): a convolution with one output channel has nothing for cuDNN's tensor cores to do, and on
channels-contiguous input cuDNN ran it at some batch shapes on a direct kernel that took 70 ms of a 74 ms call on
an H100 (docs/gpu.md, "Codec kernels"). It is a dot product per output sample, which a program sums over a tile of
time steps by channels for every tap: memory-bound, each input read from DRAM once.
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

BLOCK_T, BLOCK_C = 64, 32  # a program's tile: time steps x channels (the released decoder's widths are multiples of 32)


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
    last = audio_decoder[-1].conv
    return next(
        (s for s in (*(supports(stage.conv.conv, stage.activation) for stage in stages), supports_output(last)) if not s),
        common.SUPPORTED,
    )


@jit
def _epilogue_kernel(
    raw_ptr, bias_ptr, residual_ptr, alpha_ptr, inv_beta_ptr, sum_ptr, out_ptr, channels, length,
    stride_rb, stride_rc, stride_rt, stride_eb, stride_ec, stride_et,
    stride_sb, stride_sc, stride_st, stride_ob, stride_oc, stride_ot,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, RESIDUAL: tl.constexpr, KEEP_SUM: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """out = snake(raw + bias (+ residual)), and the sum itself into `sum_ptr` when KEEP_SUM. Every tensor is
    [B, C, T] with strides of its own: one program per (row, block of time, block of channels), whose tile Triton
    reads and writes along whichever of the two is contiguous in each tensor."""
    b = tl.program_id(0).to(tl.int64)
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    c = (tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    ok_c = c < channels
    ok = (t < length) & ok_c
    raw = tl.load(raw_ptr + b * stride_rb + c * stride_rc + t * stride_rt, mask=ok, other=0.0)
    dt = raw.dtype
    h = round_to(raw.to(tl.float32) + tl.load(bias_ptr + c, mask=ok_c, other=0.0).to(tl.float32), dt)
    if RESIDUAL:
        residual = tl.load(residual_ptr + b * stride_eb + c * stride_ec + t * stride_et, mask=ok, other=0.0)
        h = round_to(h + residual.to(tl.float32), dt)
    if KEEP_SUM:
        tl.store(sum_ptr + b * stride_sb + c * stride_sc + t * stride_st, h.to(dt), mask=ok)
    scaled = round_to(h * tl.load(alpha_ptr + c, mask=ok_c, other=0.0).to(tl.float32), dt)
    sine = round_to(sinf(scaled, LIBDEVICE), dt)
    bump = round_to(tl.load(inv_beta_ptr + c, mask=ok_c, other=0.0).to(tl.float32) * round_to(sine * sine, dt), dt)
    tl.store(out_ptr + b * stride_ob + c * stride_oc + t * stride_ot, (h + bump).to(dt), mask=ok)


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
        """Write activation(raw + bias (+ residual)) into `out`, e.g. the chunk's part of the next convolution's
        input. `raw`: the convolution's output without its bias; `raw`, `out` and `residual` [B, C, T] of one shape,
        each with any strides (a slice in time is fine), fastest where channels or time steps are contiguous.
        Returns the sum before the activation when `keep_sum`: dense, in `raw`'s layout (channels or time steps
        contiguous), as the next residual unit reads it beside its own convolution's output. Else None."""
        batch, channels, length = raw.shape
        if out.shape != raw.shape:
            raise ValueError(f"raw {tuple(raw.shape)} and out {tuple(out.shape)} need one shape")
        if residual is not None and residual.shape != raw.shape:
            raise ValueError(f"the residual must be of shape {tuple(raw.shape)}, got {tuple(residual.shape)}")
        total = common.empty_bct(batch, channels, length, like=raw) if keep_sum else None
        written = out if total is None else total  # unused pointers: any tensor
        read = raw if residual is None else residual
        grid = (batch, triton.cdiv(length, BLOCK_T), triton.cdiv(channels, BLOCK_C))
        _epilogue_kernel[grid](
            raw, self.bias, read, self.alpha, self.inv_beta, written, out, channels, length,
            *raw.stride(), *read.stride(), *written.stride(), *out.stride(),
            BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, RESIDUAL=residual is not None, KEEP_SUM=keep_sum,
            LIBDEVICE=not common.interpreting(), enable_fp_fusion=False,
        )
        return total


OUTPUT_BLOCK_T, OUTPUT_BLOCK_C = 128, 32  # `OutputConv`'s tile: output samples x channels


@jit
def _output_conv_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, channels, length, stride_xb, stride_xc, stride_xt,
    TAPS: tl.constexpr, DILATION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BIAS: tl.constexpr,
):
    """out[b, t] = clamp(sum over taps k and channels c of x[b, c, t + k·DILATION]·w[k, c] (+ bias), -1, 1), the
    conv's output rounded to the model dtype before the bias as PyTorch's ops store it. One program per (row, block of
    output samples); x [B, C, T + (TAPS - 1)·DILATION] with any strides, w [TAPS, C] dense, out [B, T] dense."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok_t = t < length
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    first = 0
    while first < channels:  # not `for ... in range(runtime bound)`: the interpreter cannot index with a runtime scalar
        c = first + tl.arange(0, BLOCK_C)
        ok_c = c < channels
        for k in tl.static_range(TAPS):
            x = tl.load(
                x_ptr + b * stride_xb + c[None, :] * stride_xc + (t[:, None] + k * DILATION) * stride_xt,
                mask=ok_t[:, None] & ok_c[None, :], other=0.0,
            )
            w = tl.load(weight_ptr + k * channels + c, mask=ok_c, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
        first += BLOCK_C
    dt = out_ptr.dtype.element_ty
    y = round_to(tl.sum(acc, axis=1), dt)
    if BIAS:
        y = round_to(y + tl.load(bias_ptr).to(tl.float32), dt)
    tl.store(out_ptr + b * length + t, tl.minimum(tl.maximum(y, -1.0), 1.0).to(dt), mask=ok_t)


def supports_output(conv: nn.Module) -> common.Support:
    """Whether `OutputConv` takes the decoder's last convolution: an ungrouped, unstrided `nn.Conv1d` to one
    channel, in a tested dtype."""
    if not isinstance(conv, nn.Conv1d):
        return common.unsupported(f"a last convolution of type {type(conv).__name__}")
    if conv.out_channels != 1 or conv.groups != 1 or conv.stride[0] != 1:
        return common.unsupported(f"a last convolution to {conv.out_channels} channels, stride {conv.stride[0]}")
    return common.dtype_support(conv.weight.dtype)


class OutputConv:
    """The decoder's last convolution (padding 0) with its bias, clamped to [-1, 1] as the official decoder
    clamps its audio, in one kernel (the weights read once, at construction; `supports_output` must hold)."""

    def __init__(self, conv: nn.Conv1d) -> None:
        if not (support := supports_output(conv)):
            raise ValueError(f"the output conv kernel does not take this: {support.reason}")
        self.taps, self.dilation = conv.kernel_size[0], conv.dilation[0]
        with torch.no_grad():
            self.weight = conv.weight.detach()[0].t().contiguous()  # [taps, channels]
            self.bias = None if conv.bias is None else conv.bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Audio [B, 1, T - (taps - 1)·dilation] from the last convolution's input `x` [B, C, T] (any strides:
        channels or time steps contiguous)."""
        batch, channels, steps = x.shape
        if channels != self.weight.shape[1]:
            raise ValueError(f"the convolution takes {self.weight.shape[1]} channels, got {channels}")
        length = steps - (self.taps - 1) * self.dilation
        if length < 1:
            raise ValueError(f"{steps} steps are fewer than the convolution's span")
        out = torch.empty(batch, 1, length, device=x.device, dtype=x.dtype)
        grid = (batch, triton.cdiv(length, OUTPUT_BLOCK_T))
        _output_conv_kernel[grid](
            x, self.weight, self.weight if self.bias is None else self.bias, out, channels, length, *x.stride(),
            TAPS=self.taps, DILATION=self.dilation, BLOCK_T=OUTPUT_BLOCK_T, BLOCK_C=OUTPUT_BLOCK_C,
            BIAS=self.bias is not None,
        )
        return out
