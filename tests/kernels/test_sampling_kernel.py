"""`sampling.fused_sample` draws what `engine.runner.sampling.sample` draws, row by row.

The reference ranks candidates with torch.topk, whose order among equal scores is unspecified, so cases with
ties (bf16 logits) compare against the same reference with a stable sort in place of topk, which is the
order the kernel defines (descending score, then ascending token id).
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from qwen3tts_agent.engine.runner.sampling import (
    SamplerRows,
    apply_repetition_penalty,
    gumbel_noise_at,
    sample,
    warp_candidates,
)
from qwen3tts_agent.kernels.sampling import fused_sample

DRAWS = 800  # counters drawn on one row: the kernel's empirical distribution is the reference's, draw by draw


def _rows(cap: int, gen: torch.Generator, greedy: int = 5) -> dict[str, torch.Tensor]:
    """Every (temperature, top_k, top_p) of the grid as a sampling row, plus greedy rows, shuffled."""
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


def _stable_topk(scores: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk with ties in ascending id order, the kernel's order."""
    values, ids = scores.sort(dim=dim, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


@pytest.fixture
def stable_topk() -> Iterator[None]:
    with mock.patch.object(torch.Tensor, "topk", _stable_topk):
        yield


def _compare(device: str, scores: torch.Tensor, rows: dict[str, torch.Tensor], cap: int, **talker: object) -> dict:
    """Kernel and reference tokens for the same inputs (the reference as in `runner._sample_code0`)."""
    scores = scores.to(device)
    rows = {k: v.to(device) for k, v in rows.items()}
    talker = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in talker.items()}
    out = torch.full((scores.shape[0],), -1, dtype=torch.int64, device=device)
    fused_sample(scores, **rows, cap=cap, out=out, **talker)
    s = scores.float()
    if talker:
        s = apply_repetition_penalty(s, talker["seen"], talker["penalty"])
        s = s.masked_fill(talker["suppress"], float("-inf"))
        eos = talker["eos_id"]
        s[:, eos] = torch.where(talker["eos_blocked"], float("-inf"), s[:, eos])
    params = SamplerRows(rows["do_sample"], rows["temperature"], rows["top_k"], rows["top_p"])
    ref = sample(s, params, lambda ids: gumbel_noise_at(rows["seed"], rows["counter"], ids), cap)
    sampled = rows["do_sample"]
    return {
        "kernel": out.tolist(),
        "reference": ref.tolist(),
        "greedy_ok": bool((out[~sampled] == s[~sampled].argmax(-1)).all()),
        "sampled_off_argmax": int((out[sampled] != s[sampled].argmax(-1)).sum()),
    }


def _assert_same_draws(r: dict) -> None:
    assert r["kernel"] == r["reference"]
    assert r["greedy_ok"]
    assert r["sampled_off_argmax"] > 0, "no sampling row left the argmax: the draw is not exercised"


@pytest.mark.parametrize("vocab", [37, 2048])
def test_fp32_scores(device: str, vocab: int) -> None:
    """V below the cap and a real predictor vocabulary."""
    gen = torch.Generator().manual_seed(vocab)
    rows = _rows(64, gen, greedy=3)
    _assert_same_draws(_compare(device, torch.randn(rows["seed"].shape[0], vocab, generator=gen) * 4, rows, cap=64))


def test_bf16_scores_in_a_strided_view(device: str) -> None:
    """V < cap; distinct multiples of 1/4 in a row view with a row stride > V (int32 sort keys)."""
    gen = torch.Generator().manual_seed(1)
    rows = _rows(64, gen)
    n = rows["seed"].shape[0]
    values = torch.stack([torch.randperm(37, generator=gen) - 18 for _ in range(n)]) * 0.25
    wide = torch.zeros(n, 45, dtype=torch.bfloat16)
    wide[:, 3:40] = values
    _assert_same_draws(_compare(device, wide[:, 3:40], rows, cap=64))


def test_predictor_bf16_logits(device: str, stable_topk: None) -> None:
    """The code predictor's case: bf16 logits over 2048 codes, no penalty; bf16 rounding makes ties."""
    gen = torch.Generator().manual_seed(5)
    rows = _rows(64, gen, greedy=3)
    _assert_same_draws(_compare(device, (torch.randn(rows["seed"].shape[0], 2048, generator=gen) * 4).to(torch.bfloat16), rows, cap=64))


