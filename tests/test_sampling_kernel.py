"""`fused_sample` draws what `sampling.sample` draws, under the Triton interpreter on CPU.

As in test_kernels.py, the interpreter has to be on before the kernel is decorated, so this file, run as a
script with TRITON_INTERPRET=1 in a fresh subprocess, computes every case and prints the kernel's and the
reference's tokens as JSON; the tests below assert on them. The reference ranks candidates with torch.topk,
whose order among equal scores is unspecified, so cases with ties (bf16 logits) compare against the same
reference with a stable sort in place of topk, which is the order the kernel defines (descending score, then
ascending token id).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from tests.interpreted import report_results, run_interpreted, start_child

EXACT_CASES = ("small-fp32", "small-bf16-strided", "vocab2048", "vocab2048-bf16", "talker")
DRAWS = 800  # counters drawn on one row: the kernel's empirical distribution is the reference's, draw by draw

# ------------------------------------------------------------------------------------ child process (interpreter)


def _rows(cap: int, gen: Any, greedy: int = 5) -> dict[str, Any]:
    """Every (temperature, top_k, top_p) of the grid as a sampling row, plus greedy rows, shuffled."""
    import torch

    grid = [(t, k, p) for t in (0.7, 1.0, 1.3) for k in (1, 5, cap) for p in (1.0, 0.8, 0.3)]
    grid += [(1.0, 0, 1.0)] * greedy  # top_k 0, as in slots never reset: greedy rows ignore it
    n = len(grid)
    order = torch.randperm(n, generator=gen)
    return {
        "do_sample": (torch.arange(n) < n - greedy)[order],
        "temperature": torch.tensor([g[0] for g in grid])[order],
        "top_k": torch.tensor([g[1] for g in grid], dtype=torch.int64)[order],
        "top_p": torch.tensor([g[2] for g in grid])[order],
        "seed": torch.randint(-(2**62), 2**62, (n,), generator=gen),
        "counter": torch.randint(0, 2**40, (n,), generator=gen),
    }


def _compare(scores: Any, rows: dict[str, Any], cap: int, **talker: Any) -> dict[str, Any]:
    """Kernel and reference tokens for the same inputs (the reference as in `runner._sample_code0`)."""
    import torch

    from qwen3tts_agent.engine.sampling import SamplerRows, apply_repetition_penalty, gumbel_noise, sample
    from qwen3tts_agent.engine.sampling_kernel import fused_sample

    out = torch.full((scores.shape[0],), -1, dtype=torch.int64)
    fused_sample(scores, **rows, cap=cap, out=out, **talker)
    s = scores.float()
    if talker:
        s = apply_repetition_penalty(s, talker["seen"], talker["penalty"])
        s = s.masked_fill(talker["suppress"], float("-inf"))
        eos = talker["eos_id"]
        s[:, eos] = torch.where(talker["eos_blocked"], float("-inf"), s[:, eos])
    gumbel = gumbel_noise(rows["seed"], rows["counter"].unsqueeze(1), scores.shape[1])[:, 0]
    params = SamplerRows(rows["do_sample"], rows["temperature"], rows["top_k"], rows["top_p"])
    ref = sample(s, params, gumbel, cap)
    sampled = rows["do_sample"]
    return {
        "kernel": out.tolist(),
        "reference": ref.tolist(),
        "greedy_ok": bool((out[~sampled] == s[~sampled].argmax(-1)).all()),
        "sampled_off_argmax": int((out[sampled] != s[sampled].argmax(-1)).sum()),
    }


def _case_small(dtype: str) -> dict[str, Any]:
    """V < cap; the bf16 scores are distinct multiples of 1/4 in a row view with a row stride > V."""
    import torch

    gen = torch.Generator().manual_seed(1)
    rows = _rows(64, gen)
    n = rows["seed"].shape[0]
    if dtype == "fp32":
        return _compare(torch.randn(n, 37, generator=gen) * 3, rows, cap=64)
    values = torch.stack([torch.randperm(37, generator=gen) - 18 for _ in range(n)]) * 0.25
    wide = torch.zeros(n, 45, dtype=torch.bfloat16)
    wide[:, 3:40] = values
    return _compare(wide[:, 3:40], rows, cap=64)


def _case_vocab2048() -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(2)
    rows = _rows(64, gen, greedy=3)
    return _compare(torch.randn(rows["seed"].shape[0], 2048, generator=gen) * 4, rows, cap=64)


def _case_talker() -> dict[str, Any]:
    """Repetition penalty, suppressed control codes and a blockable EOS (often the best token), cap 16 < V."""
    import torch

    gen = torch.Generator().manual_seed(3)
    rows = _rows(16, gen)
    n, vocab, eos = rows["seed"].shape[0], 300, 250
    scores = torch.randn(n, vocab, generator=gen) * 3
    scores[::2, eos] = 12.0
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[200:] = True
    suppress[eos] = False
    talker = {
        "seen": torch.rand(n, vocab, generator=gen) < 0.2,
        "penalty": torch.tensor([1.0, 1.05, 1.3])[torch.arange(n) % 3],
        "suppress": suppress,
        "eos_id": eos,
        "eos_blocked": torch.arange(n) % 4 == 0,
    }
    result = _compare(scores, rows, cap=16, **talker)
    result["eos_drawn"] = sum(t == eos for t in result["kernel"])
    result["never_drawn_ok"] = all(
        not suppress[t] and not (t == eos and talker["eos_blocked"][i])
        for i, t in enumerate(result["kernel"])
    )
    return result


def _stable_topk(scores: Any, k: int, dim: int = -1) -> tuple[Any, Any]:
    """torch.topk with ties in ascending id order, the kernel's order."""
    values, ids = scores.sort(dim=dim, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def _case_vocab2048_bf16() -> dict[str, Any]:
    """The code predictor's case: bf16 logits, no penalty (int32 sort keys); bf16 rounding makes ties."""
    from unittest import mock

    import torch

    gen = torch.Generator().manual_seed(5)
    rows = _rows(64, gen, greedy=3)
    scores = (torch.randn(rows["seed"].shape[0], 2048, generator=gen) * 4).to(torch.bfloat16)
    with mock.patch.object(torch.Tensor, "topk", _stable_topk):
        return _compare(scores, rows, cap=64)


def _case_ties() -> dict[str, Any]:
    """bf16 scores from a few values (and -0.0): against the reference ranking by a stable sort."""
    from unittest import mock

    import torch

    gen = torch.Generator().manual_seed(4)
    cap = 16
    rows = _rows(cap, gen)
    # top_p off the partial sums of equal probabilities (0.8 = 4 x 0.2), where rounding would decide
    rows["top_p"] = torch.where(rows["top_p"] < 1, rows["top_p"] + 0.05, rows["top_p"])
    scores = (torch.randint(-3, 4, (rows["seed"].shape[0], 100), generator=gen) * 0.75).to(torch.bfloat16)
    # random signs: some zeros become -0.0, which ranks as +0.0
    scores = torch.where(torch.rand(scores.shape, generator=gen) < 0.5, -scores, scores)
    with mock.patch.object(torch.Tensor, "topk", _stable_topk):
        result = _compare(scores, rows, cap=cap)
    ranked = scores.float().sort(dim=-1, descending=True).values
    k = rows["top_k"].clamp(min=1).unsqueeze(1)
    result["boundary_ties"] = int((ranked.gather(1, k - 1) == ranked.gather(1, k)).sum())
    return result


def _case_distribution() -> dict[str, Any]:
    """One row (an expanded view: row stride 0) drawn with DRAWS counters; top-k and top-p both remove tokens."""
    import torch

    from qwen3tts_agent.engine.sampling import SamplerRows, warp_candidates

    logits = torch.tensor([2.0, 1.7, 1.1, 0.9, 0.4, 0.3, -0.5, -1.0])
    rows = {
        "do_sample": torch.ones(DRAWS, dtype=torch.bool),
        "temperature": torch.full((DRAWS,), 1.3),
        "top_k": torch.full((DRAWS,), 6, dtype=torch.int64),
        "top_p": torch.full((DRAWS,), 0.9),
        "seed": torch.full((DRAWS,), 987654321987),
        "counter": torch.arange(DRAWS, dtype=torch.int64),
    }
    result = _compare(logits.expand(DRAWS, -1), rows, cap=64)
    first = SamplerRows(rows["do_sample"][:1], rows["temperature"][:1], rows["top_k"][:1], rows["top_p"][:1])
    values, ids = warp_candidates(logits[None], first, cap=64)
    result["kept"] = sorted(ids[~torch.isinf(values)].tolist())
    return result


CASES = {
    "small-fp32": lambda: _case_small("fp32"),
    "small-bf16-strided": lambda: _case_small("bf16"),
    "vocab2048": _case_vocab2048,
    "vocab2048-bf16": _case_vocab2048_bf16,
    "talker": _case_talker,
    "ties": _case_ties,
    "distribution": _case_distribution,
}

# ------------------------------------------------------------------------------------------------ pytest side


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("case", EXACT_CASES)
def test_tokens_equal_the_reference(results: dict[str, dict[str, Any]], case: str) -> None:
    r = results[case]
    assert r["kernel"] == r["reference"]
    assert r["greedy_ok"]
    assert r["sampled_off_argmax"] > 0, "no sampling row left the argmax: the draw is not exercised"


def test_talker_processors(results: dict[str, dict[str, Any]]) -> None:
    r = results["talker"]
    assert r["never_drawn_ok"], "a suppressed token or a blocked EOS was drawn"
    assert r["eos_drawn"] > 0, "EOS is never drawn where allowed: the blocking is not exercised"


def test_ties_follow_score_then_token_id(results: dict[str, dict[str, Any]]) -> None:
    r = results["ties"]
    assert r["boundary_ties"] > 0, "no tie at a top-k boundary: the order among ties is not exercised"
    assert r["greedy_ok"], "greedy rows must pick the lowest id among equal maxima, as torch.argmax"
    assert r["kernel"] == r["reference"]


def test_distribution_equals_the_reference_draw_by_draw(results: dict[str, dict[str, Any]]) -> None:
    r = results["distribution"]
    assert len(r["kernel"]) == DRAWS and r["kernel"] == r["reference"]
    assert sorted(set(r["kernel"])) == r["kept"], "every kept token is drawn, and no removed one"
    assert 0 < len(r["kept"]) < 6


if __name__ == "__main__":
    start_child()
    out = {}
    for name, run in CASES.items():
        started = time.perf_counter()
        out[name] = run()
        print(f"{name} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    report_results(out)
