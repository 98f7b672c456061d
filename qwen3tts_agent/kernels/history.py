"""A causal convolution's input history, continued in one Triton pass (`extend_history`) instead of three kernels.

The streaming codec keeps each convolution's last `H` input steps per slot (`engine/audio/codec.py`,
`SlotHistory`): a chunk's convolution reads the slots' histories followed by the chunk, and the last `H` steps of
that become the new histories. In PyTorch that is a gather of the histories, a concatenation and a scatter back,
three kernels per convolution and some sixty per codec call. Here one program per (stream, block of channels,
block of time) writes its block of the concatenation; a block holds the whole history, so the first block's
program is the only one that reads a slot's history, and it writes the new one after every read of the old
(the slots of a call are distinct). Tensors are [B, C, time] with any strides: a chunk need not be contiguous.

Where the op before the convolution already wrote the chunk behind the room for the history (`kernels.conv_epilogue`
does), `complete_history` runs the first block's programs alone: they copy the histories in and keep the new ones,
and the chunk is not copied at all.
"""

from __future__ import annotations

import torch

from . import common
from .common import jit

try:
    import triton
    import triton.language as tl
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

BLOCK_C, BLOCK_T = 32, 64  # BLOCK_T: at least; a longer history takes a block of its length


@jit
def _extend_kernel(
    hist_ptr, x_ptr, full_ptr, slots_ptr, channels, hist_len, x_len,
    stride_hs, stride_hc, stride_ht, stride_xb, stride_xc, stride_xt, stride_fb, stride_fc, stride_ft,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, X_IN_FULL: tl.constexpr,
):
    """X_IN_FULL: x is full's own tail (already written): only the history's steps are stored into full."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    first_block = tl.program_id(2) == 0
    ok_c = (c < channels)[:, None]
    slot = tl.load(slots_ptr + b)
    hist = hist_ptr + slot.to(tl.int64) * stride_hs + c[:, None].to(tl.int64) * stride_hc
    x = x_ptr + b.to(tl.int64) * stride_xb + c[:, None].to(tl.int64) * stride_xc
    full = full_ptr + b.to(tl.int64) * stride_fb + c[:, None].to(tl.int64) * stride_fc
    # this block of the concatenation: the history, then x (the history lies in the first block: BLOCK_T >= H)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    ok = ok_c & (t < hist_len + x_len)
    from_hist = tl.load(hist + t.to(tl.int64) * stride_ht, mask=ok & (t < hist_len), other=0.0)
    if X_IN_FULL:
        tl.store(full + t.to(tl.int64) * stride_ft, from_hist, mask=ok & (t < hist_len))
    else:
        from_x = tl.load(x + (t - hist_len).to(tl.int64) * stride_xt, mask=ok & (t >= hist_len), other=0.0)
        tl.store(full + t.to(tl.int64) * stride_ft, tl.where(t < hist_len, from_hist, from_x), mask=ok)
    if first_block:  # the one program of this slot and channel block that reads the old history writes the new
        j = tl.arange(0, BLOCK_T)[None, :]  # new step j = the concatenation's step x_len + j
        src = x_len + j
        keep = ok_c & (j < hist_len)
        older = tl.load(hist + src.to(tl.int64) * stride_ht, mask=keep & (src < hist_len), other=0.0)
        newer = tl.load(x + (src - hist_len).to(tl.int64) * stride_xt, mask=keep & (src >= hist_len), other=0.0)
        tl.debug_barrier()  # every thread's reads of the old history before any thread's write of the new
        tl.store(hist + j.to(tl.int64) * stride_ht, tl.where(src < hist_len, older, newer), mask=keep)


def supports(history: torch.Tensor) -> common.Support:
    """Whether a history buffer [slots, channels, steps] can be extended by the kernel here."""
    if not common.available(history.device):
        return common.unsupported(f"no Triton kernels on {history.device.type}")
    if history.dim() != 3 or history.shape[2] > 256:
        return common.unsupported(f"a history of shape {tuple(history.shape)} (at most 256 steps) not supported")
    return common.dtype_support(history.dtype)


def extend_history(history: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """history[slots] followed by x ([B, C, T]), as a new contiguous [B, C, H + T]; its last H steps become the
    slots' new history (history [S, C, H], updated in place). `slots`: B distinct int64 slots on the device."""
    batch, channels, steps = x.shape
    hist_len = history.shape[2]
    full = torch.empty(batch, channels, hist_len + steps, device=x.device, dtype=x.dtype)
    block_t = max(BLOCK_T, triton.next_power_of_2(hist_len))  # the whole history in a program's block
    grid = (batch, triton.cdiv(channels, BLOCK_C), triton.cdiv(hist_len + steps, block_t))
    _extend_kernel[grid](
        history, x, full, slots, channels, hist_len, steps, *history.stride(), *x.stride(), *full.stride(),
        BLOCK_C=BLOCK_C, BLOCK_T=block_t, X_IN_FULL=False,
    )
    return full


def complete_history(history: torch.Tensor, slots: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`extend_history` where full [B, C, H + T] (any strides) already holds the chunk in its last T steps:
    write history[slots] into its first H steps, and make its last H steps the slots' new history. Returns `full`."""
    batch, channels, length = full.shape
    hist_len = history.shape[2]
    x = full[..., hist_len:]
    block_t = max(BLOCK_T, triton.next_power_of_2(hist_len))
    _extend_kernel[(batch, triton.cdiv(channels, BLOCK_C), 1)](  # the first time block alone: the history's
        history, x, full, slots, channels, hist_len, length - hist_len, *history.stride(), *x.stride(), *full.stride(),
        BLOCK_C=BLOCK_C, BLOCK_T=block_t, X_IN_FULL=True,
    )
    return full
