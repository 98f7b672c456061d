"""Batched, per-row logits processing and sampling that never leaves the device.

Each row carries its own parameters as tensors, so one captured CUDA graph serves requests with different
settings. The processing follows transformers' `generate` (repetition penalty, minimum length, token
suppression, then temperature, top-k, top-p), which is what the official package runs. Top-k works on the
`cap` best candidates only (a fixed size, so the step stays one graph), which is exact for top_k <= cap.
Random draws come from a counter-based hash of (seed, draw counter, vocabulary index): reproducible per
request whatever else shares the batch, and free of host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
DEFAULT_TOP_K_CAP = 64


# PCG-RXS-M-XS 32-bit (Jarzynski & Olano 2020): the state's multiplier and increment, the output's multiplier
# (the Triton kernels in kernels/sampling.py spell the same numbers)
PCG_MULTIPLIER, PCG_INCREMENT, PCG_WORD_MULTIPLIER = 747796405, 2891336453, 277803737


def _pcg_hash(x: torch.Tensor) -> torch.Tensor:
    """PCG-RXS-M-XS 32-bit hash (Jarzynski & Olano 2020) on int64 tensors holding 32-bit values."""
    state = (x * PCG_MULTIPLIER + PCG_INCREMENT) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * PCG_WORD_MULTIPLIER) & _MASK32
    return ((word >> 22) ^ word) & _MASK32


def hash_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (in int64) as uniform (0, 1) float32 noise."""
    return (h.to(torch.float32) + 0.5) * (1.0 / 4294967296.0)


def _hashed_uniform(seed: torch.Tensor, counter: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise of (seed, counter, token index), the three broadcast against each other."""
    h = _pcg_hash((seed & _MASK32) ^ _pcg_hash(index))
    h = _pcg_hash(h ^ (counter & _MASK32))
    h = _pcg_hash(h ^ ((seed >> 32) & _MASK32))
    return hash_to_uniform(h)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) float32 noise [*counter.shape, vocab] from per-row seeds [rows] and counters [rows, ...]."""
    index = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    return _hashed_uniform(seed.view(-1, *([1] * (counter.dim() - 1)), 1), counter.unsqueeze(-1), index)


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(seed, counter, vocab_size)))


def gumbel_noise_at(seed: torch.Tensor, counter: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`gumbel_noise(seed, counter[:, None], vocab)[:, 0]` at token ids [rows, k] only, bit for bit (the same
    elementwise hash and logs): a draw needs the noise of its candidates alone, a few dozen of thousands."""
    return -torch.log(-torch.log(_hashed_uniform(seed.view(-1, 1), counter.view(-1, 1), ids)))


@dataclass
class SamplerRows:
    """Per-row sampling parameters (all tensors of leading size `rows`)."""

    do_sample: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 1..cap
    top_p: torch.Tensor  # float32; 1.0 disables


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: every token generated before is penalised once."""
    penalty = penalty.unsqueeze(1).to(scores.dtype)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def warp_candidates(scores: torch.Tensor, rows: SamplerRows, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k and top-p on the `cap` best tokens: (warped logits [rows, cap], token ids).

    Removed candidates are -inf; every other token of the vocabulary is implicitly -inf too.
    """
    values, ids = scores.topk(min(cap, scores.shape[-1]), dim=-1)
    values = values / rows.temperature.unsqueeze(1)
    rank = torch.arange(values.shape[-1], device=scores.device)
    values = values.masked_fill(rank >= rows.top_k.unsqueeze(1), float("-inf"))
    # transformers drops the low tail whose ascending cumulative mass is <= 1 - top_p; in descending order
    # that is a token whose better-ranked mass is already >= top_p. The best token always stays. Like
    # transformers, top_p >= 1 cuts nothing (rounding could otherwise reach 1 before the last candidate).
    probs = values.softmax(dim=-1)
    better_mass = probs.cumsum(dim=-1) - probs
    top_p = rows.top_p.unsqueeze(1)
    values = values.masked_fill((better_mass >= top_p) & (rank > 0) & (top_p < 1.0), float("-inf"))
    return values, ids


def sample(
    scores: torch.Tensor, rows: SamplerRows, gumbel_at: Callable[[torch.Tensor], torch.Tensor], cap: int,
    any_sampling: bool = True,
) -> torch.Tensor:
    """Draw for sampling rows (Gumbel-max over the warped candidates), argmax for greedy rows. int64 [rows].

    `gumbel_at(ids)` gives each row's Gumbel noise at token ids [rows, k] (`gumbel_noise_at`): indexed by token
    id, so a row's draw does not depend on the candidate order. `any_sampling=False` (known on the host when
    every row is greedy) skips the warping work.
    """
    scores = scores.float()
    greedy = scores.argmax(dim=-1)
    if not any_sampling:
        return greedy
    values, ids = warp_candidates(scores, rows, cap)
    choice = (values + gumbel_at(ids)).argmax(dim=-1, keepdim=True)
    return torch.where(rows.do_sample, ids.gather(1, choice).squeeze(1), greedy)
