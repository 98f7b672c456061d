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
from torch.nn import functional as F

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
@pytest.mark.parametrize("channels_last", [False, True], ids=["time-contiguous", "channels-contiguous"])
def test_the_kernel_equals_the_ops(
    device: str, dtype: torch.dtype, residual: bool, channels: int, length: int, channels_last: bool,
) -> None:
    """raw a slice in time of a longer output (as a transposed convolution's is), out the chunk's part of a wider
    buffer behind a history (as the next convolution's input is); time not a whole number of blocks. Either all
    time-contiguous, or all channels-contiguous as the codec's channels-last convolutions read and write them."""
    generator = torch.Generator().manual_seed(channels)
    torch.manual_seed(channels)  # the conv's bias, whatever ran before
    conv = nn.Conv1d(channels, channels, 1).to(device, dtype)
    snake = _module(channels, dtype, device)
    epilogue = conv_epilogue.ConvEpilogue(conv, snake)

    def layout(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).contiguous().transpose(1, 2) if channels_last else x

    raw = layout((torch.randn(2, channels, length + 9, generator=generator) * 3).to(device, dtype))[..., 4 : 4 + length]
    res = layout((torch.randn(2, channels, length, generator=generator) * 3).to(device, dtype)) if residual else None
    full = layout(torch.zeros(2, channels, 6 + length, device=device, dtype=dtype))
    total = epilogue(raw, full[..., 6:], residual=res, keep_sum=True)
    assert total is not None and total.transpose(1, 2).is_contiguous() == channels_last
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
        epilogue(raw, torch.zeros(2, 4, 10), residual=torch.zeros(2, 4, 9))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("channels", "taps", "dilation", "bias"), [(96, 7, 1, True), (5, 3, 2, False), (40, 1, 1, True)])
@pytest.mark.parametrize("channels_last", [False, True], ids=["time-contiguous", "channels-contiguous"])
def test_the_output_conv_equals_the_module_and_clamp(
    device: str, dtype: torch.dtype, channels: int, taps: int, dilation: int, bias: bool, channels_last: bool,
) -> None:
    """The decoder's last convolution (to one channel) and its clamp on the input as the codec holds it: a history
    and a chunk, channels or time steps contiguous, time not a whole number of blocks. The kernel sums the taps and
    channels in another order than the convolution, so the two agree to a rounding of the sum: in bf16 one unit in
    the last place of the conv's output (rounded there before the bias, as PyTorch stores it) and one of the sum
    with the bias (two under the interpreter, which truncates)."""
    generator = torch.Generator().manual_seed(channels)
    torch.manual_seed(channels)
    conv = nn.Conv1d(channels, 1, taps, dilation=dilation, bias=bias).to(device, dtype)
    output = conv_epilogue.OutputConv(conv)
    steps = 300 + (taps - 1) * dilation
    x = (torch.randn(2, channels, steps, generator=generator) * 2).to(device, dtype)
    if channels_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    got = output(x)
    # fp64, not the module (TF32 on a GPU in fp32); in bf16 the module's output rounded as PyTorch stores it
    unbiased = F.conv1d(x.double(), conv.weight.double(), dilation=dilation).float()
    if dtype == torch.bfloat16 and device == "cuda":
        unbiased = unbiased.to(dtype).float()
    reference = unbiased if conv.bias is None else unbiased + conv.bias.float()
    expected = reference.clamp(-1, 1)
    assert got.shape == expected.shape == (2, 1, 300) and got.dtype == dtype
    assert 0.05 < float((expected.abs() < 1).float().mean()) < 0.95, "all or nothing clamped: a vacuous comparison"
    scale = float(reference.abs().max())
    eps = torch.finfo(dtype).eps
    tolerance = 1e-5 * scale if dtype == torch.float32 else 2 * eps * (unbiased.abs() + expected.abs()) + 1e-6 * scale
    assert bool(((got.float() - expected).abs() <= tolerance).all())


def test_the_output_conv_refuses_what_it_does_not_compute() -> None:
    assert conv_epilogue.supports_output(nn.Conv1d(8, 1, 7))
    assert "2 channels" in conv_epilogue.supports_output(nn.Conv1d(8, 2, 7)).reason
    assert "ConvTranspose1d" in conv_epilogue.supports_output(nn.ConvTranspose1d(8, 1, 4, stride=2)).reason
    assert "float16" in conv_epilogue.supports_output(nn.Conv1d(8, 1, 7).half()).reason
    output = conv_epilogue.OutputConv(nn.Conv1d(8, 1, 7))
    with pytest.raises(ValueError, match="8 channels"):
        output(torch.zeros(1, 4, 20))
    with pytest.raises(ValueError, match="span"):
        output(torch.zeros(1, 8, 6))


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
def test_on_a_gpu_the_epilogues_give_the_modules_audio(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A primed slot and fresh ones, chunks of 1, 2 and 5 frames, on the epilogues' path and the modules'. The
    epilogues round as the modules' ops do (the kernel tests check that bit for bit), but the convolutions run
    channels-last there, where cuDNN may pick other kernels, which sum in another order: in fp32 (TF32 off) both
    paths give the official one-shot decode; in bf16 they stay within a few roundings of each other."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    decoder = tiny_decoder().to("cuda", dtype)
    codes = torch.randint(0, 2048, (3, 12, 16), generator=torch.Generator().manual_seed(2)).cuda()
    chunks = ((0, 1), (1, 3), (3, 8))
    audio = []
    for fused in (True, False):
        codec = StreamingCodecDecoder(decoder, max_streams=3, fused_audio=fused)
        assert (codec.audio_path == "triton") == fused
        with torch.no_grad():
            codec.prime(1, codes[1, :4])
            audio.append(torch.cat([codec.decode([2, 0, 1], codes[:, start:end]) for start, end in chunks], -1).float())
    peak = float(audio[1].abs().max())
    assert peak > 0.01
    if dtype == torch.float32:
        with torch.no_grad():
            fresh = decoder(codes[:2, :8].transpose(1, 2)).squeeze(1).float()  # slots 2 and 0
            continued = torch.cat([codes[1, :4], codes[2, :8]])[None]  # slot 1: primed, then the third row's codes
            primed = decoder(continued.transpose(1, 2)).squeeze(1).float()[:, 4 * SPF :]
        expected = torch.cat([fresh, primed], 0)
        for got in audio:
            assert float((got - expected).abs().max()) < 1e-4
    else:
        assert float((audio[0] - audio[1]).abs().mean()) < 0.01 * float(audio[1].abs().mean())
        assert float((audio[0] - audio[1]).abs().max()) < 0.1 * peak
