"""The history kernel continues a causal convolution's input history exactly as the gather, concatenation and
scatter it replaces (`engine/audio/codec.py`, `SlotHistory`); inside the codec: tests/kernels/test_conv_epilogue_kernel.py,
`test_streaming_codec_on_its_kernels`."""

from __future__ import annotations

import pytest
import torch

from qwen3tts_agent.kernels import history


def _buffer(slots: int, channels: int, steps: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(slots, channels, steps, generator=torch.Generator().manual_seed(steps)).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("channels", "hist_len", "steps"), [(40, 54, 130), (96, 6, 4), (5, 2, 1), (33, 16, 16), (8, 100, 300)])
@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in-place"])
def test_the_kernel_equals_gather_cat_scatter(
    device: str, dtype: torch.dtype, channels: int, hist_len: int, steps: int, in_place: bool,
) -> None:
    """Histories longer and shorter than the chunk (the new one then keeps part of the old), channels not a whole
    block, slots out of order, and x a slice of a wider tensor, as the codec's transposed convolutions give; or
    (`complete_history`) the chunk already written behind the history's room, which must not be touched."""
    buffer = _buffer(6, channels, hist_len, dtype, device)
    expected_buffer = buffer.clone()
    slots = torch.tensor([4, 0, 2], device=device)
    x = _buffer(3, channels, steps + 3, dtype, device)[..., 1 : 1 + steps]
    expected = torch.cat([expected_buffer.index_select(0, slots), x], dim=-1)
    expected_buffer.index_copy_(0, slots, expected[..., -hist_len:])
    assert history.supports(buffer)
    if in_place:
        full = torch.full((3, channels, hist_len + steps), float("nan"), device=device, dtype=dtype)
        full[..., hist_len:] = x
        got = history.complete_history(buffer, slots, full)
        assert got is full
    else:
        got = history.extend_history(buffer, slots, x)
    assert got.is_contiguous() and torch.equal(got, expected)
    assert torch.equal(buffer, expected_buffer)  # slots 1, 3 and 5 untouched, the others' new histories
