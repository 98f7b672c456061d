"""The codebook-sum kernel equals the PyTorch lookups (`engine/audio/codebooks.py`) (inside the codec:
tests/kernels/test_conv_epilogue_kernel.py, `test_streaming_codec_on_its_kernels`).

On a GPU both sides round every partial sum the same way: the results are equal. Under the interpreter bf16 is
converted by truncation where PyTorch rounds to nearest, so there the reference truncates its partial sums too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen3tts_agent.kernels import codebooks


def _reference(codes: torch.Tensor, first: int, tables: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    """The PyTorch lookups; `truncate`: each bf16 partial sum cut to bf16 by truncation, as Triton's interpreter
    converts, instead of rounded."""
    summed = F.embedding(codes[..., first], tables[0])
    for i in range(1, len(tables)):
        row = F.embedding(codes[..., first + i], tables[i])
        if truncate:
            exact = (summed.float() + row.float()).view(torch.int32) & -(1 << 16)  # the bf16 bits of the fp32 sum
            summed = exact.view(torch.float32).to(tables.dtype)
        else:
            summed = summed + row
    return summed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("batch", "frames", "width"), [(1, 1, 256), (3, 7, 200)])
def test_the_sum_equals_the_lookups(device: str, dtype: torch.dtype, batch: int, frames: int, width: int) -> None:
    """15 codebooks from the second of 16 (the acoustic group), codes sliced from a wider buffer as the codec's
    graphs hold them; rows and width not whole blocks."""
    generator = torch.Generator().manual_seed(width)
    tables = torch.randn(15, 300, width, generator=generator).to(device, dtype)
    buffer = torch.randint(0, 300, (batch + 1, frames + 2, 16), generator=generator).to(device)
    codes = buffer[:batch, :frames]
    assert codebooks.supports(tables)
    truncate = device == "cpu" and dtype == torch.bfloat16
    expected = _reference(codes, 1, tables, truncate=truncate)
    got = codebooks.codebook_sum(codes, 1, tables)
    assert got.shape == (batch, frames, width) and got.dtype == dtype
    assert torch.equal(got, expected)
