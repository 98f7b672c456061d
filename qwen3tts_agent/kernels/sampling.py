"""The logits processing, warping and draw of `engine.runner.sampling.sample` for one row, as Triton code (`sample_row`).

A frame's kernels (`frame.py`) sample with it inside their per-row bookkeeping; `fused_sample` runs it alone,
one launch for a batch of rows, which is how the tests hold it against the PyTorch reference.

The PyTorch path hashes noise for the candidates (`gumbel_noise_at`) and runs argmax, topk, softmax and cumsum
as separate kernels; with 16 samplings per frame that is a large share of a small
batch's frame. Here one program per row loads the scores, applies the talker's repetition penalty and
suppression, and then either takes the argmax (greedy rows) or selects the `cap` best tokens with a bitonic
top-k, applies temperature, top-k and top-p exactly as `warp_candidates` does, and draws by Gumbel-max with
the same (seed, counter, token id) hash, evaluated for those candidates only. Launch shapes depend only on
(rows, vocab, cap) and nothing synchronises with the host, so the call can be captured in a CUDA graph.

The sort keys carry the score above the token id. Scores that are bf16 logits untouched by a penalty (the
code predictor's) have only 16 significant bits, so their keys fit in int32, which sorts faster than the
int64 keys that fp32 scores need.

Equal scores are ordered by ascending token id: greedy rows return the lowest id among the maxima (as
torch.argmax does), and candidates are ranked by descending score, then ascending id. torch.topk leaves the
order of ties unspecified, so with ties the top-k boundary and the top-p cut may differ from the PyTorch
path; without ties the drawn tokens are the same. -0.0 counts as +0.0.
"""

from __future__ import annotations

import contextlib

import torch

from . import common
from .common import expf, jit, logf

with contextlib.suppress(ImportError):  # keeps the module importable without triton; common.available() reports False
    import triton.language as tl


def supports(dtype: torch.dtype) -> common.Support:
    """Any vocabulary and top-k cap; logits in a dtype the kernels are tested in."""
    return common.dtype_support(dtype)


@jit
def _pcg_hash(x):
    """`sampling._pcg_hash` on uint32, where the multiplications wrap by themselves."""
    state = x * 747796405 + 2891336453
    word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737
    return (word >> 22) ^ word


