"""`CpuCodecDecoder`: the exact streaming codec decoder, with the short convolutions run as one GEMM each,
in bfloat16 where the CPU computes it natively.

A streaming chunk is a few frames, so the decoder's frame-rate convolutions see a handful of time steps
against millions of weights (the first transposed conv: 1536 x 768 x 16). oneDNN's direct convolution is
slow on such shapes; as a GEMM (weights [out, in * kernel] times the input's kernel-shifted copies, or for
a transposed conv the weights times the input, then an overlap-add of the kernel's stride-long pieces) the
same sums run at the GEMM's speed. Long inputs (the audio-rate convolutions) keep the direct convolution.
Results equal the module's to float rounding, so the decoder stays exact (tests/test_cpu_backend.py).

The decoder's cost is arithmetic, not bytes: about 2.5 GMAC per frame, nearly all in the audio-rate
convolutions. In float32 two cores do about 80 GFLOP/s of it; with `compute_dtype=torch.bfloat16` (the int8
backend's choice on CPUs with AVX512-BF16 or AMX) oneDNN runs the same convolutions about twice as fast, on
a bfloat16 copy of the decoder. That is not exact: benchmarks/cpu/bench_cpu.py reports the audio difference.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.audio import StreamingCodecDecoder
from ...models.compat import OfficialModule

# Output steps up to which a convolution runs as a GEMM (benchmarks/cpu/bench_cpu.py --codec-convs measured where
# the GEMM stops winning).
GEMM_MAX_STEPS = 64


class CpuCodecDecoder(StreamingCodecDecoder):
    """`StreamingCodecDecoder` for the CPU backends (same interface, same results)."""

    def __init__(
        self, decoder: OfficialModule, max_streams: int, gemm_max_steps: int = GEMM_MAX_STEPS,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`compute_dtype`: run a copy of the decoder in this dtype (None: the decoder's own). Audio comes
        out in that dtype; the engine copies it into float32 host buffers."""
        if compute_dtype is not None and compute_dtype != next(decoder.parameters()).dtype:
            decoder = copy.deepcopy(decoder).to(compute_dtype)
        super().__init__(decoder, max_streams)
        self.gemm_max_steps = gemm_max_steps
        self._gemm_weights: dict[nn.Module, torch.Tensor] = {}
        with torch.no_grad():
            for module in self._convs:
                conv: OfficialModule = module.conv
                if conv.groups != 1:
                    continue  # the ConvNeXt depthwise convs: cheap as they are
                weight = conv.weight.detach()
                if isinstance(conv, nn.ConvTranspose1d):
                    stride, kernel = conv.stride[0], conv.kernel_size[0]
                    taps = -(-kernel // stride) * stride  # a whole number of stride-long pieces
                    weight = F.pad(weight, (0, taps - kernel))  # [in, out, taps]
                    self._gemm_weights[module] = weight.reshape(weight.shape[0], -1).T.contiguous()  # [out*taps, in]
                else:
                    self._gemm_weights[module] = weight.reshape(weight.shape[0], -1).contiguous()  # [out, in*kernel]

    def _conv(self, module: OfficialModule, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        weight = self._gemm_weights.get(module)
        if weight is None or x.shape[-1] > self.gemm_max_steps:
            return super()._conv(module, x, slots)
        history = self._convs[module]
        conv = module.conv
        full = history.extend(slots, x)
        if isinstance(conv, nn.ConvTranspose1d):
            stride = conv.stride[0]
            y = _transposed_conv_gemm(full, weight, conv.bias, stride, conv.out_channels)
            return y[..., history.size * stride : (history.size + x.shape[-1]) * stride]
        return _conv_gemm(full, weight, conv.bias, conv.kernel_size[0], conv.dilation[0])


def native_bfloat16() -> bool:
    """Whether oneDNN runs bfloat16 natively here (AVX512-BF16 or AMX); elsewhere it would emulate it."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _conv_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: int, dilation: int) -> torch.Tensor:
    """conv1d (stride 1, no padding) as weight [out, in*kernel] @ the kernel's shifted copies of x [B, in, T]."""
    batch, channels, length = x.shape
    steps = length - (kernel - 1) * dilation
    shifted = torch.stack([x[..., j * dilation : j * dilation + steps] for j in range(kernel)], dim=2)
    y = torch.matmul(weight, shifted.reshape(batch, channels * kernel, steps))
    return y if bias is None else y + bias.unsqueeze(-1)


def _transposed_conv_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int, out_channels: int
) -> torch.Tensor:
    """conv_transpose1d (no padding) as weight [out*taps, in] @ x, then each input step's `taps` outputs
    overlap-added stride by stride. Returns the first (T - 1) * stride + taps outputs (the full output, and
    for a kernel shorter than `taps` some trailing outputs that the caller never keeps)."""
    batch, _, length = x.shape
    pieces = weight.shape[0] // (out_channels * stride)
    cols = torch.matmul(weight, x).view(batch, out_channels, pieces, stride, length)
    out = cols[:, :, 0].transpose(-1, -2).contiguous()  # [B, out, T, stride]
    if pieces > 1:
        out = F.pad(out, (0, 0, 0, pieces - 1))
        for p in range(1, pieces):
            out[:, :, p : p + length] += cols[:, :, p].transpose(-1, -2)
    out = out.reshape(batch, out_channels, -1)
    return out if bias is None else out + bias.unsqueeze(-1)
