"""The codec transformer's kernels (`kernels.codec_layer`) against the eager ops, alone and inside the decoder.

RoPE, the key/value window and SiLU·up use the same IEEE operations as the eager ops: on a GPU they are
equal, and so is RoPE in fp32 under the interpreter (SiLU's exp comes from numpy there, so fp32 is compared
to an ulp). RMSNorm sums its squares in another order than PyTorch's reduction, so it is compared to a few
ulps. The interpreter converts to bf16 by truncation where PyTorch rounds to nearest, so interpreted bf16
results are compared in units in the last place of their inputs' magnitude.

The whole `StreamingCodecDecoder` on the fused transformer must give the unfused decoder's audio and state
to float rounding (the LayerScales folded into the weights round differently) through prime, snapshot,
restore and chunks of several lengths in two slots.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qwen3tts_agent.engine.audio.codec import SlotHistory, StreamingCodecDecoder, rotate_rope
from qwen3tts_agent.kernels import codec_layer
from qwen3tts_agent.kernels.codec_layer import supports_transformer as fused_support
from qwen3tts_agent.models.compat import import_qwen_tts
from tests.engine.audio.test_codec_streaming import TOLERANCE, tiny_decoder

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny ops gain nothing from threads; on a shared machine extra OpenMP threads only spin
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _ulps(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference in units in the last place of `magnitude` (elementwise) in `dtype`."""
    unit = torch.finfo(dtype).eps * magnitude.float().abs().clamp(min=1e-3)
    return float(((got.float() - expected.float()).abs() / unit).max())


@DTYPES
@pytest.mark.parametrize("width", [32, 100])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_rms_norm_equals_the_module(device: str, dtype: torch.dtype, width: int, layout: str) -> None:
    """[2, 3, width] rows (width not a power of two too), or a slice of wider rows, against the official norm."""
    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2DecoderRMSNorm

    module = Qwen3TTSTokenizerV2DecoderRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.rand(width, generator=torch.Generator().manual_seed(width)) + 0.5)
    module = module.to(device, dtype)
    wide = _randn(2, 3, width + 6, seed=width, scale=3.0).to(device, dtype)
    x = wide[..., :width].contiguous() if layout == "contiguous" else wide[..., 3 : 3 + width]
    with torch.no_grad():
        expected = module(x)
    got = codec_layer.rms_norm(x, module.weight, module.variance_epsilon)
    assert got.shape == x.shape and got.dtype == dtype
    assert float((got.float() - x.float()).abs().max()) > 0.1, "the norm did nothing: the comparison would be vacuous"
    if dtype == torch.float32:  # the sum of squares in another order: 1/rms within an ulp or two
        assert float(((got - expected).abs() / expected.abs().clamp(min=1e-6)).max()) < 4 * torch.finfo(dtype).eps
    else:  # compiled: rounded like the module (1 ulp where the fp32 factor differs); interpreted: truncated twice
        assert _ulps(got, expected, expected, dtype) <= (1 if device == "cuda" else 3)


@DTYPES
@pytest.mark.parametrize("width", [32, 100])
def test_add_rms_norm_equals_the_add_and_the_talkers_norm(device: str, dtype: torch.dtype, width: int) -> None:
    """[7, width] rows and a residual read from a slice of wider rows: the sum as PyTorch's add stores it, and the
    talker's official norm of that sum (the batched decoder layer's residual stream and its MLP input)."""
    import_qwen_tts()
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSRMSNorm

    module = Qwen3TTSRMSNorm(width, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.rand(width, generator=torch.Generator().manual_seed(width)) + 0.5)
    module = module.to(device, dtype)
    x = _randn(7, width, seed=width, scale=3.0).to(device, dtype)
    residual = _randn(7, width + 5, seed=width + 1, scale=2.0).to(device, dtype)[:, 2 : 2 + width]
    total, normed = codec_layer.add_rms_norm(x, residual, module.weight, module.variance_epsilon)
    expected_total = x + residual
    with torch.no_grad():
        expected = module(expected_total)
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    assert float((normed.float() - expected_total.float()).abs().max()) > 0.1, "vacuous: the norm did nothing"
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(total, expected_total)
    else:  # the interpreter truncates to bf16 where PyTorch rounds
        assert _ulps(total, expected_total, expected_total, dtype) <= 1
    if dtype == torch.float32:
        assert float(((normed - expected).abs() / expected.abs().clamp(min=1e-6)).max()) < 4 * torch.finfo(dtype).eps
    else:
        assert _ulps(normed, expected, expected, dtype) <= (1 if device == "cuda" else 3)


