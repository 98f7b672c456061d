"""Batched, per-row logits processing and sampling that never leaves the device.

Each row carries its own parameters as tensors, so one captured CUDA graph serves requests with different
settings. The processing order and arithmetic follow transformers' `generate` (repetition penalty, minimum
length, token suppression, then temperature, top-k, top-p), which is what the official package runs.
Random draws come from a counter-based hash of (seed, draw counter, vocabulary index): reproducible per
request whatever else shares the batch, and free of host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _pcg_hash(x: torch.Tensor) -> torch.Tensor:
    """PCG-RXS-M-XS 32-bit hash (Jarzynski & Olano 2020) on int64 tensors holding 32-bit values."""
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return ((word >> 22) ^ word) & _MASK32


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) float32 noise of shape [rows, vocab] from per-row seed and counter (int64 [rows])."""
    index = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    h = _pcg_hash((seed & _MASK32).unsqueeze(1) ^ _pcg_hash(index).unsqueeze(0))
    h = _pcg_hash(h ^ (counter & _MASK32).unsqueeze(1))
    h = _pcg_hash(h ^ ((seed >> 32) & _MASK32).unsqueeze(1))
    return (h.to(torch.float32) + 0.5) * (1.0 / 4294967296.0)


@dataclass
class SamplerRows:
    """Per-row sampling parameters (all tensors of leading size `rows`)."""

    do_sample: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; 0 disables
    top_p: torch.Tensor  # float32; 1.0 disables
    seed: torch.Tensor  # int64
    counter: torch.Tensor  # int64; distinct for every draw of a row


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: every token generated before is penalised once."""
    penalty = penalty.unsqueeze(1).to(scores.dtype)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def warp(scores: torch.Tensor, rows: SamplerRows) -> torch.Tensor:
    """transformers' Temperature, TopK and TopP warpers with per-row parameters (float32 in and out)."""
    vocab = scores.shape[-1]
    neg_inf = float("-inf")
    warped = scores / rows.temperature.unsqueeze(1)
    sorted_desc, _ = torch.sort(warped, dim=-1, descending=True)
    k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), torch.full_like(rows.top_k, vocab))
    kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
    warped = warped.masked_fill(warped < kth, neg_inf)
    # ascending sort, drop the low tail whose mass is <= 1 - top_p, always keep the top token
    sorted_asc, order = torch.sort(warped, dim=-1, descending=False)
    cumulative = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - rows.top_p).unsqueeze(1)
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return warped.masked_fill(remove, neg_inf)


def warp_and_sample(scores: torch.Tensor, rows: SamplerRows, any_sampling: bool = True) -> torch.Tensor:
    """Warp and draw for sampling rows, argmax for greedy rows. Returns int64 [rows].

    `any_sampling=False` (known on the host when every row is greedy) skips the warping work.
    """
    scores = scores.float()
    greedy = scores.argmax(dim=-1)
    if not any_sampling:
        return greedy
    warped = warp(scores, rows)
    # Gumbel-max over the warped logits equals sampling from their softmax.
    gumbel = -torch.log(-torch.log(uniform_noise(rows.seed, rows.counter, scores.shape[-1])))
    sampled = (warped + gumbel).argmax(dim=-1)
    return torch.where(rows.do_sample, sampled, greedy)