@jit
def _draw(
    s, temperature, top_k, top_p, seed, counter,
    VP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, KEY32: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Gumbel-max over the warped top-K candidates of the scores s [VP] (-inf padded): the token id.

    KEY32: every score is a bf16 value (the low 16 bits of its fp32 image are zero).
    """
    # sort keys: an order-preserving image of the score above the inverted token id, so that one descending
    # sort ranks by score, then by ascending id
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    inverted_id = VP - 1 - tl.arange(0, VP)
    if KEY32:
        high = bits >> 16
        high = tl.where(high < 0, high ^ 0x7FFF, high)
        keys = tl.topk((high << 16) | inverted_id, KP)
        high = keys >> 16
        value = (tl.where(high < 0, high ^ 0x7FFF, high) << 16).to(tl.float32, bitcast=True)
        token = VP - 1 - (keys & 0xFFFF)
    else:
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        keys = tl.topk((bits.to(tl.int64) << 32) | inverted_id, KP)
        high = (keys >> 32).to(tl.int32)
        value = tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)
        token = VP - 1 - keys.to(tl.int32)
    # warp_candidates: temperature, top-k, then drop a candidate whose better-ranked mass reaches top_p < 1
    rank = tl.arange(0, KP)
    logit = tl.math.div_rn(value, temperature)
    logit = tl.where((rank < K) & (rank < top_k), logit, float("-inf"))
    e = expf(logit - tl.max(logit, 0), LIBDEVICE)  # as PyTorch's CUDA softmax
    probs = tl.math.div_rn(e, tl.sum(e, 0))
    better = tl.cumsum(probs, 0) - probs
    cut = tl.where(top_p < 1.0, top_p, float("inf"))  # as in transformers, top_p >= 1 cuts nothing
    logit = tl.where((better >= cut) & (rank > 0), float("-inf"), logit)
    # uniform_noise for these token ids, then -log(-log(u))
    h = _pcg_hash(seed.to(tl.uint32) ^ _pcg_hash(token.to(tl.uint32)))
    h = _pcg_hash(h ^ counter.to(tl.uint32))
    h = _pcg_hash(h ^ (seed >> 32).to(tl.uint32))
    u = (h.to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
    gumbel = -logf(-logf(u, LIBDEVICE), LIBDEVICE)  # +inf where u rounds to 1: never for a removed candidate
    choice = tl.argmax(tl.where(logit == float("-inf"), logit, logit + gumbel), 0, tie_break_left=True)
    return tl.sum(tl.where(rank == choice, token, 0), 0).to(tl.int64)


@jit
def sample_row(
    scores_ptr, do_sample, temperature, top_k, top_p, seed, counter, seen_ptr, penalty, suppress_ptr, eos_id,
    eos_blocked, V: tl.constexpr, VP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, PENALTY: tl.constexpr,
    SUPPRESS: tl.constexpr, EOS: tl.constexpr, KEY32: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """The sampled (or argmax) token of one row of scores after the optional talker processors: the
    repetition penalty (`seen_ptr`: the row's flags), `suppress_ptr`, and token `eos_id` when `eos_blocked`."""
    idx = tl.arange(0, VP)
    in_vocab = idx < V
    s = tl.load(scores_ptr + idx, mask=in_vocab, other=float("-inf")).to(tl.float32)
    if PENALTY:
        seen = tl.load(seen_ptr + idx, mask=in_vocab, other=0) != 0
        s = tl.where(seen, tl.where(s < 0, s * penalty, tl.math.div_rn(s, penalty)), s)
    if SUPPRESS:
        s = tl.where(tl.load(suppress_ptr + idx, mask=in_vocab, other=0) != 0, float("-inf"), s)
    if EOS:
        s = tl.where((idx == eos_id) & eos_blocked, float("-inf"), s)
    if do_sample:
        token = _draw(s, temperature, top_k, top_p, seed, counter, VP, K, KP, KEY32, LIBDEVICE)
    else:
        token = tl.argmax(s, 0, tie_break_left=True).to(tl.int64)
    return token


@jit
def _sample_kernel(
    scores_ptr, stride_scores, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, counter_ptr, out_ptr,
    seen_ptr, penalty_ptr, suppress_ptr, eos_blocked_ptr, stride_seen, eos_id, V: tl.constexpr, VP: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, PENALTY: tl.constexpr, SUPPRESS: tl.constexpr, EOS: tl.constexpr,
    KEY32: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """out[row] = the sampled (or argmax) token of scores[row] after the optional talker processors."""
    row = tl.program_id(0).to(tl.int64)
    token = sample_row(
        scores_ptr + row * stride_scores, tl.load(do_sample_ptr + row) != 0, tl.load(temperature_ptr + row),
        tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), tl.load(seed_ptr + row), tl.load(counter_ptr + row),
        seen_ptr + row * stride_seen, tl.load(penalty_ptr + row) if PENALTY else 1.0, suppress_ptr, eos_id,
        tl.load(eos_blocked_ptr + row) != 0 if EOS else False, V, VP, K, KP, PENALTY, SUPPRESS, EOS, KEY32, LIBDEVICE,
    )
    tl.store(out_ptr + row, token)


def sampling_shapes(vocab: int, cap: int, bf16_logits: bool) -> dict[str, int | bool]:
    """The sampling constexprs for a vocabulary and top-k cap; `bf16_logits`: the scores are untouched bf16."""
    k, vp = min(cap, vocab), common.next_power_of_2(vocab)
    return {"V": vocab, "VP": vp, "K": k, "KP": common.next_power_of_2(k), "KEY32": bf16_logits and vp <= 1 << 16}


def sampling_warps(vocab: int) -> int:
    """`fused_sample`'s warps: about 16 sort keys per thread (the frame kernels set their own)."""
    return max(1, min(8, common.next_power_of_2(vocab) // 512))


def fused_sample(
    scores: torch.Tensor,
    do_sample: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    cap: int,
    out: torch.Tensor,
    *,
    seen: torch.Tensor | None = None,
    penalty: torch.Tensor | None = None,
    suppress: torch.Tensor | None = None,
    eos_id: int = -1,
    eos_blocked: torch.Tensor | None = None,
) -> None:
    """Write into `out` (int64 [b]) what `sampling.sample` draws from `scores` [b, V] (row stride free).

    Per row: do_sample (bool), temperature (fp32), top_k (int64, 1..cap; ignored by greedy rows), top_p (fp32),
    seed (int64) and counter (int64: this sampling's draw counter, as given to `gumbel_noise`). The talker's
    processors come first when given: repetition penalty (`seen` bool [b, V], `penalty` fp32 [b]), `suppress`
    (bool [V]) and, for rows with `eos_blocked` (bool [b]), token `eos_id` to -inf.
    """
    b, vocab = scores.shape
    rows = (do_sample, temperature, top_k, top_p, seed, counter, out)
    if any(t.shape != (b,) or not t.is_contiguous() for t in rows):
        raise ValueError("the per-row arguments must be contiguous [b] tensors")
    if scores.stride(1) != 1 or (seen is not None and seen.stride(1) != 1):
        raise ValueError("scores and seen must be contiguous along the vocabulary")
    if (seen is None) != (penalty is None) or (eos_blocked is not None and not 0 <= eos_id < vocab):
        raise ValueError("seen needs penalty, and eos_blocked an eos_id within the vocabulary")
    optional = [t if t is not None else out for t in (seen, penalty, suppress, eos_blocked)]  # unused if None
    _sample_kernel[(b,)](
        scores,
        scores.stride(0),
        *rows,
        *optional,
        seen.stride(0) if seen is not None else 0,
        eos_id,
        **sampling_shapes(vocab, cap, scores.dtype == torch.bfloat16 and seen is None),
        PENALTY=seen is not None,
        SUPPRESS=suppress is not None,
        EOS=eos_blocked is not None,
        LIBDEVICE=not common.interpreting(),
        num_warps=sampling_warps(vocab),
    )
