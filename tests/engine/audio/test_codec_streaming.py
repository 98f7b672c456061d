"""The streaming codec decoder must equal the official decoder's one-shot forward, whatever the chunking.

The decoder under test is the official module with tiny widths but the real structure (16 codebooks of 2048,
sliding window 72, upsampling 2 x 2 then 8 x 5 x 4 x 3 = 1920 samples per frame) and seeded random weights
scaled so that the audio is audible, unclipped, and depends on many frames of context.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen3tts_agent.engine.audio.codec import (
    StreamingCodecDecoder,
    channels_last_conv,
    channels_last_phase_split_conv,
    channels_last_weight,
    phase_split_conv,
)
from qwen3tts_agent.engine.runner import split_frames
from qwen3tts_agent.models.compat import import_qwen_tts

TOLERANCE = 1e-5
FRAMES = 150  # over twice the transformer's 72-frame window
SPF = 1920


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny ops gain nothing from threads; on a shared machine extra OpenMP threads only spin (30x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _init(name: str, param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random values that keep the signal near unit scale through the DAC stack: audio std ~0.03, peaks < 1."""
    shape = param.shape
    if name.endswith("cluster_usage"):
        return torch.rand(shape, generator=generator) * 1.5 + 0.5
    if name.endswith("embedding_sum"):  # zero-initialised upstream: silence
        return torch.randn(shape, generator=generator)
    if len(shape) >= 2:
        gain = 0.5 if name.startswith("decoder.") else 1.0
        return torch.randn(shape, generator=generator) * gain / math.sqrt(param[0].numel())
    if name.endswith(("alpha", "beta")):
        return torch.randn(shape, generator=generator) * 0.3
    if name.endswith(("scale", "gamma")):  # upstream 0.01 (LayerScale) / 1e-6 (ConvNeXt) hide the branches
        return torch.rand(shape, generator=generator) * 0.7 + 0.3
    if name.endswith("weight"):  # norms
        return torch.rand(shape, generator=generator) + 0.5
    return torch.randn(shape, generator=generator) * 0.05


@pytest.fixture(scope="module")
def decoder() -> torch.nn.Module:
    return tiny_decoder()