# (heads, kv_heads, head_dim, window, frames): one frame; more frames than the history (head_dim not a power of
# two); more frames than a program rotates at once, with the real 72-frame window
ROPE_CASES = [(4, 2, 8, 6, 1), (2, 2, 12, 5, 7), (3, 1, 16, 72, 20)]


def _rope_tables(starts: list[int], frames: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] as the official rotary embedding makes them (theta 10000, rotate-half layout)."""
    positions = torch.tensor(starts)[:, None] + torch.arange(frames)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@DTYPES
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "frames"), ROPE_CASES)
def test_rope_window_equals_rotate_and_history_extend(
    device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int, frames: int,
) -> None:
    """Slots [2, 0] of 3 with random histories; qkv a slice of wider rows. Query, window and all histories
    (slot 1 untouched) against the codec's eager `rotate_rope` and `SlotHistory.extend`."""
    batch, streams, width = 2, 3, (heads + 2 * kv_heads) * head_dim
    qkv = _randn(batch, frames, width + 5, seed=frames, scale=2.0).to(device, dtype)[..., 2 : 2 + width]
    cos, sin = (t.to(device) for t in _rope_tables([7, 40], frames, head_dim, dtype))
    slots = torch.tensor([2, 0], device=device)
    hist_shape = (streams, kv_heads, window - 1, head_dim)
    k_hist, v_hist = (_randn(*hist_shape, seed=s).to(device, dtype) for s in (1, 2))
    k_ref, v_ref = SlotHistory(k_hist.clone(), dim=2), SlotHistory(v_hist.clone(), dim=2)
    k_before = k_hist.clone()

    shape = (batch, frames, -1, head_dim)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    q_new = qkv[..., :q_size].reshape(shape).transpose(1, 2)
    expected_query = rotate_rope(q_new, cos4, sin4)
    expected_keys = k_ref.extend(slots, rotate_rope(qkv[..., q_size : q_size + kv_size].reshape(shape).transpose(1, 2), cos4, sin4))
    expected_values = v_ref.extend(slots, qkv[..., q_size + kv_size :].reshape(shape).transpose(1, 2))

    query, keys, values = codec_layer.rope_window(qkv, cos, sin, slots, k_hist, v_hist)
    assert query.shape == (batch, heads, frames, head_dim)
    assert keys.shape == values.shape == (batch, kv_heads, window - 1 + frames, head_dim)
    assert float((query.float() - q_new.float()).abs().max()) > 0.1, "RoPE did nothing: the comparison would be vacuous"
    assert not torch.equal(k_hist, k_before), "the history did not move"
    assert torch.equal(k_hist[1], k_before[1]), "a slot outside the call changed"
    # copies are exact everywhere: the history part of the window, the values, the histories' old rows
    assert torch.equal(values, expected_values) and torch.equal(v_hist, v_ref.buffer)
    assert torch.equal(keys[:, :, : window - 1], expected_keys[:, :, : window - 1])
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(query, expected_query)
        assert torch.equal(keys, expected_keys) and torch.equal(k_hist, k_ref.buffer)
    else:  # three truncated roundings, each within an ulp of the inputs' magnitude
        magnitude = q_new.float().abs().amax(dim=-1, keepdim=True)
        assert _ulps(query, expected_query, magnitude.expand_as(query), dtype) <= 3
        assert _ulps(keys, expected_keys, expected_keys.float().abs().amax(dim=-1, keepdim=True).expand_as(keys), dtype) <= 3
        assert _ulps(k_hist, k_ref.buffer, k_ref.buffer.float().abs().amax(dim=-1, keepdim=True).expand_as(k_hist), dtype) <= 3


