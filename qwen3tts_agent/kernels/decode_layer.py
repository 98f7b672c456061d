"""A Qwen3 decoder layer's decode step (t tokens per row) as 4 + t launches: `decode_layer`.

A decode frame runs 28 talker layers and 75 predictor layer calls inside one CUDA graph, and the PyTorch
path spends about 22 small kernels per layer, so the frame is bound by kernel count rather than by bytes.
Here one layer is four products through the GEMV kernel (`gemv.gemv`) over all b·t token rows, and one
attention launch per token index (the predictor's first step feeds two tokens per row):

1. RMSNorm(x) · W_qkvᵀ. The norm is folded into the product: the K loop feeds x∘g to it and accumulates
   Σx² alongside, and the per-row 1/rms scales the result at the end.
2. `_attention_kernel`: per (row, kv head, key split): q_norm/k_norm, RoPE, the K/V cache write at
   `write_pos`, and single-query GQA attention with an online softmax in fp32: the query heads of one kv
   head, padded to 16 rows, meet each block of its keys and values in one `tl.dot`. Caches are split over
   keys (flash decoding) so that small batches still fill the GPU and each program's loop stays short; the
   last split to finish merges the partial softmaxes, so the merge costs no extra launch.
3. attn · W_oᵀ + x.
4. RMSNorm(x) · W_gate_upᵀ with matching gate and up rows in one program and the SiLU(gate)·up epilogue.
5. act · W_downᵀ + x.

Shapes: any GQA ratio (the group is padded to a power of two of at least 16 query rows) and any even
head_dim up to MAX_HEAD_DIM; a head_dim that is not a power of two is padded to the next one and the padding
lanes are masked. Both paddings are constexpr, so a power-of-two head_dim compiles to the kernel without
the masks. `supports` says which shapes run; the runner keeps other stacks on the PyTorch layers.

Under programmatic dependent launch (see `common`) with few rows the QKV product lets the next kernel start
only after its own wait (`late_qkv_trigger`), so attention can load its position, RoPE rows and first cache
block before waiting for q/k/v, and the frame kernels (`frame.py`) their scalars.

Intermediate roundings to the model dtype follow the PyTorch path where that is cheap, so bf16 results stay
close to it and fp32 results match it to ~1e-6. The arrival counters (`common.counters`) are allocated by
the first eager call: call `decode_layer` once before capturing a graph.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from . import codec_layer, common
from .common import arrived_last, dot, jit, round_to
from .gemv import GEMV_MAX_ROWS, gemv

try:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

BLOCK_KEYS = 32  # keys per attention step
KEYS_PER_PROGRAM = 128  # the attention loop is not software-pipelined: keep it short by splitting over keys
MAX_KV_SPLITS = 16
# `attention_tiles`' bounds: launches over at most SHORT_KEYS keys (the code predictor's: 16 positions) run
# one block of that many keys; up to FEW_ROWS rows, 8 warps; from MANY_ROWS rows, splits of twice
# KEYS_PER_PROGRAM keys.
SHORT_KEYS = 16
FEW_ROWS = 4
MANY_ROWS = 48
# Up to this many rows attention loads its first cache block with q/k/v (EARLY_KEYS in `_attention_kernel`):
# it shortens a few rows' step, but the registers it holds cost occupancy when thousands of programs run.
EARLY_KEYS_MAX_ROWS = 16
# Up to this many rows, under PDL, the QKV product lets attention start only after its own wait, and
# attention then loads its position, RoPE rows and first cache block before waiting for q/k/v.
PREFETCH_MAX_ROWS = 16
# Attention holds a [BLOCK_KEYS, head_dim] key block and a [query rows, head_dim] fp32 accumulator in
# registers; wider heads would spill, so they stay on the PyTorch layers.
MAX_HEAD_DIM = 256


class DecoderLayerWeights(Protocol):
    """What `decode_layer` reads of a layer: its sizes and its weights, rearranged for the decode path.

    `engine.runner.layers.FusedDecoderLayer` is one: w_qkv is [q; k; v] and w_gate_up [gate; up], both contiguous.
    """

    head_dim: int
    scaling: float
    q_size: int
    kv_size: int
    ffn: int
    eps: float
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w_qkv: torch.Tensor
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


def padded_head_dim(head_dim: int) -> int:
    """The head width the attention kernel computes in: a power of two, at least 16 (`tl.dot`'s minimum)."""
    return max(16, common.next_power_of_2(head_dim))


@functools.cache  # `decode_layer` asks on every call
def supports(head_dim: int, num_heads: int, kv_heads: int, dtype: torch.dtype, max_rows: int) -> common.Support:
    """Whether `decode_layer` takes a stack with these attention shapes, for up to `max_rows` rows a call."""
    dtype_ok = common.dtype_support(dtype)
    if not dtype_ok:
        return dtype_ok
    if head_dim % 2:
        return common.unsupported(f"odd head_dim {head_dim} not supported (RoPE rotates halves)")
    if head_dim > MAX_HEAD_DIM:
        return common.unsupported(f"head_dim {head_dim} above {MAX_HEAD_DIM} not supported")
    if kv_heads < 1 or num_heads % kv_heads:
        return common.unsupported(f"{num_heads} query heads in groups of {kv_heads} key-value heads not supported")
    if max_rows * kv_heads > common.COUNTER_SLOTS:
        return common.unsupported(f"{max_rows} rows x {kv_heads} key-value heads exceed the arrival counters")
    return common.SUPPORTED


# ----------------------------------------------------------------------------------------------- kernel


@jit
def _head_mask(mask, d, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """`mask` ([R, 1] or [R, D]) narrowed to the real head lanes when head_dim is padded; else `mask` itself."""
    if HEAD_DIM_P != HEAD_DIM:
        mask = mask & (d < HEAD_DIM)[None, :]
    return mask


@jit
def _load_head(ptrs, d, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """A [D] vector (norm gains, RoPE row, v) with the padding lanes, if any, as 0."""
    return tl.load(ptrs, mask=d < HEAD_DIM, other=0.0) if HEAD_DIM_P != HEAD_DIM else tl.load(ptrs)


@jit
def _norm_rope(head_ptrs, mask, d, d_rot, w_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """Per-head RMSNorm then x*cos + roll(x, d/2)*sin for heads [R, 1] -> [R, HEAD_DIM_P], in fp32 (padding 0)."""
    dt = head_ptrs.dtype.element_ty
    mask = _head_mask(mask, d, HEAD_DIM, HEAD_DIM_P)
    x = tl.load(head_ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(head_ptrs + d_rot[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    y = round_to(x * rstd * _load_head(w_ptr + d, d, HEAD_DIM, HEAD_DIM_P).to(tl.float32)[None, :], dt)
    y_rot = round_to(x_rot * rstd * _load_head(w_ptr + d_rot, d, HEAD_DIM, HEAD_DIM_P).to(tl.float32)[None, :], dt)
    return round_to(round_to(y * cos[None, :], dt) + round_to(y_rot * sin[None, :], dt), dt)


@jit
def _key_block(
    keys, values, j0, end, pos, stride_len, d, LIMIT_TO_POS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    """Cached keys and values j0..j0+BLOCK_KEYS-1 ([BLOCK_KEYS, D] each) and which of them are attended: below
    `end`, not the column being written (its key is used from registers), and <= pos when LIMIT_TO_POS."""
    j = j0 + tl.arange(0, BLOCK_KEYS)
    ok = (j < end) & (j != pos)
    if LIMIT_TO_POS:
        ok = ok & (j <= pos)
    offs = j[:, None] * stride_len + d[None, :]
    mask = _head_mask(ok[:, None], d, HEAD_DIM, HEAD_DIM_P)
    return tl.load(keys + offs, mask=mask, other=0.0), tl.load(values + offs, mask=mask, other=0.0), ok


@jit
def _attention_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_norm_ptr, k_norm_ptr, cache_k_ptr, cache_v_ptr, out_ptr,
    part_ptr, stat_ptr, count_ptr, read_len, keys_per_split, eps, scale,
    stride_qkv, stride_cos, stride_sin, stride_pos, stride_slot, stride_head, stride_len, stride_out,
    Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    SPLITS: tl.constexpr, LIMIT_TO_POS: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    EARLY_KEYS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One (row, kv head, key split): q/k norm + RoPE, K/V cache write, GQA attention of the head's GROUP queries.

    Key j is attended iff j < read_len (and j <= write_pos when LIMIT_TO_POS). The new key/value are used
    from registers rather than re-read from the cache, so no program reads a column another one writes. The
    GROUP queries are padded to Q_ROWS >= 16 rows so that both products run as tl.dot, and the head lanes
    to HEAD_DIM_P (a power of two) with the lanes past HEAD_DIM masked. EARLY_KEYS loads the first cache
    block before q and k are ready: shorter for a few rows, but those registers held across the norms cost
    occupancy when thousands of programs share the GPU. PREFETCH (with PDL) loads the position, its RoPE
    rows and that block before waiting for the QKV product; the caller guarantees that the kernel before
    started this one only after its own wait, so everything older than the product is complete.
    """
    if PDL and not PREFETCH:  # started early: let the next kernel start too, then wait for this one's inputs
        gdc_launch_dependents()
        gdc_wait()
    dt = cache_k_ptr.dtype.element_ty
    pid, split = tl.program_id(0), tl.program_id(1)
    row = pid // KV_HEADS
    head = pid % KV_HEADS
    d = tl.arange(0, HEAD_DIM_P)
    d_rot = (d + HEAD_DIM // 2) % HEAD_DIM
    g = tl.arange(0, Q_ROWS)
    g_ok = g < GROUP
    pos = tl.load(pos_ptr + row * stride_pos)
    slot = row.to(tl.int64) * stride_slot + head * stride_head
    keys, values = cache_k_ptr + slot, cache_v_ptr + slot
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, read_len)
    if LIMIT_TO_POS:
        # the keys past the row's own position are all masked: their blocks would leave the softmax's state as
        # it is (scores of -inf, weights of 0, a rescale by 1), so the loop stops at the position instead of
        # at read_len, the longest row's bucket (a talker step's rows sit at every position below it)
        end = tl.minimum(end, pos + 1)
    if EARLY_KEYS:
        # The first cache block goes out with the q/k/v loads: earlier steps wrote it, not the QKV product,
        # so the two latencies overlap instead of following each other.
        kb, vb, ok = _key_block(keys, values, start, end, pos, stride_len, d, LIMIT_TO_POS, BLOCK_KEYS, HEAD_DIM, HEAD_DIM_P)
    # the tables' rows are positions
    cos = _load_head(cos_ptr + pos * stride_cos + d, d, HEAD_DIM, HEAD_DIM_P).to(tl.float32)
    sin = _load_head(sin_ptr + pos * stride_sin + d, d, HEAD_DIM, HEAD_DIM_P).to(tl.float32)
    if PDL and PREFETCH:
        gdc_launch_dependents()
        gdc_wait()
    qkv = qkv_ptr + row * stride_qkv
    q_heads = qkv + (head * GROUP + g)[:, None] * HEAD_DIM
    q = _norm_rope(q_heads, g_ok[:, None], d, d_rot, q_norm_ptr, cos, sin, eps, HEAD_DIM, HEAD_DIM_P)  # [Q_ROWS, D]
    k_head = qkv + Q_SIZE + head * HEAD_DIM + tl.zeros((1, 1), tl.int32)
    k = _norm_rope(k_head, tl.full((1, 1), True, tl.int1), d, d_rot, k_norm_ptr, cos, sin, eps, HEAD_DIM, HEAD_DIM_P)
    v = _load_head(qkv + Q_SIZE + KV_SIZE + head * HEAD_DIM + d, d, HEAD_DIM, HEAD_DIM_P).to(tl.float32)

    first = split == 0
    tl.store(keys + pos * stride_len + d[None, :], k.to(dt), mask=first & (d[None, :] < HEAD_DIM))
    tl.store(values + pos * stride_len + d, v.to(dt), mask=first & (d < HEAD_DIM))

    # split 0 starts its online softmax from the new key when that key is in range
    s_new = round_to(round_to(tl.sum(q * k, axis=1), dt) * scale, dt)
    new_ok = first & (pos < read_len)
    m_i = tl.where(new_ok, s_new, -1.0e30)  # finite, so that exp(m_old - m_new) never sees inf - inf
    l_i = tl.where(new_ok, 1.0, 0.0) + tl.zeros((Q_ROWS,), tl.float32)
    acc = tl.where(new_ok, v[None, :], 0.0) + tl.zeros((Q_ROWS, HEAD_DIM_P), tl.float32)
    q = q.to(dt)
    if not EARLY_KEYS:
        kb, vb, ok = _key_block(keys, values, start, end, pos, stride_len, d, LIMIT_TO_POS, BLOCK_KEYS, HEAD_DIM, HEAD_DIM_P)
    j0 = start
    while j0 < end:  # a while loop: the interpreter cannot range() over runtime bounds with numpy >= 2.4
        s = dot(q, tl.trans(kb), tl.zeros((Q_ROWS, BLOCK_KEYS), tl.float32), DOT_F32, PRECISION)
        s = tl.where(ok[None, :], round_to(round_to(s, dt) * scale, dt), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = dot(p.to(dt), vb, acc * alpha[:, None], DOT_F32, PRECISION)
        m_i = m_new
        j0 += BLOCK_KEYS
        # The next block (fully masked past the end: no traffic). Loading it before reducing this one would
        # hold two blocks in registers, which slows attention at large batches.
        kb, vb, ok = _key_block(keys, values, j0, end, pos, stride_len, d, LIMIT_TO_POS, BLOCK_KEYS, HEAD_DIM, HEAD_DIM_P)

    out = out_ptr + row * stride_out + (head * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
    rows_ok = _head_mask(g_ok[:, None], d, HEAD_DIM, HEAD_DIM_P)
    if SPLITS == 1:
        tl.store(out, (acc / l_i[:, None]).to(dt), mask=rows_ok)
    else:
        # partials of the GROUP real rows: acc [pid, split, GROUP, HEAD_DIM], (m, l) [pid, split, 2, GROUP]
        part = part_ptr + (pid * SPLITS * GROUP + g[:, None]) * HEAD_DIM + d[None, :]
        stat = stat_ptr + pid * SPLITS * 2 * GROUP + g
        tl.store(part + split * GROUP * HEAD_DIM, acc, mask=rows_ok)
        tl.store(stat + split * 2 * GROUP, m_i, mask=g_ok)
        tl.store(stat + split * 2 * GROUP + GROUP, l_i, mask=g_ok)
        if arrived_last(count_ptr + pid, SPLITS):
            m_all = tl.full((Q_ROWS,), -1.0e30, tl.float32)
            l_all = tl.zeros((Q_ROWS,), tl.float32)
            merged = tl.zeros((Q_ROWS, HEAD_DIM_P), tl.float32)
            for s in tl.static_range(SPLITS):  # merge the splits' softmaxes in a fixed order
                m_s = tl.load(stat + s * 2 * GROUP, mask=g_ok, other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(stat + s * 2 * GROUP + GROUP, mask=g_ok, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(part + s * GROUP * HEAD_DIM, mask=rows_ok, other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_all, m_s)
                alpha, beta = tl.exp(m_all - m_new), tl.exp(m_s - m_new)
                l_all = l_all * alpha + l_s * beta
                merged = merged * alpha[:, None] + acc_s * beta[:, None]
                m_all = m_new
            tl.store(out, (merged / l_all[:, None]).to(dt), mask=rows_ok)
            tl.store(count_ptr + pid, 0)  # ready for the next launch


# ----------------------------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class AttentionTiles:
    """How one attention launch cuts its work: keys per loop step (`block_keys`, at least 16 for `tl.dot`),
    the most keys one program walks before the cache is split over more programs (`keys_per_program`), warps
    per program, and whether the first key block is loaded with q/k/v (`early_keys`, `_attention_kernel`)."""

    block_keys: int = BLOCK_KEYS
    keys_per_program: int = KEYS_PER_PROGRAM
    num_warps: int = 4
    early_keys: bool = False


def attention_tiles(rows: int, read_len: int, dtype: torch.dtype) -> AttentionTiles:
    """The tiles of a launch over `rows` rows attending `read_len` keys, as `benchmarks/kernels/bench_attention.py`
    timed them on an H200 (docs/kernels.md): 16-bit launches over a few keys (the code predictor's) as one
    16-key block on one warp, which leaves registers for several times as many programs per SM (the launch is
    a chain of dependent loads, so resident programs are what hides it); a few rows on 8 warps; many rows
    over long caches in fewer, longer splits. fp32 (the parity mode) keeps one tiling for every shape."""
    if dtype == torch.float32:
        return AttentionTiles(num_warps=8, early_keys=rows <= EARLY_KEYS_MAX_ROWS)  # FMA dots need 8 warps' registers
    if read_len <= SHORT_KEYS:
        return AttentionTiles(block_keys=SHORT_KEYS, num_warps=1, early_keys=True)
    if rows <= FEW_ROWS:
        return AttentionTiles(num_warps=8, early_keys=True)
    if rows >= MANY_ROWS:
        return AttentionTiles(keys_per_program=2 * KEYS_PER_PROGRAM)
    return AttentionTiles(early_keys=rows <= EARLY_KEYS_MAX_ROWS)


def kv_splits(
    programs: int, read_len: int, device: torch.device, tiles: AttentionTiles = AttentionTiles()
) -> tuple[int, int]:
    """(splits, keys per split) for attention: about two programs per SM and short loops, whole key blocks."""
    block = tiles.block_keys
    want = max(common.cdiv(2 * common.sm_count(device), programs), common.cdiv(read_len, tiles.keys_per_program))
    want = min(want, MAX_KV_SPLITS, common.cdiv(read_len, block))
    per_split = common.cdiv(common.cdiv(read_len, want), block) * block
    return common.cdiv(read_len, per_split), per_split


def _token(t: torch.Tensor, i: int) -> torch.Tensor:
    """[b, t, n] -> the [b, n] view of token i; kernels take the row stride (0 for expanded tensors)."""
    rows = t[:, i]
    if rows.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    return rows


def _attention(
    layer: DecoderLayerWeights,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    out: torch.Tensor,
    read_len: int,
    masked: bool,
    prefetch: bool,
    tiles: AttentionTiles | None = None,
) -> None:
    """One `_attention_kernel` launch for one token of each of b rows: qkv, out [b, n], pos [b]; cos and sin are
    the RoPE tables [positions, head_dim]. `tiles`: `attention_tiles`' choice unless given (benchmarks)."""
    b, d = qkv.shape[0], layer.head_dim
    kv_heads, group = layer.kv_size // d, layer.q_size // layer.kv_size
    if tiles is None:
        tiles = attention_tiles(b, read_len, qkv.dtype)
    splits, per_split = kv_splits(b * kv_heads, read_len, qkv.device, tiles)
    partials = torch.empty(b * kv_heads, splits, group, d, device=qkv.device, dtype=torch.float32)
    stats = torch.empty(b * kv_heads, splits, 2, group, device=qkv.device, dtype=torch.float32)
    _attention_kernel[(b * kv_heads, splits)](
        qkv, cos, sin, pos, layer.q_norm, layer.k_norm, cache_k, cache_v, out,
        partials, stats, common.counters(qkv.device), read_len, per_split, layer.eps, layer.scaling,
        qkv.stride(0), cos.stride(0), sin.stride(0), pos.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), out.stride(0),
        Q_SIZE=layer.q_size, KV_SIZE=layer.kv_size, KV_HEADS=kv_heads, GROUP=group,
        Q_ROWS=max(16, common.next_power_of_2(group)), HEAD_DIM=d, HEAD_DIM_P=padded_head_dim(d), BLOCK_KEYS=tiles.block_keys,
        SPLITS=splits, LIMIT_TO_POS=masked, DOT_F32=common.interpreting(), PRECISION=common.dot_precision(qkv.dtype),
        EARLY_KEYS=tiles.early_keys, PREFETCH=prefetch, num_warps=tiles.num_warps,
        **common.pdl_options(qkv.device),
    )


def late_qkv_trigger(batch: int, tokens: int = 1) -> bool:
    """Whether `decode_layer`'s QKV product (under PDL) lets the next kernel start only after its own wait, so
    that the kernels after it may load, before their own wait, whatever was written before that product."""
    return batch <= PREFETCH_MAX_ROWS and batch * tokens <= GEMV_MAX_ROWS


def decode_layer(
    layer: DecoderLayerWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    write_pos: torch.Tensor,
    read_len: int,
    *,
    masked: bool = True,
) -> torch.Tensor:
    """`FusedDecoderLayer(x, cos[write_pos], sin[write_pos], cache_k, cache_v, arange(b)[:, None], write_pos,
    slice(0, b), read_len, mask)` for a layer `supports` takes.

    x [b, t, hidden], cos/sin the RoPE tables [positions, head_dim] (row p for position p), write_pos [b, t]
    int64 on the device: row r uses cache slot r and writes token i's key at write_pos[r, i]. Token i attends
    the keys below read_len - (t - 1 - i), i.e. not those of the tokens after it, and with `masked=True` only
    keys <= write_pos[r, i] (mask = arange(read_len) <= write_pos: the talker step). `masked=False` stands for
    mask=None; for t > 1 the layer then aligns its causal mask top-left (SDPA is_causal), which agrees only
    when read_len == t (the predictor's first step: positions 0 and 1). A row's positions must increase along
    t and stay below the cache length (unchecked: that would sync with the host). Returns a new
    [b, t, hidden] tensor and writes the caches in place.

    The four products take all b·t token rows at once, as `gemv` up to GEMV_MAX_ROWS rows and as cuBLAS GEMMs
    above, with the norms, the first residual add and SwiGLU between them as three `codec_layer` kernels
    (PyTorch's ops take five: each is a launch of a few microseconds on every layer of the talker and the
    predictor's fifteen steps; `decode_layers` also folds each layer's last residual add into the next norm).
    Attention is one launch per token index over strided views; token i reads the keys that the launches of
    tokens < i wrote, which stream order makes visible.
    """
    return decode_layers([layer], [cache_k], [cache_v], x, cos, sin, write_pos, read_len, masked=masked)


def decode_layers(
    layers: Sequence[DecoderLayerWeights],
    caches_k: Sequence[torch.Tensor],
    caches_v: Sequence[torch.Tensor],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_pos: torch.Tensor,
    read_len: int,
    *,
    masked: bool = True,
) -> torch.Tensor:
    """`decode_layer` through a stack, layer i on caches_k[i] / caches_v[i]. Above GEMV_MAX_ROWS rows a layer's
    output is left as its residual stream and its MLP's product, which the next layer's input norm adds
    (`codec_layer.add_rms_norm`): one launch fewer a layer, the same roundings as the layers one by one."""
    pending = None
    for layer, cache_k, cache_v in zip(layers, caches_k, caches_v, strict=True):
        x, pending = _layer(layer, x, pending, cos, sin, cache_k, cache_v, write_pos, read_len, masked)
    return x if pending is None else x + pending


def _layer(
    layer: DecoderLayerWeights,
    x: torch.Tensor,
    pending: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    write_pos: torch.Tensor,
    read_len: int,
    masked: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer on the input x + `pending` (None: x alone; only above GEMV_MAX_ROWS rows). Returns the output
    whole and None up to GEMV_MAX_ROWS rows; above, the residual stream and the MLP's product, unsummed."""
    b, t, hidden = x.shape
    d = layer.head_dim
    kv_heads, n_q = layer.kv_size // d, layer.q_size // d
    support = supports(d, n_q, kv_heads, x.dtype, b)
    if not support:
        raise ValueError(f"decode_layer: {support.reason}")
    if cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        raise ValueError("the K and V caches must share one layout, contiguous along head_dim")
    weights = (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)
    if any(w.dtype != x.dtype or not w.is_contiguous() for w in weights) or cache_k.dtype != x.dtype:
        raise ValueError("x, the (contiguous) weights and the caches must share one dtype")
    if write_pos.dtype != torch.int64 or write_pos.shape != (b, t) or not t <= read_len <= cache_k.shape[2]:
        raise ValueError("write_pos must be int64 [b, t] and read_len within the cache, at least t")
    dev, dt = x.device, x.dtype
    rows = b * t
    x2 = x.reshape(rows, hidden)

    gemv_rows = rows <= GEMV_MAX_ROWS
    if gemv_rows and pending is not None:
        raise ValueError("a pending residual comes only with more than GEMV_MAX_ROWS rows")
    # a few rows' first attention launch loads its cache block and RoPE rows while the QKV product runs
    prefetch = late_qkv_trigger(b, t)
    if gemv_rows:
        qkv = torch.empty(rows, layer.w_qkv.shape[0], device=dev, dtype=dt)
        gemv(x2, layer.w_qkv, qkv, norm=layer.in_norm, eps=layer.eps, late_trigger=prefetch)
    else:
        if pending is None:
            normed = codec_layer.rms_norm(x2, layer.in_norm, layer.eps)
        else:
            x2, normed = codec_layer.add_rms_norm(x2, pending.view(rows, hidden), layer.in_norm, layer.eps)
        qkv = F.linear(normed, layer.w_qkv)

    attn = torch.empty(b, t, layer.q_size, device=dev, dtype=dt)
    qkv3 = qkv.view(b, t, -1)
    for i in range(t):
        _attention(
            layer, _token(qkv3, i), cos, sin, write_pos[:, i], cache_k, cache_v,
            _token(attn, i), read_len - (t - 1 - i), masked, prefetch and i == 0,  # token i > 0 reads token i - 1's key
        )
    attn = attn.view(rows, layer.q_size)

    if not gemv_rows:
        x1, normed = codec_layer.add_rms_norm(x2, F.linear(attn, layer.w_o), layer.post_norm, layer.eps)
        act = codec_layer.silu_mul(F.linear(normed, layer.w_gate_up))
        return x1.view(b, t, hidden), F.linear(act, layer.w_down).view(b, t, hidden)
    x1 = torch.empty(rows, hidden, device=dev, dtype=dt)
    gemv(attn, layer.w_o, x1, residual=x2)
    act = torch.empty(rows, layer.ffn, device=dev, dtype=dt)
    gemv(x1, layer.w_gate_up, act, norm=layer.post_norm, eps=layer.eps, gated=True)
    out = torch.empty(b, t, hidden, device=dev, dtype=dt)
    gemv(act, layer.w_down, out.view(rows, hidden), residual=x1)
    return out, None
