"""`frame.predictor_code` and `frame.talker_code0` against the runner's PyTorch bookkeeping.

Two `ModelRunner`s over one official model, one on the kernels and one on PyTorch ops, get the same slots
(greedy, sampled, top-p, an inactive row), then the same logits and hidden states for a whole frame's 15
predictor codes and the talker's next codebook-0 token; every per-slot tensor the frame touches must agree.
The widths cover a power-of-two hidden size (tiny, 64) and one that is not (odd, 120); bf16 makes ties among
logits, which the reference then ranks as the kernel does (ascending token id).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from qwen3tts_agent.engine.runner import ModelRunner, PrefillRow
from qwen3tts_agent.engine.runner.kernel_paths import TRITON_PATH
from qwen3tts_agent.models.loading import load_official_model

SLOTS = [
    dict(do_sample=False, subtalker_do_sample=False),
    dict(seed=11),  # the official defaults: top-k 50, temperature 0.9, repetition penalty 1.05
    dict(seed=-7, top_p=0.8, top_k=5, subtalker_top_p=0.7, subtalker_temperature=1.3, repetition_penalty=1.3),
]
DEFAULTS = dict(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, subtalker_do_sample=True,
                subtalker_temperature=0.9, subtalker_top_k=50, subtalker_top_p=1.0, seed=0, ignore_eos=False)
STATE = ("frame_out", "code0", "p_input", "p_step_input", "embed_sum", "talker_input", "write_pos", "seen", "pos",
         "n_sampled", "step_idx")


def _stable_topk(scores: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = scores.sort(dim=dim, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def _runner(model: torch.nn.Module, fused: bool) -> ModelRunner:
    runner = ModelRunner(model, max_slots=len(SLOTS) + 1, max_seq_len=64, max_text_tokens=64, fused_kernels=fused)
    assert (runner.fused_talker and runner.fused_predictor) == fused
    assert (runner.kernel_paths["talker"] == TRITON_PATH) == fused
    return runner


def _start(runner: ModelRunner, prompt: torch.Tensor) -> None:
    """The same slots on every runner: their sampling, a text track, a prompt ending in the first codebook-0
    token; the last row stays inactive in the frame."""
    for slot, overrides in enumerate(SLOTS):
        runner.reset_slot(slot, {**DEFAULTS, **overrides})
        runner.append_text(slot, 0, [151671 + slot, 151672])
    runner.prefill([PrefillRow(slot, 0, prompt[slot], sample=True) for slot in range(len(SLOTS))])
    runner.active[: len(SLOTS)] = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("spec", ["synthetic:tiny-customvoice", "synthetic:odd"])
def test_frame_state_matches_pytorch(device: str, spec: str, dtype: torch.dtype) -> None:
    official = load_official_model(spec, device=device, dtype=dtype, progress=False)
    model = official.model
    runners = [_runner(model, fused) for fused in (True, False)]
    gen = torch.Generator().manual_seed(len(spec))
    hidden_size, b = runners[0].hidden_size, len(SLOTS) + 1
    prompt = (torch.randn(len(SLOTS), 5, hidden_size, generator=gen) * 0.1).to(device, dtype)
    with torch.inference_mode(), mock.patch.object(torch.Tensor, "topk", _stable_topk):
        for runner in runners:
            _start(runner, prompt)
        _assert_same_state(runners, "after the prompt")
        for code in range(1, 16):
            logits = (torch.randn(b, 2048, generator=gen) * 3).to(device, dtype)
            for runner in runners:
                runner._record_code(logits, code, b, sampling=True)
            _assert_same_state(runners, f"after code {code}")
        logits = (torch.randn(b, runners[0].vocab_size, generator=gen) * 3).to(device, dtype)
        hidden = torch.randn(b, hidden_size, generator=gen).to(device, dtype)
        for runner in runners:
            rows = runner._arange_slots[:b]
            runner._record_code0(logits, rows, runner.active[:b], hidden, frame=True)
        _assert_same_state(runners, "after the talker's token")
    fused = runners[0]
    assert bool(fused.frame_codes[: len(SLOTS), 1:].ne(fused.frame_codes[0, 1:]).any()), "rows drew the same codes"
    assert int(fused.pos[len(SLOTS)]) == 0 and int(fused.write_pos[len(SLOTS)]) == fused.max_seq_len, (
        "the inactive row keeps its state and writes the spare column"
    )


def _assert_same_state(runners: list[ModelRunner], when: str) -> None:
    fused, reference = runners
    for name in STATE:
        got, want = getattr(fused, name), getattr(reference, name)
        if name == "p_input":  # the talker's normed hidden state: the kernel sums the squares in its own order
            tolerance = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}[got.dtype]
        elif name == "talker_input" and got.dtype == torch.bfloat16 and got.device.type == "cpu":
            # two roundings to bf16 (the sum, then the sum plus the text): the interpreter truncates, PyTorch
            # rounds to nearest
            tolerance = dict(rtol=2**-6, atol=1e-5)
        else:
            assert torch.equal(got, want), f"{name} differs {when}"
            continue
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m, name=name: f"{name} {when}: {m}")