@DTYPES
@pytest.mark.parametrize("features", [64, 1100])
def test_silu_mul_equals_eager(device: str, dtype: torch.dtype, features: int) -> None:
    """[5, 2F] (F past one program's block, not a multiple of it), a slice of wider rows: silu(gate) * up."""
    wide = _randn(5, 2 * features + 3, seed=features, scale=3.0).to(device, dtype)
    gate_up = wide[:, 1 : 1 + 2 * features]
    gate, up = gate_up[:, :features], gate_up[:, features:]
    expected = F.silu(gate) * up
    got = codec_layer.silu_mul(gate_up)
    assert got.shape == (5, features) and got.is_contiguous()
    assert float((got.float() - (gate.float() * up.float())).abs().max()) > 0.1, "vacuous: SiLU did nothing"
    if device == "cuda":
        assert torch.equal(got, expected)
    elif dtype == torch.float32:  # numpy's exp against PyTorch's vectorised one
        assert float(((got - expected).abs() / expected.abs().clamp(min=1e-6)).max()) < 4 * torch.finfo(dtype).eps
    else:
        magnitude = gate.float().abs().clamp(min=1.0) * up.float().abs().clamp(min=1.0)
        assert _ulps(got, expected, magnitude, dtype) <= 3


def test_decoder_on_the_fused_transformer_equals_the_unfused(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prime a slot, snapshot it, decode chunks of 1, 2 and 5 frames in two slots, restore the snapshot into a
    third slot and go on: audio and every slot's state as on the official layers, to float rounding."""
    if device == "cuda":  # TF32 convolutions would turn rounding-level differences into 1e-3 ones
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    decoder = tiny_decoder().to(device)
    fused = StreamingCodecDecoder(decoder, max_streams=3, fused_transformer=True)
    eager = StreamingCodecDecoder(decoder, max_streams=3, fused_transformer=False)
    assert fused.transformer_path == "triton" and fused._fused is not None
    assert eager.transformer_path == "pytorch (fused transformer off)" and eager._fused is None

    codes = torch.randint(0, 2048, (3, 20, 16), generator=torch.Generator().manual_seed(5))
    states = []
    for codec in (fused, eager):
        codec.prime(1, codes[2, :9])
        states.append(codec.snapshot(1))
    # (slots, their streams' rows of `codes`, first frame, frames); None: restore the snapshot into slot 2
    plan: list[tuple[list[int], list[int], int, int] | None] = [
        ([1, 0], [2, 0], 9, 1), ([1, 0], [2, 0], 10, 2), ([0, 1], [0, 2], 3, 5),
        None, ([2, 0], [2, 1], 9, 2), ([2, 0], [2, 1], 11, 1),
    ]
    for step in plan:
        if step is None:
            fused.restore(2, states[0])
            eager.restore(2, states[1])
            continue
        slots, rows, start, frames = step
        chunk = codes[rows, start : start + frames]
        audio, expected = fused.decode(slots, chunk), eager.decode(slots, chunk)
        assert audio.shape == (2, frames * fused.samples_per_frame)
        assert float(expected.std()) > 0.01, "silent audio: the comparison would be vacuous"
        assert float((audio - expected).abs().max()) < TOLERANCE
    for slot in range(3):
        for got, want in zip(fused.snapshot(slot), eager.snapshot(slot), strict=True):
            torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=TOLERANCE)
    assert float(fused._kv[0][0].buffer.abs().max()) > 0.1, "the key history stayed empty"


def test_unsupported_transformer_keeps_the_official_layers() -> None:
    """A transformer the fused path does not take (a q norm) runs eager, says why, and refuses `True`."""
    decoder = copy.deepcopy(tiny_decoder())
    transformer: Any = decoder.pre_transformer
    assert fused_support(transformer)
    transformer.layers[1].self_attn.q_norm = nn.LayerNorm(transformer.layers[1].self_attn.head_dim)
    support = fused_support(transformer)
    assert not support and "q/k norms" in support.reason
    codec = StreamingCodecDecoder(decoder, max_streams=1)
    assert codec._fused is None and codec.transformer_path == f"pytorch ({support.reason})"
    with pytest.raises(ValueError, match="q/k norms"):
        StreamingCodecDecoder(decoder, max_streams=1, fused_transformer=True)
