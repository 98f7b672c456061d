"""The fused SnakeBeta kernel equals the official module, alone and inside the streaming codec decoder.

Runs under the Triton interpreter in a subprocess of its own (see tests/interpreted.py). numpy's float32 sin
may differ from PyTorch's CPU sin in the last bit, so fp32 is compared to 1e-6; the interpreter converts to
bf16 by truncation where GPUs and PyTorch round to nearest, so bf16 is compared to a few units in the last
place. On a GPU both sides use the same sinf and roundings (the GPU parity run compares the audio).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.interpreted import report_results, run_interpreted, start_child

# ------------------------------------------------------------------------------------ child process (interpreter)


def _module(channels: int, dtype: Any) -> Any:
    import torch

    from qwen3tts_agent.models.compat import import_qwen_tts

    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import SnakeBeta

    module = SnakeBeta(channels)
    generator = torch.Generator().manual_seed(channels)
    with torch.no_grad():
        module.alpha.copy_(torch.randn(channels, generator=generator) * 0.5)
        module.beta.copy_(torch.randn(channels, generator=generator) * 0.5)
    return module.to(dtype)


def _case_activation(dtype_name: str) -> dict[str, Any]:
    """[2, 5, 1500] (time not a whole number of blocks), and a channel slice of a wider tensor (strided)."""
    import torch

    from qwen3tts_agent.engine.snake_kernel import FusedSnakeBeta

    dtype = getattr(torch, dtype_name)
    module = _module(5, dtype)
    wide = (torch.randn(2, 9, 1500, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    out = {}
    for name, x in (("contiguous", wide[:, :5].contiguous()), ("strided", wide[:, 2:7])):
        with torch.no_grad():
            expected, got = module(x).float(), FusedSnakeBeta(module)(x).float()
        # x + bump may cancel: count units in the last place of the larger operand
        ulp = torch.finfo(dtype).eps * torch.maximum(x.float().abs(), expected.abs()).clamp(min=1e-3)
        out[name] = {
            "max_abs": float((got - expected).abs().max()),
            "max_ulps": float(((got - expected).abs() / ulp).max()),
            "changed_input": float((x.float() - got).abs().max()),
        }
    return out


def _case_codec() -> dict[str, Any]:
    """Two chunks through the streaming decoder (fused activations) against the official one-shot decode."""
    import torch

    from qwen3tts_agent.engine.codec import StreamingCodecDecoder
    from tests.test_codec_streaming import tiny_decoder

    torch.set_num_threads(1)
    decoder = tiny_decoder()
    codes = torch.randint(0, 2048, (1, 3, 16), generator=torch.Generator().manual_seed(1))
    codec = StreamingCodecDecoder(decoder, max_streams=1)
    with torch.no_grad():
        reference = decoder(codes.transpose(1, 2)).squeeze(1)
        streamed = torch.cat([codec.decode([0], codes[:, :2]), codec.decode([0], codes[:, 2:])], dim=-1)
    return {"max_abs": float((streamed - reference).abs().max()), "fused": len(codec._snakes)}


CASES = {
    "float32": lambda: _case_activation("float32"),
    "bfloat16": lambda: _case_activation("bfloat16"),
    "codec": _case_codec,
}

# ------------------------------------------------------------------------------------------------ pytest side


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_activation_equals_the_module(results: dict[str, dict[str, Any]], layout: str) -> None:
    fp32, bf16 = results["float32"][layout], results["bfloat16"][layout]
    assert fp32["max_abs"] < 1e-6
    assert bf16["max_ulps"] <= 8  # four truncating roundings, against four rounding to nearest
    assert fp32["changed_input"] > 0.01, "the activation did nothing: the comparison would be vacuous"


def test_streaming_codec_with_fused_activations(results: dict[str, dict[str, Any]]) -> None:
    from tests.test_codec_streaming import TOLERANCE

    r = results["codec"]
    assert r["fused"] > 0, "the decoder's SnakeBeta modules were not found"
    assert r["max_abs"] < TOLERANCE


if __name__ == "__main__":
    start_child()
    report_results({name: run() for name, run in CASES.items()})
    sys.exit(0)
