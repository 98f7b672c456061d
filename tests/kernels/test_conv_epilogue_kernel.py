"""The conv epilogue kernel equals the PyTorch ops it replaces (bias added to the convolution's output, a residual
added, the official SnakeBeta module), alone and inside the streaming codec decoder.

On a GPU both sides round alike: the results are equal. Under the interpreter the sums are still exact, but numpy's
float32 sin may differ from PyTorch's in the last bit, so the activation is compared in units in the last place; and
the interpreter converts to bf16 by truncation where PyTorch rounds to nearest, so there the bf16 reference
truncates each stored intermediate too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qwen3tts_agent.engine.audio import StreamingCodecDecoder
from qwen3tts_agent.kernels import conv_epilogue
from qwen3tts_agent.models.compat import import_qwen_tts
from tests.engine.audio.test_codec_streaming import SPF, TOLERANCE, tiny_decoder


def _module(channels: int, dtype: torch.dtype, device: str) -> nn.Module:
    """An official SnakeBeta with seeded α and β."""
    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import SnakeBeta

    module = SnakeBeta(channels)
    generator = torch.Generator().manual_seed(channels)
    with torch.no_grad():
        module.alpha.copy_(torch.randn(channels, generator=generator) * 0.5)
        module.beta.copy_(torch.randn(channels, generator=generator) * 0.5)
    return module.to(device, dtype)


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 x cut to bf16's precision by truncation, as Triton's interpreter converts."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _reference(
    epilogue: conv_epilogue.ConvEpilogue, snake: nn.Module, raw: torch.Tensor, residual: torch.Tensor | None,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, activation) by the PyTorch ops, or, with `truncate`, in fp32 with every stored step truncated."""
    bias = epilogue.bias[:, None]
    if not truncate:
        total = raw + bias if residual is None else (raw + bias) + residual
        return total.float(), snake(total).float()
    cut = _truncated
    total = cut(raw.float() + bias.float())
    if residual is not None:
        total = cut(total + residual.float())
    scaled = cut(total * epilogue.alpha.float()[:, None])
    sine = cut(torch.sin(scaled))
    bump = cut(epilogue.inv_beta.float()[:, None] * cut(sine * sine))
    return total, cut(total + bump)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("residual", [False, True], ids=["bias", "bias+residual"])
@pytest.mark.parametrize(("channels", "length"), [(5, 1500), (64, 8), (24, 2048)])
def test_the_kernel_equals_the_ops(device: str, dtype: torch.dtype, residual: bool, channels: int, length: int) -> None:
    """raw a slice in time of a longer output (as a transposed convolution's is), out the chunk's part of a wider
    buffer behind a history (as the next convolution's input is); time not a whole number of blocks."""
    generator = torch.Generator().manual_seed(channels)
    torch.manual_seed(channels)  # the conv's bias, whatever ran before
    conv = nn.Conv1d(channels, channels, 1).to(device, dtype)
    snake = _module(channels, dtype, device)
    epilogue = conv_epilogue.ConvEpilogue(conv, snake)
    raw = (torch.randn(2, channels, length + 9, generator=generator) * 3).to(device, dtype)[..., 4 : 4 + length]
    res = (torch.randn(2, channels, length, generator=generator) * 3).to(device, dtype) if residual else None
    full = torch.zeros(2, channels, 6 + length, device=device, dtype=dtype)
    total = epilogue(raw, full[..., 6:], residual=res, keep_sum=True)
    assert total is not None and total.is_contiguous()
    assert torch.equal(full[..., :6], torch.zeros_like(full[..., :6])), "wrote into the history's room"
    truncate = device == "cpu" and dtype == torch.bfloat16
    expected_total, expected = _reference(epilogue, snake, raw, res, truncate)
    got = full[..., 6:].float()
    assert float((got - raw.float()).abs().max()) > 0.01, "the epilogue did nothing: the comparison would be vacuous"
    if device == "cuda":
        assert torch.equal(total.float(), expected_total) and torch.equal(got, expected)
        return
    assert torch.equal(total.float(), expected_total)  # additions only: exact in either mode
    # fp32: two sins a unit or two apart in the last place, squared and scaled by 1/β, are a few units of the bump,
    # which is at most twice the larger of the activation's input and output (the two may cancel); bf16: that fp32
    # difference rarely moves a truncation
    ulp = torch.finfo(dtype).eps * torch.maximum(expected_total.abs(), expected.abs()).clamp(min=1e-3)
    assert float(((got - expected).abs() / ulp).max()) <= (8 if dtype == torch.float32 else 2)


@torch.no_grad()
def test_without_keeping_the_sum_it_writes_the_activation_only(device: str) -> None:
    channels = 8
    conv = nn.Conv1d(channels, channels, 3).to(device)
    snake = _module(channels, torch.float32, device)
    raw = torch.randn(3, channels, 40, generator=torch.Generator().manual_seed(3)).to(device)
    out = torch.empty_like(raw)
    assert conv_epilogue.ConvEpilogue(conv, snake)(raw, out) is None
    expected = snake(raw + conv.bias[:, None])
    assert float(((out - expected).abs() / expected.abs().clamp(min=1.0)).max()) < 1e-6


