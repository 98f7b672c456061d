"""The CPU backend's draws: `engine.runner.sampling.sample`'s tokens, bit for bit, in a fraction of its ops.

A frame on the CPU backend is 31 graph calls with PyTorch's sampling between them, and there every op costs
a few microseconds of dispatch, and ten times that right after a graph call has streamed the predictor's
weights through the caches. `sample` spends about 70 ops on each of a frame's 16 draws, most of them on the
Gumbel noise of its candidates (four rounds of an integer hash, two logs) and on work whose result is thrown
away (the greedy argmax of sampling rows, a top-p cut that no row asks for). Here:

- the noise is computed once per frame, for every draw counter of the frame and every token id
  (`gumbel_table`): the integer hash in NumPy's wrapping uint32 arithmetic, which gives the int64 version's
  values since that one masks every product to the same 32 bits, then `_hashed_uniform`'s conversion and
  `gumbel_noise_at`'s two logs in PyTorch. A draw gathers its candidates' noise from the table. PyTorch's
  log gives a float the same value whatever the layout (checked once on every value the uniform can take:
  the vectorised and the strided kernels agree), so a candidate's noise is the value `gumbel_noise_at` gives it;
- what a frame's rows ask for is read once per frame (`FrameDraws`): which rows sample, whether any cuts
  below the candidate cap or asks for top-p, so a draw skips the ops whose result would be thrown away;
- candidates, values and noise go to preallocated buffers, the token into the caller's column.

Every kept op is the one `sample` runs, on the same values in the same order, so each row's token is the
same (tests/test_cpu_backend.py compares the two frame after frame).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...engine.runner import (
    PCG_INCREMENT,
    PCG_MULTIPLIER,
    PCG_WORD_MULTIPLIER,
    SamplerRows,
    hash_to_uniform,
)

_MASK32 = 0xFFFFFFFF


def _pcg_hash_(x: np.ndarray) -> np.ndarray:
    """`sampling._pcg_hash` in place on uint32, whose products wrap at 2**32 as the int64 version's masks do."""
    x *= np.uint32(PCG_MULTIPLIER)
    x += np.uint32(PCG_INCREMENT)
    word = x >> np.uint32(28)
    word += np.uint32(4)
    np.right_shift(x, word, out=word)
    word ^= x
    word *= np.uint32(PCG_WORD_MULTIPLIER)
    np.right_shift(word, np.uint32(22), out=x)
    x ^= word
    return x


def _low_words(values: torch.Tensor) -> np.ndarray:
    """int64 values & 0xFFFFFFFF as uint32 (two's complement, as the int64 hash masks negative values)."""
    return (values.numpy() & _MASK32).astype(np.uint32)


def index_hash(vocab: int) -> np.ndarray:
    """The hash of the token ids 0..vocab-1, the first round of every draw's (it depends on nothing else)."""
    return _pcg_hash_(np.arange(vocab, dtype=np.uint32))