def tiny_decoder() -> torch.nn.Module:
    """The official decoder with tiny widths and the seeded weights of `_init` (also used by the kernel tests)."""
    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2DecoderConfig,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

    config = Qwen3TTSTokenizerV2DecoderConfig(
        hidden_size=32,
        latent_dim=32,
        codebook_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_hidden_layers=2,
        decoder_dim=32,
    )
    module = Qwen3TTSTokenizerV2Decoder(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(_init(name, param, generator))
    return module


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return torch.randint(0, 2048, (3, FRAMES, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference(decoder: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        audio = decoder(codes.transpose(1, 2)).squeeze(1)
    assert audio.shape == (3, FRAMES * SPF)
    assert audio.std().item() > 0.01 and audio.abs().max().item() < 1.0  # audible, never clamped
    return audio


def _stream(
    codec: StreamingCodecDecoder, slots: list[int], codes: torch.Tensor, sizes: list[int]
) -> torch.Tensor:
    chunks, start = [], 0
    for size in sizes:
        chunks.append(codec.decode(slots, codes[:, start : start + size]))
        start += size
    assert start == codes.shape[1]
    return torch.cat(chunks, dim=-1)


def _schedule(total: int, sizes: list[int]) -> list[int]:
    """Chunk sizes covering `total` frames; the last listed size repeats."""
    out: list[int] = []
    while sum(out) < total:
        out.append(min(sizes[min(len(out), len(sizes) - 1)], total - sum(out)))
    return out


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_one_frame_chunks_in_two_slots(decoder, codes, reference):
    codec = StreamingCodecDecoder(decoder, max_streams=4)
    audio = _stream(codec, [3, 1], codes[:2], [1] * FRAMES)
    assert audio.shape == (2, FRAMES * SPF)
    assert _max_error(audio, reference[:2]) < TOLERANCE


@pytest.mark.parametrize("schedule", ["growing", "random"])
def test_chunk_schedules(decoder, codes, reference, schedule):
    rng = random.Random(2)
    sizes = [1, 2, 4, 8] if schedule == "growing" else [rng.randint(1, 13) for _ in range(FRAMES)]
    codec = StreamingCodecDecoder(decoder, max_streams=3)
    audio = _stream(codec, [0, 1, 2], codes, _schedule(FRAMES, sizes))
    assert _max_error(audio, reference) < TOLERANCE


def test_streams_at_different_points_share_a_batch(decoder, codes, reference):
    """Slot 0 is 30 frames in when slot 2 starts; decoded together, neither sees the other's state."""
    codec = StreamingCodecDecoder(decoder, max_streams=3)
    head = _stream(codec, [0], codes[:1, :30], [5] * 6)
    both = torch.cat([codes[:1, 30:100], codes[1:2, :70]])
    tail = _stream(codec, [0, 2], both, _schedule(70, [7, 3]))
    assert _max_error(torch.cat([head[0], tail[0]]), reference[0, : 100 * SPF]) < TOLERANCE
    assert _max_error(tail[1], reference[1, : 70 * SPF]) < TOLERANCE


@pytest.mark.parametrize(("frames", "sizes", "pieces"), [(5, (1, 2, 4, 8), [4, 1]), (16, (1, 8), [8, 8]), (8, (8,), [8]), (7, (2, 8), [])])
def test_split_frames_cuts_chunks_into_graphed_sizes(frames, sizes, pieces):
    """A last chunk of any length decodes as graphed pieces (the decode above is the same however it is cut)."""
    assert split_frames(frames, sizes) == pieces


def test_reset_starts_a_fresh_stream(decoder, codes, reference):
    codec = StreamingCodecDecoder(decoder, max_streams=2)
    _stream(codec, [1], codes[2:3, :20], [4] * 5)
    codec.reset(1)
    audio = _stream(codec, [1], codes[1:2, :12], [1, 3, 8])
    assert _max_error(audio[0], reference[1, : 12 * SPF]) < TOLERANCE


# 5 frames: fewer than prime() takes to audio rate; 100: more, and more than the attention window in one call.
@pytest.mark.parametrize("ref_frames", [5, 100])
def test_prime_then_decode_is_the_tail_of_the_full_decode(decoder, codes, reference, ref_frames):
    codec = StreamingCodecDecoder(decoder, max_streams=2)
    assert 5 < codec.prime_frames < 72
    codec.prime(1, codes[2, :ref_frames])
    generated = 30
    both = torch.cat([codes[2:3, ref_frames : ref_frames + generated], codes[0:1, :generated]])
    audio = _stream(codec, [1, 0], both, _schedule(generated, [1, 2, 4, 8]))
    assert _max_error(audio[0], reference[2, ref_frames * SPF : (ref_frames + generated) * SPF]) < TOLERANCE
    assert _max_error(audio[1], reference[0, : generated * SPF]) < TOLERANCE


def test_snapshot_restores_a_primed_state_into_another_slot(decoder, codes, reference):
    """The engine primes a voice's reference codes once and restores that state for later streams."""
    codec = StreamingCodecDecoder(decoder, max_streams=3)
    ref_frames, generated = 40, 12
    codec.prime(0, codes[2, :ref_frames])
    state = codec.snapshot(0)
    _stream(codec, [0], codes[1:2, :generated], [4] * 3)  # slot 0 moves on; the snapshot must not
    _stream(codec, [2], codes[0:1, :20], [5] * 4)  # slot 2 holds another stream's state
    codec.restore(2, state)
    audio = _stream(codec, [2], codes[2:3, ref_frames : ref_frames + generated], [1, 3, 8])
    assert _max_error(audio[0], reference[2, ref_frames * SPF : (ref_frames + generated) * SPF]) < TOLERANCE


def test_independent_chunks_are_not_exact(decoder, codes, reference):
    """Guards the other tests' power: this model's audio depends on earlier chunks well beyond 1e-5."""
    with torch.no_grad():
        naive = torch.cat(
            [decoder(codes[:1, i : i + 8].transpose(1, 2)) for i in range(0, FRAMES, 8)], dim=-1
        )
    assert _max_error(naive[0, 0], reference[0]) > 1e-2


def test_rejects_bad_calls(decoder, codes):
    codec = StreamingCodecDecoder(decoder, max_streams=2)
    with pytest.raises(ValueError, match="distinct"):
        codec.decode([0, 0], codes[:2, :1])
    with pytest.raises(ValueError, match="outside"):
        codec.decode([0, 2], codes[:2, :1])
    with pytest.raises(ValueError, match="codes must be"):
        codec.decode([0], codes[:1, :1, :8])
    with pytest.raises(ValueError, match="slots must have shape"):
        codec.decode(torch.tensor([0]), codes[:2, :1])


def test_synthetic_tiny_speech_tokenizer_matches_official_decode():
    """The decoder loaded through the official wrapper, against the wrapper's own `decode`."""
    from qwen3tts_agent.models.synthetic import ensure_synthetic_checkpoint

    qwen_tts = import_qwen_tts()
    folder = ensure_synthetic_checkpoint("synthetic:tiny", progress=False)
    tokenizer = qwen_tts.Qwen3TTSTokenizer.from_pretrained(str(folder / "speech_tokenizer"), device_map="cpu")
    frames = 100
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(3))
    wavs, sample_rate = tokenizer.decode({"audio_codes": codes[None]})
    assert sample_rate == 24000 and wavs[0].shape == (frames * SPF,)

    codec = StreamingCodecDecoder(tokenizer.model.decoder, max_streams=1)
    codec.prime(0, codes[:20])
    audio = _stream(codec, [0], codes[None, 20:], _schedule(frames - 20, [1, 2, 4, 8]))
    assert np.abs(audio[0].numpy() - wavs[0][20 * SPF :]).max() < TOLERANCE


@pytest.mark.parametrize(("channels", "out", "kernel", "dilation", "length"), [
    (8, 5, 7, 9, 200), (8, 8, 7, 9, 55), (4, 4, 7, 3, 31), (6, 6, 3, 2, 9), (5, 3, 7, 9, 55),
])
def test_phase_split_conv_equals_the_dilated_conv(channels: int, out: int, kernel: int, dilation: int, length: int) -> None:
    """The dilated conv run undilated over its phases gives the same output, whatever the length's remainder; so
    does the channels-last form (without the bias, which the codec's epilogue kernels add themselves), whose
    output has its channels contiguous."""
    torch.manual_seed(dilation * length)
    conv = torch.nn.Conv1d(channels, out, kernel, dilation=dilation).double()
    x = torch.randn(3, channels, length, dtype=torch.double)
    with torch.no_grad():
        expected, got = conv(x), phase_split_conv(conv, x)
        channels_last_x = x.transpose(1, 2).contiguous().transpose(1, 2)
        unbiased = channels_last_phase_split_conv(conv, channels_last_x, channels_last_weight(conv))
    assert got.shape == expected.shape and (got.stride(-1) == 1 or length - (kernel - 1) * dilation == 1)
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    assert unbiased.shape == expected.shape and unbiased.stride(1) == 1
    assert torch.allclose(unbiased + conv.bias[:, None], expected, rtol=0, atol=1e-12)


class _AtenOps(TorchDispatchMode):
    """The names of the ATen ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("length", "pads"), [(6 * 9 + 36, False), (6 * 9 + 40, True)], ids=["whole", "padded"])
def test_the_channels_last_phase_split_copies_nothing_but_its_padding(length: int, pads: bool) -> None:
    """The phases are a view of the channels-last input and the interleaved outputs a view of the convolution's:
    no op copies an operand but the padding of time to whole phases, and none where the outputs fill them."""
    conv = torch.nn.Conv1d(8, 8, 7, dilation=9)
    x = torch.randn(2, length, 8).transpose(1, 2)  # [B, C, T] stored as [B, T, C]
    weight = channels_last_weight(conv)
    with torch.no_grad(), _AtenOps() as ops:
        channels_last_phase_split_conv(conv, x, weight)
    copies = [name for name in ops.names if name in ("clone", "copy_", "_to_copy", "contiguous", "constant_pad_nd")]
    assert copies == (["constant_pad_nd"] if pads else []), ops.names


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_channels_last_conv_equals_the_module(transposed: bool) -> None:
    """A (transposed) convolution on channels-contiguous operands, as the codec's epilogue path runs its audio-rate
    convolutions, gives the module's output without the bias (which the epilogue adds), channels contiguous."""
    torch.manual_seed(7)
    conv: torch.nn.Module = (
        torch.nn.ConvTranspose1d(6, 4, 10, stride=5) if transposed else torch.nn.Conv1d(6, 4, 7, dilation=3)
    ).double()
    x = torch.randn(2, 6, 40, dtype=torch.double)
    channels_last_x = x.transpose(1, 2).contiguous().transpose(1, 2)
    with torch.no_grad():
        expected = conv(x)
        unbiased = channels_last_conv(conv, channels_last_x, channels_last_weight(conv))
    assert unbiased.shape == expected.shape and unbiased.stride(1) == 1
    assert torch.allclose(unbiased + conv.bias[:, None], expected, rtol=0, atol=1e-12)


def test_phase_split_covers_the_decoders_widest_dilations(decoder: torch.nn.Module) -> None:
    """The streaming tests above run the split path: the decoder's dilation-9 convolutions take it."""
    codec = StreamingCodecDecoder(decoder, max_streams=1)
    dilations = sorted(module.conv.dilation[0] for module in codec._phase_split)
    assert dilations and set(dilations) == {9}