def test_supports_names_what_it_refuses() -> None:
    snake = _module(4, torch.float32, "cpu")
    assert conv_epilogue.supports(nn.Conv1d(4, 4, 3), snake)
    assert "bias" in conv_epilogue.supports(nn.Conv1d(4, 4, 3, bias=False), snake).reason
    assert "shape" in conv_epilogue.supports(nn.Conv1d(4, 6, 3), snake).reason
    assert "float16" in conv_epilogue.supports(nn.Conv1d(4, 4, 3).half(), _module(4, torch.float16, "cpu")).reason
    with pytest.raises(ValueError, match="bias"):
        conv_epilogue.ConvEpilogue(nn.Conv1d(4, 4, 3, bias=False), snake)


def test_rejects_mismatched_shapes() -> None:
    epilogue = conv_epilogue.ConvEpilogue(nn.Conv1d(4, 4, 3), _module(4, torch.float32, "cpu"))
    raw = torch.zeros(2, 4, 10)
    with pytest.raises(ValueError, match="one shape"):
        epilogue(raw, torch.zeros(2, 4, 9))
    with pytest.raises(ValueError, match="residual"):
        epilogue(raw, torch.zeros(2, 4, 10), residual=torch.zeros(2, 4, 20)[..., :10])


def test_streaming_codec_on_its_kernels() -> None:
    """A primed slot and two fresh ones through the streaming decoder on every kernel it takes where Triton runs
    (the epilogues, the codebook sums, the convolutions' histories), in chunks of 1 and 2 frames, against the
    official one-shot decode: the state each epilogue leaves behind the next convolution's history carries over."""
    torch.set_num_threads(1)
    decoder = tiny_decoder()
    codes = torch.randint(0, 2048, (3, 6, 16), generator=torch.Generator().manual_seed(1))
    codec = StreamingCodecDecoder(decoder, max_streams=3, fused_audio=True)
    assert codec.audio_path == "triton" and len(codec._epilogues) == len(codec._stages) > 0
    assert codec._codebooks.path == "triton" and all(h.fused for h in codec._convs.values() if h.size)
    with torch.no_grad():
        reference = decoder(codes.transpose(1, 2)).squeeze(1)
        codec.prime(1, codes[1, :3])
        slots, rows = [2, 0, 1], [0, 2, 1]
        streamed = torch.cat([
            codec.decode(slots, torch.stack([codes[0, 0:1], codes[2, 0:1], codes[1, 3:4]])),
            codec.decode(slots, torch.stack([codes[0, 1:3], codes[2, 1:3], codes[1, 4:6]])),
        ], dim=-1)
    for got, row in zip(streamed[:2], rows[:2], strict=True):
        assert float((got - reference[row, : 3 * SPF]).abs().max()) < TOLERANCE
    assert float((streamed[2] - reference[1, 3 * SPF :]).abs().max()) < TOLERANCE


def test_the_codec_names_why_it_keeps_the_modules() -> None:
    """Without Triton on the device (here: asked off) the audio half runs the modules, and says why; asking for
    the kernels where the decoder has a stage they refuse fails with the reason."""
    decoder = tiny_decoder()
    assert StreamingCodecDecoder(decoder, max_streams=1, fused_audio=False).audio_path == "pytorch (fused audio off)"
    assert StreamingCodecDecoder(decoder, max_streams=1)._epilogues == []  # None: a GPU only, not the interpreter
    decoder.decoder[0].conv.bias = None
    with pytest.raises(ValueError, match="without a bias"):
        StreamingCodecDecoder(decoder, max_streams=1, fused_audio=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_on_a_gpu_the_epilogues_give_the_modules_audio_exactly(dtype: torch.dtype) -> None:
    """cuDNN leaves a convolution's bias out, so the modules' path on a GPU rounds exactly as the epilogue: the same
    convolutions, then the bias, the residual and the activation with the same roundings. A primed slot and fresh
    ones, chunks of 1, 2 and 5 frames: the audio is bit for bit the modules'."""
    decoder = tiny_decoder().to("cuda", dtype)
    codes = torch.randint(0, 2048, (3, 12, 16), generator=torch.Generator().manual_seed(2)).cuda()
    audio = []
    for fused in (True, False):
        codec = StreamingCodecDecoder(decoder, max_streams=3, fused_audio=fused)
        assert (codec.audio_path == "triton") == fused
        with torch.no_grad():
            codec.prime(1, codes[1, :4])
            audio.append(torch.cat([codec.decode([2, 0, 1], codes[:, start:end]) for start, end in ((0, 1), (1, 3), (3, 8))], -1))
    assert float(audio[1].float().abs().max()) > 0.01
    assert torch.equal(audio[0], audio[1])
