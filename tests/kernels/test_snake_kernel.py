"""The fused SnakeBeta kernel equals the official module, alone and inside the streaming codec decoder.

On a GPU both sides use the same sinf and roundings: the results are equal. Under the interpreter numpy's
float32 sin may differ from PyTorch's CPU sin in the last bit, so fp32 is compared to 1e-6; and the
interpreter converts to bf16 by truncation where PyTorch rounds to nearest, so bf16 is compared in units in
the last place (four truncated intermediates, the first one scaled by up to 1/β on its way to the output).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qwen3tts_agent.engine.audio import StreamingCodecDecoder
from qwen3tts_agent.kernels import snake
from qwen3tts_agent.models.compat import import_qwen_tts
from tests.engine.audio.test_codec_streaming import TOLERANCE, tiny_decoder


def _module(channels: int, dtype: torch.dtype, device: str) -> nn.Module:
    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import SnakeBeta

    module = SnakeBeta(channels)
    generator = torch.Generator().manual_seed(channels)
    with torch.no_grad():
        module.alpha.copy_(torch.randn(channels, generator=generator) * 0.5)
        module.beta.copy_(torch.randn(channels, generator=generator) * 0.5)
    return module.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("channels", [5, 64])
def test_activation_equals_the_module(device: str, dtype: torch.dtype, layout: str, channels: int) -> None:
    """[2, C, 1500] (time not a whole number of blocks), or a channel slice of a wider tensor (strided); the
    output contiguous either way."""
    module = _module(channels, dtype, device)
    assert snake.supports(module)
    wide = (torch.randn(2, channels + 4, 1500, generator=torch.Generator().manual_seed(7)) * 3).to(device, dtype)
    x = wide[:, :channels].contiguous() if layout == "contiguous" else wide[:, 2 : 2 + channels]
    with torch.no_grad():
        fused = snake.FusedSnakeBeta(module)(x)
        expected, got = module(x).float(), fused.float()
    assert fused.is_contiguous()
    assert float((x.float() - got).abs().max()) > 0.01, "the activation did nothing: the comparison would be vacuous"
    if device == "cuda":
        assert torch.equal(got, expected)
    elif dtype == torch.float32:
        assert float((got - expected).abs().max()) < 1e-6
    else:  # x + bump may cancel: count units in the last place of the larger operand
        ulp = torch.finfo(dtype).eps * torch.maximum(x.float().abs(), expected.abs()).clamp(min=1e-3)
        assert float(((got - expected).abs() / ulp).max()) <= 12


def test_streaming_codec_on_its_kernels() -> None:
    """Two chunks of two streams through the streaming decoder on every kernel it takes where Triton runs (the
    activations, the codebook sums, the convolutions' histories) against the official one-shot decode."""
    torch.set_num_threads(1)
    decoder = tiny_decoder()
    codes = torch.randint(0, 2048, (2, 3, 16), generator=torch.Generator().manual_seed(1))
    codec = StreamingCodecDecoder(decoder, max_streams=3)
    assert codec._snakes and all(isinstance(f, snake.FusedSnakeBeta) for f in codec._snakes.values())
    assert codec._codebooks.path == "triton" and all(h._fused for h in codec._convs.values())
    with torch.no_grad():
        reference = decoder(codes.transpose(1, 2)).squeeze(1)
        streamed = torch.cat([codec.decode([2, 0], codes[:, :1]), codec.decode([2, 0], codes[:, 1:])], dim=-1)
    assert float((streamed - reference).abs().max()) < TOLERANCE


def test_supports_refuses_an_untested_dtype() -> None:
    """A SnakeBeta in a dtype the kernel is not tested in is refused with a reason (the codec keeps the module)."""
    module = _module(4, torch.float16, "cpu")
    support = snake.supports(module)
    assert not support and "float16" in support.reason
