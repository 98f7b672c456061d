"""`CodebookTables`: the official split quantizer's decode with its tables computed once, equal to the module's."""

from __future__ import annotations

import pytest
import torch

from qwen3tts_agent.engine.audio.codebooks import CodebookTables
from tests.engine.audio.test_codec_streaming import tiny_decoder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_lookups_equal_the_quantizers_decode(dtype: torch.dtype) -> None:
    """Same tables, same order of sums, same dtype: the same latent, value for value (in bf16 too, where every
    partial sum is rounded), whatever the codes' layout."""
    quantizer = tiny_decoder().quantizer.to(dtype)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # usage counts far from one, so the tables differ from embedding_sum
        for book in (layer._codebook for group in (quantizer.rvq_first, quantizer.rvq_rest) for layer in group.vq.layers):
            book.cluster_usage.copy_(torch.rand(book.cluster_usage.shape, generator=generator) * 3 + 0.01)
    tables = CodebookTables(quantizer)
    assert tables.num_quantizers == 16
    codes = torch.randint(0, 2048, (3, 16, 7), generator=generator).transpose(1, 2)  # [B, T, Q], not contiguous
    with torch.no_grad():
        expected = quantizer.decode(codes.transpose(1, 2))
        got = tables.decode(codes)
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    assert expected.abs().max() > 0.1 and torch.equal(got, expected)


def test_a_codebook_with_its_own_projection_is_refused() -> None:
    quantizer = tiny_decoder().quantizer
    layer = quantizer.rvq_rest.vq.layers[3]
    width = layer._codebook.embedding_sum.shape[1]
    layer.project_out = torch.nn.Linear(width, width)
    with pytest.raises(ValueError, match="projection of its own"):
        CodebookTables(quantizer)