def uniform_table(ids_hash: np.ndarray, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """`sampling.uniform_noise(seed, counter, vocab)` for seeds [rows] and counters [rows, n]: float32
    [rows, n, vocab]; `ids_hash` is `index_hash(vocab)`."""
    h = _pcg_hash_(_low_words(seed)[:, None] ^ ids_hash)[:, None, :] ^ _low_words(counter)[:, :, None]
    _pcg_hash_(h)
    h ^= _low_words(seed >> 32)[:, None, None]
    _pcg_hash_(h)
    return hash_to_uniform(torch.from_numpy(h.astype(np.int64)))  # `_hashed_uniform`'s conversion, on the same values


def gumbel_table(ids_hash: np.ndarray, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """`gumbel_noise_at(seed, counter[:, j], ids)` for every id and j at once: float32 [rows, n, vocab]."""
    return uniform_table(ids_hash, seed, counter).log_().neg_().log_().neg_()


class Sampler:
    """The draws of one vocabulary (the talker's codebook 0, or the predictor's codes): the hash of its token
    ids and the buffers a draw writes, for up to `max_rows` rows."""

    def __init__(self, vocab: int, cap: int, max_rows: int) -> None:
        self.cap = min(cap, vocab)  # `warp_candidates`' number of candidates
        self.ids_hash = index_hash(vocab)
        self.rank = torch.arange(self.cap)
        self.values = torch.zeros(max_rows, self.cap)
        self.ids = torch.zeros(max_rows, self.cap, dtype=torch.int64)
        self.noise = torch.zeros(max_rows, self.cap)

    def frame(self, rows: SamplerRows, seed: torch.Tensor, counter: torch.Tensor, sampling: bool) -> FrameDraws:
        """This frame's draws for `rows`, whose draw counters are `counter` [rows, draws] (`sampling`: whether
        any row may sample, the host's shortcut `sample` takes as `any_sampling`)."""
        do_sample = rows.do_sample
        b = do_sample.shape[0]
        if not sampling:
            return FrameDraws(self, b)
        top_k, top_p = rows.top_k.unsqueeze(1), rows.top_p.unsqueeze(1)
        cut = self.rank >= top_k
        nucleus = (self.rank > 0) & (top_p < 1.0)
        # one read of what the rows ask for: any sampling row, all of them, a top-k cut, a top-p cut
        any_sample, all_sample, any_cut, any_nucleus = torch.stack(
            (do_sample.any(), do_sample.all(), cut.any(), nucleus.any())
        ).tolist()
        if not any_sample:
            return FrameDraws(self, b)
        return FrameDraws(
            self, b, rows.temperature.unsqueeze(1), gumbel_table(self.ids_hash, seed, counter),
            cut=cut if any_cut else None, nucleus=(top_p, nucleus) if any_nucleus else None,
            mixed=None if all_sample else do_sample,
        )


@dataclass
class FrameDraws:
    """One frame's draws for rows [0, b) of a `Sampler`. `temperature` and `gumbel` (the noise of draw j at
    [:, j]) are None where no row samples: every draw is then the argmax. `cut` (rank >= top_k) and `nucleus`
    (top_p, and where a top-p cut may fall: rank > 0 and top_p < 1) are None where no row cuts there; `mixed`
    is the rows' do_sample where some are greedy, else None."""

    sampler: Sampler
    b: int
    temperature: torch.Tensor | None = None
    gumbel: torch.Tensor | None = None
    cut: torch.Tensor | None = None
    nucleus: tuple[torch.Tensor, torch.Tensor] | None = None
    mixed: torch.Tensor | None = None

    def draw(self, scores: torch.Tensor, j: int, out: torch.Tensor) -> torch.Tensor:
        """`sample(scores, rows, gumbel_at, cap)` for the frame's draw `j`, written to `out` (int64 [b])."""
        if self.temperature is None or self.gumbel is None:
            return torch.argmax(scores, dim=-1, out=out)
        s, b = self.sampler, self.b
        values, ids = torch.topk(scores, s.cap, dim=-1, out=(s.values[:b], s.ids[:b]))
        values.div_(self.temperature)
        if self.cut is not None:
            values.masked_fill_(self.cut, float("-inf"))
        if self.nucleus is not None:
            top_p, may_cut = self.nucleus
            probs = values.softmax(dim=-1)
            better_mass = probs.cumsum(dim=-1) - probs
            values.masked_fill_((better_mass >= top_p) & may_cut, float("-inf"))
        values.add_(torch.gather(self.gumbel[:, j], 1, ids, out=s.noise[:b]))
        if self.mixed is None:
            return torch.gather(ids, 1, values.argmax(dim=-1, keepdim=True), out=out.unsqueeze(1)).squeeze(1)
        drawn = ids.gather(1, values.argmax(dim=-1, keepdim=True)).squeeze(1)
        return torch.where(self.mixed, drawn, scores.argmax(dim=-1), out=out)
