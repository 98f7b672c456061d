"""Logits processing equals transformers' processors; seeded sampling is reproducible and unbiased."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from qwen3tts_agent import SamplingParams, Voice
from qwen3tts_agent.engine.runner.sampling import (
    SamplerRows,
    apply_repetition_penalty,
    gumbel_noise,
    gumbel_noise_at,
    sample,
    uniform_noise,
    warp_candidates,
)
from tests.engine_helpers import TEXT, engine_for, reference_audio


def _rows(n: int, temperature: float, top_k: int, top_p: float) -> SamplerRows:
    return SamplerRows(
        do_sample=torch.ones(n, dtype=torch.bool), temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64), top_p=torch.full((n,), top_p),
    )


def _dense(values: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.full((values.shape[0], vocab), float("-inf")).scatter(1, ids, values)


def test_warping_equals_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    for temperature, top_k, top_p in [(0.9, 50, 1.0), (0.7, 64, 0.8), (1.3, 10, 0.5), (1.0, 40, 0.95), (0.5, 1, 1.0)]:
        scores = torch.randn(6, 3072, generator=gen) * 3
        ours = _dense(*warp_candidates(scores, _rows(6, temperature, top_k, top_p), cap=64), vocab=3072)
        ref = TemperatureLogitsWarper(temperature)(None, scores.clone())
        ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1.0:
            ref = TopPLogitsWarper(top_p)(None, ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_per_row_parameters_differ_within_one_batch() -> None:
    scores = torch.randn(2, 100) * 2
    rows = _rows(2, 1.0, 5, 1.0)
    rows.top_k = torch.tensor([5, 20])
    kept = (~torch.isinf(warp_candidates(scores, rows, cap=32)[0])).sum(1)
    assert kept.tolist() == [5, 20]


def test_repetition_penalty_min_length_and_suppression_equal_transformers() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 3072, generator=gen) * 4
    history = torch.randint(0, 2048, (3, 7), generator=gen)
    seen = torch.zeros(3, 3072, dtype=torch.bool).scatter_(1, history, True)
    ours = apply_repetition_penalty(scores, seen, torch.full((3,), 1.05))
    ref = RepetitionPenaltyLogitsProcessor(1.05)(history, scores.clone())
    torch.testing.assert_close(ours, ref)
    # the runner's suppression: control codes 2048..3071 except EOS, EOS before 2 tokens
    suppress = [i for i in range(2048, 3072) if i != 2150]
    ref = SuppressTokensLogitsProcessor(suppress, device="cpu")(history, ref)
    ref = MinNewTokensLengthLogitsProcessor(0, 2, 2150)(history[:, :1], ref)
    assert torch.isinf(ref[:, 2048:]).all()


def test_gumbel_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    rows = _rows(20000, 1.0, 4, 1.0)
    seed, counter = torch.full((20000,), 12345), torch.arange(20000)
    draws = sample(logits, rows, lambda ids: gumbel_noise_at(seed, counter, ids), cap=4)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_noise_at_candidates_equals_the_whole_vocabularys() -> None:
    """`gumbel_noise_at` is `gumbel_noise` at the given ids, bit for bit (the draws of both paths agree)."""
    gen = torch.Generator().manual_seed(3)
    seed = torch.randint(0, 2**48, (5,), generator=gen)
    counter = torch.randint(0, 10_000, (5,), generator=gen)
    whole = gumbel_noise(seed, counter.unsqueeze(1), 3072)[:, 0]
    ids = torch.randint(0, 3072, (5, 64), generator=gen)
    assert torch.equal(gumbel_noise_at(seed, counter, ids), whole.gather(1, ids))
    assert whole.std() > 0.5  # real noise, not a constant


def test_noise_is_a_pure_function_of_seed_and_counter() -> None:
    a = uniform_noise(torch.tensor([7, 7, 8]), torch.tensor([[3], [4], [3]]), 64)[:, 0]
    b = uniform_noise(torch.tensor([7]), torch.tensor([[3]]), 64)[:, 0]
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert a.min() > 0 and a.max() < 1


def test_seeded_requests_are_reproducible() -> None:
    engine = engine_for("synthetic:tiny")
    try:
        voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
        run = lambda seed: engine.synthesize_blocking(TEXT, voice=voice, sampling=SamplingParams(seed=seed, max_frames=12))[1].codes  # noqa: E731
        assert run(11) == run(11)
        assert run(11) != run(12)
    finally:
        engine.close()