def test_talker_processors(device: str) -> None:
    """Repetition penalty, suppressed control codes and a blockable EOS (often the best token), cap 16 < V."""
    gen = torch.Generator().manual_seed(3)
    rows = _rows(16, gen)
    n, vocab, eos = rows["seed"].shape[0], 300, 250
    scores = torch.randn(n, vocab, generator=gen) * 3
    scores[::2, eos] = 12.0
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[200:] = True
    suppress[eos] = False
    blocked = torch.arange(n) % 4 == 0
    r = _compare(
        device, scores, rows, cap=16, seen=torch.rand(n, vocab, generator=gen) < 0.2,
        penalty=torch.tensor([1.0, 1.05, 1.3])[torch.arange(n) % 3], suppress=suppress, eos_id=eos, eos_blocked=blocked,
    )
    _assert_same_draws(r)
    assert all(not suppress[t] and not (t == eos and blocked[i]) for i, t in enumerate(r["kernel"])), (
        "a suppressed token or a blocked EOS was drawn"
    )
    assert eos in r["kernel"], "EOS is never drawn where allowed: the blocking is not exercised"


def test_ties_follow_score_then_token_id(device: str, stable_topk: None) -> None:
    """bf16 scores from a few values (and -0.0): against the reference ranking by a stable sort."""
    gen = torch.Generator().manual_seed(4)
    cap = 16
    rows = _rows(cap, gen)
    # top_p off the partial sums of equal probabilities (0.8 = 4 x 0.2), where rounding would decide
    rows["top_p"] = torch.where(rows["top_p"] < 1, rows["top_p"] + 0.05, rows["top_p"])
    scores = (torch.randint(-3, 4, (rows["seed"].shape[0], 100), generator=gen) * 0.75).to(torch.bfloat16)
    # random signs: some zeros become -0.0, which ranks as +0.0
    scores = torch.where(torch.rand(scores.shape, generator=gen) < 0.5, -scores, scores)
    r = _compare(device, scores, rows, cap=cap)
    ranked = scores.float().sort(dim=-1, descending=True).values
    k = rows["top_k"].clamp(min=1).unsqueeze(1)
    assert int((ranked.gather(1, k - 1) == ranked.gather(1, k)).sum()) > 0, (
        "no tie at a top-k boundary: the order among ties is not exercised"
    )
    assert r["greedy_ok"], "greedy rows must pick the lowest id among equal maxima, as torch.argmax"
    assert r["kernel"] == r["reference"]


def test_distribution_equals_the_reference_draw_by_draw(device: str) -> None:
    """One row (an expanded view: row stride 0) drawn with DRAWS counters; top-k and top-p both remove tokens."""
    logits = torch.tensor([2.0, 1.7, 1.1, 0.9, 0.4, 0.3, -0.5, -1.0])
    rows = {
        "do_sample": torch.ones(DRAWS, dtype=torch.bool),
        "temperature": torch.full((DRAWS,), 1.3),
        "top_k": torch.full((DRAWS,), 6, dtype=torch.int64),
        "top_p": torch.full((DRAWS,), 0.9),
        "seed": torch.full((DRAWS,), 987654321987),
        "counter": torch.arange(DRAWS, dtype=torch.int64),
    }
    r = _compare(device, logits.expand(DRAWS, -1), rows, cap=64)
    first = SamplerRows(rows["do_sample"][:1], rows["temperature"][:1], rows["top_k"][:1], rows["top_p"][:1])
    values, ids = warp_candidates(logits[None], first, cap=64)
    kept = sorted(ids[~torch.isinf(values)].tolist())
    assert len(r["kernel"]) == DRAWS and r["kernel"] == r["reference"]
    assert sorted(set(r["kernel"])) == kept, "every kept token is drawn, and no removed one"
    assert 0 < len(kept) < 6


def test_bad_rows_raise() -> None:
    rows = _rows(8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="seen needs penalty"):
        fused_sample(torch.zeros(len(rows["seed"]), 20), **rows, cap=8, out=torch.empty(len(rows["seed"]), dtype=torch.int64),
                     seen=torch.zeros(len(rows["seed"]), 20, dtype=torch.bool))
