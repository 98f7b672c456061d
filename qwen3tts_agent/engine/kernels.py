"""Triton kernels for the decode steps of a `FusedDecoderLayer` (t tokens per row): 4 + t launches per layer.

A decode frame runs 28 talker layers and 75 predictor layer calls inside one CUDA graph, and the PyTorch
path spends about 22 small kernels per layer, so the frame is bound by kernel count rather than by bytes.
Here one layer is four products through one GEMV kernel (`gemv`) over all b·t token rows, and one attention
kernel launch per token index (the predictor's first step feeds two tokens per row):

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

A decode GEMV moves megabytes of weights for a handful of rows, so its time is the latency of getting those
bytes in flight: the kernel streams row-major weights [N, K] in [BLOCK_N, BLOCK_K] tiles (K contiguous, so
loads vectorise) through `tl.dot` against the rows padded to 16..64, accumulating in fp32, and splits K
until the grid fills the GPU; the last split of a tile to arrive reduces the partial sums in a fixed order
(deterministic, no atomics on data). The tile shapes per product shape (`gemv_tiles`) come from a sweep on
an H200 (`benchmarks/sweep_gemv.py`).

Under programmatic dependent launch (PDL) each kernel starts while the one before it runs and loads, before
its wait, what no kernel in flight writes: a GEMV its weights. With few rows the QKV product lets the next
kernel start only after its own wait (`late_qkv_trigger`), so attention can also load its position, RoPE rows
and first cache block early, and the frame kernels their scalars; on an H200 that took 0.26 ms off a 0.6B
frame. A GEMV loads its residual tile with its inputs rather than after the split reduction.

Grids and block sizes depend only on Python ints (batch, widths, read_len), nothing is autotuned at run
time, and nothing synchronises with the host, so the path is CUDA-graph capturable. Intermediate roundings
to the model dtype follow the PyTorch path where that is cheap, so bf16 results stay close to it and fp32
results match it to ~1e-6.

"Last to arrive" uses one arrival counter per output tile in a per-device int32 buffer that every launch
leaves zeroed; it is allocated by the first (eager) call, so call `decode_layer` once before capturing a
graph, and do not run two decode steps concurrently on different streams of one device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # keeps the module importable on installs without triton; available() reports False
    triton = None

from .layers import FusedDecoderLayer

# Up to this many rows the products run as `gemv`; above it cuBLAS GEMMs tile the batch better, and the
# layer keeps only the attention kernel (sweep and layer timings in benchmarks/results/2026-11-29-h200-c/)
GEMV_MAX_ROWS = 64
BLOCK_KEYS = 32  # keys per attention step
KEYS_PER_PROGRAM = 128  # the attention loop is not software-pipelined: keep it short by splitting over keys
MAX_KV_SPLITS = 16
# Up to this many rows attention loads its first cache block with q/k/v (`_attention_kernel`); on an H200
# that helped a 1-4 row frame, while at 256 rows it took attention from 5.2 to 5.7 ms per frame.
EARLY_KEYS_MAX_ROWS = 16
# Up to this many rows, under PDL, the QKV product lets attention start only after its own wait, and
# attention then loads its position, RoPE rows and first cache block before waiting for q/k/v.
PREFETCH_MAX_ROWS = 16
# Programmatic dependent launch (Hopper and later): each GEMV starts while the kernel before it finishes and
# loads its first weights meanwhile; CUDA-graph capture keeps the launches' dependency type. None: on where
# the GPU has it (compute capability 9.0 and up). On an H200 it took a 0.6B frame from 4.09 to 3.88 ms with
# the same tokens (benchmarks/results/2026-11-30-h200/).
PROGRAMMATIC_LAUNCH: bool | None = None
_COUNTER_SLOTS = 1 << 16  # one per (row, kv head) or GEMV output tile; far more than any layer needs
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _jit(fn: Callable) -> Callable:
    return triton.jit(fn) if triton is not None else fn


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """True when these kernels can run on `device`: triton imports and the device is CUDA (or interpreted)."""
    return triton is not None and (torch.device(device).type == "cuda" or _interpreting())


# ----------------------------------------------------------------------------------------------- kernels


@_jit
def _round(x, dtype: tl.constexpr):
    """x rounded to the model dtype, back in fp32: the PyTorch path stores its intermediates in that dtype."""
    return x.to(dtype).to(tl.float32)


@_jit
def _dot(a, b, acc, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b. The interpreter multiplies bf16 as raw integers, so there both sides go to fp32 first."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@_jit
def _arrived_last(counter_ptr, arrivals: tl.constexpr):
    """Count this program in; True for the last of `arrivals`, which then sees every earlier program's stores."""
    tl.debug_barrier()  # all of this program's partial stores happen before the release below
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@_jit
def _gemv_epilogue(
    acc, acc_up, sumsq, res, out_ptr, n, m, n_ok, m_ok, eps, stride_out,
    K_DIM: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, BIAS: tl.constexpr,
):
    """Scale by 1/rms (NORM), SiLU(gate)*up (GATED), add the residual tile `res` (RESIDUAL), store [m, n]
    transposed.

    Each rounding to the model dtype is one the PyTorch path makes when it stores an intermediate; a bias
    (BIAS: the residual is the bias, row stride 0) is added before the one rounding, as in cuBLAS's epilogue.
    """
    dt = out_ptr.dtype.element_ty
    mask = n_ok[:, None] & m_ok[None, :]
    if NORM:
        rstd = tl.math.rsqrt(sumsq / K_DIM + eps)[None, :]
        y = _round(acc * rstd, dt)
        if GATED:
            up = _round(acc_up * rstd, dt)
            y = _round(_round(y / (1.0 + tl.exp(-y)), dt) * up, dt)
    elif BIAS:
        y = acc
    else:
        y = _round(acc, dt)
    if RESIDUAL:
        y = y + res
    tl.store(out_ptr + m[None, :] * stride_out + n[:, None], y.to(dt), mask=mask)


@_jit
def _gemv_residual(res_ptr, n, m, n_ok, m_ok, stride_res, RESIDUAL: tl.constexpr):
    """The residual tile [BLOCK_N, BLOCK_M] in fp32 (RESIDUAL), loaded with the inputs so that it is at hand
    when the reduction ends: a load after it would add a memory round trip to the kernel's latency."""
    res = 0.0
    if RESIDUAL:
        res = tl.load(res_ptr + m[None, :] * stride_res + n[:, None], mask=n_ok[:, None] & m_ok[None, :], other=0.0)
        res = res.to(tl.float32)
    return res


@_jit
def _gemv_inputs(
    x_ptr, g_ptr, k, m, m_ok, stride_x, sumsq, K_DIM: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr
):
    """The rows' inputs at k, transposed for the product ([BLOCK_K, BLOCK_M]): times the norm gains when NORM,
    with Σx² accumulated alongside (only without K splits: split programs see part of the row)."""
    k_ok = k < K_DIM
    x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        if SPLITS == 1:
            sumsq += tl.sum(xf * xf, axis=1)
        x = (xf * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
    return tl.trans(x), sumsq


@_jit
def _gemv_weights(w_ptr, n, n_ok, k, K_DIM: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile of output rows n at inputs k."""
    return tl.load(w_ptr + n[:, None] * K_DIM + k[None, :], mask=n_ok[:, None] & (k < K_DIM)[None, :], other=0.0)


@_jit
def _gemv_kernel(
    x_ptr, g_ptr, w_ptr, res_ptr, out_ptr, part_ptr, count_ptr, rows, eps, stride_x, stride_res, stride_out,
    N_OUT: tl.constexpr, K_DIM: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    BIAS: tl.constexpr, ROW_TILES: tl.constexpr, SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr,
):
    """out = epilogue(x' · w[:N_OUT]ᵀ) with x' = x∘g when NORM (the 1/rms factor is applied at the end).

    Program (tile, split) takes BLOCK_N outputs of BLOCK_M rows over SPLIT_BLOCKS K blocks. With SPLITS > 1
    the partial sums go to `part_ptr` and the tile's last split to arrive adds them in a fixed order
    (deterministic, no atomics on data) and runs the epilogue; it then recomputes Σx² over the whole row.
    Row tiles vary fastest over program ids, so the programs that share a weight tile run together.

    PDL (programmatic dependent launch): the kernel may start while the previous one still runs; it loads
    its first weight block, which nothing before it writes, and only then waits for that kernel's results.
    It lets the next kernel start before that wait, or after it with LATE_TRIGGER, which lets the next kernel
    read early whatever was written before this one's inputs.
    """
    tile, split = tl.program_id(0), tl.program_id(1)
    n = (tile // ROW_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (tile % ROW_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N_OUT, m < rows
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    first: tl.constexpr = 1 if PDL else 0
    if PDL:
        k = split * SPLIT_BLOCKS * BLOCK_K + tl.arange(0, BLOCK_K)
        w = _gemv_weights(w_ptr, n, n_ok, k, K_DIM)
        w_up = _gemv_weights(w_ptr, n + N_OUT, n_ok, k, K_DIM) if GATED else w
        if not LATE_TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
        if LATE_TRIGGER:
            gdc_launch_dependents()
    sumsq = tl.zeros((BLOCK_M,), tl.float32)
    res = _gemv_residual(res_ptr, n, m, n_ok, m_ok, stride_res, RESIDUAL)
    if PDL:
        xt, sumsq = _gemv_inputs(x_ptr, g_ptr, k, m, m_ok, stride_x, sumsq, K_DIM, NORM, SPLITS)
        acc = _dot(w, xt, acc, DOT_F32, PRECISION)
        if GATED:
            acc_up = _dot(w_up, xt, acc_up, DOT_F32, PRECISION)
    for i in range(first, SPLIT_BLOCKS):
        k = (split * SPLIT_BLOCKS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        xt, sumsq = _gemv_inputs(x_ptr, g_ptr, k, m, m_ok, stride_x, sumsq, K_DIM, NORM, SPLITS)
        acc = _dot(_gemv_weights(w_ptr, n, n_ok, k, K_DIM), xt, acc, DOT_F32, PRECISION)
        if GATED:
            acc_up = _dot(_gemv_weights(w_ptr, n + N_OUT, n_ok, k, K_DIM), xt, acc_up, DOT_F32, PRECISION)
    if SPLITS == 1:
        _gemv_epilogue(
            acc, acc_up, sumsq, res, out_ptr, n, m, n_ok, m_ok, eps, stride_out, K_DIM, NORM, GATED, RESIDUAL, BIAS,
        )
    else:
        # partials [SPLITS, 1 + GATED, N_OUT, ROW_TILES * BLOCK_M] in fp32
        rows_pad: tl.constexpr = ROW_TILES * BLOCK_M
        part = part_ptr + n[:, None] * rows_pad + m[None, :]
        stride_split: tl.constexpr = (1 + GATED) * N_OUT * rows_pad
        tl.store(part + split * stride_split, acc, mask=n_ok[:, None])
        if GATED:
            tl.store(part + split * stride_split + N_OUT * rows_pad, acc_up, mask=n_ok[:, None])
        if _arrived_last(count_ptr + tile, SPLITS):
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(part + s * stride_split, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(
                        part + s * stride_split + N_OUT * rows_pad, mask=n_ok[:, None], other=0.0, cache_modifier=".cg"
                    )
            if NORM:
                for k0 in range(0, K_DIM, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    xs = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & (k < K_DIM)[None, :], other=0.0)
                    xs = xs.to(tl.float32)
                    sumsq += tl.sum(xs * xs, axis=1)
            _gemv_epilogue(
                acc, acc_up, sumsq, res, out_ptr, n, m, n_ok, m_ok, eps, stride_out, K_DIM, NORM, GATED, RESIDUAL, BIAS,
            )
            tl.store(count_ptr + tile, 0)  # ready for the next launch


@_jit
def _norm_rope(head_ptrs, mask, d, d_rot, w_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr):
    """Per-head RMSNorm then x*cos + roll(x, d/2)*sin for heads [R, 1] -> [R, HEAD_DIM], in fp32."""
    dt = head_ptrs.dtype.element_ty
    x = tl.load(head_ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(head_ptrs + d_rot[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    y = _round(x * rstd * tl.load(w_ptr + d).to(tl.float32)[None, :], dt)
    y_rot = _round(x_rot * rstd * tl.load(w_ptr + d_rot).to(tl.float32)[None, :], dt)
    return _round(_round(y * cos[None, :], dt) + _round(y_rot * sin[None, :], dt), dt)


@_jit
def _key_block(keys, values, j0, end, pos, stride_len, d, LIMIT_TO_POS: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    """Cached keys and values j0..j0+BLOCK_KEYS-1 ([BLOCK_KEYS, D] each) and which of them are attended: below
    `end`, not the column being written (its key is used from registers), and <= pos when LIMIT_TO_POS."""
    j = j0 + tl.arange(0, BLOCK_KEYS)
    ok = (j < end) & (j != pos)
    if LIMIT_TO_POS:
        ok = ok & (j <= pos)
    offs = j[:, None] * stride_len + d[None, :]
    return tl.load(keys + offs, mask=ok[:, None], other=0.0), tl.load(values + offs, mask=ok[:, None], other=0.0), ok


@_jit
def _attention_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_norm_ptr, k_norm_ptr, cache_k_ptr, cache_v_ptr, out_ptr,
    part_ptr, stat_ptr, count_ptr, read_len, keys_per_split, eps, scale,
    stride_qkv, stride_cos, stride_sin, stride_pos, stride_slot, stride_head, stride_len, stride_out,
    Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KEYS: tl.constexpr, SPLITS: tl.constexpr,
    LIMIT_TO_POS: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    EARLY_KEYS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One (row, kv head, key split): q/k norm + RoPE, K/V cache write, GQA attention of the head's GROUP queries.

    Key j is attended iff j < read_len (and j <= write_pos when LIMIT_TO_POS). The new key/value are used
    from registers rather than re-read from the cache, so no program reads a column another one writes. The
    GROUP queries are padded to Q_ROWS >= 16 rows so that both products run as tl.dot. EARLY_KEYS loads the
    first cache block before q and k are ready: shorter for a few rows, but those registers held across the
    norms cost occupancy when thousands of programs share the GPU. PREFETCH (with PDL) loads the position,
    its RoPE rows and that block before waiting for the QKV product; the caller guarantees that the kernel
    before started this one only after its own wait, so everything older than the product is complete.
    """
    if PDL and not PREFETCH:  # started early: let the next kernel start too, then wait for this one's inputs
        gdc_launch_dependents()
        gdc_wait()
    dt = cache_k_ptr.dtype.element_ty
    pid, split = tl.program_id(0), tl.program_id(1)
    row = pid // KV_HEADS
    head = pid % KV_HEADS
    d = tl.arange(0, HEAD_DIM)
    d_rot = (d + HEAD_DIM // 2) % HEAD_DIM
    g = tl.arange(0, Q_ROWS)
    g_ok = g < GROUP
    pos = tl.load(pos_ptr + row * stride_pos)
    slot = row.to(tl.int64) * stride_slot + head * stride_head
    keys, values = cache_k_ptr + slot, cache_v_ptr + slot
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, read_len)
    if EARLY_KEYS:
        # The first cache block goes out with the q/k/v loads: earlier steps wrote it, not the QKV product,
        # so the two latencies overlap instead of following each other.
        kb, vb, ok = _key_block(keys, values, start, end, pos, stride_len, d, LIMIT_TO_POS, BLOCK_KEYS)
    cos = tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32)  # the tables' rows are positions
    sin = tl.load(sin_ptr + pos * stride_sin + d).to(tl.float32)
    if PDL and PREFETCH:
        gdc_launch_dependents()
        gdc_wait()
    qkv = qkv_ptr + row * stride_qkv
    q_heads = qkv + (head * GROUP + g)[:, None] * HEAD_DIM
    q = _norm_rope(q_heads, g_ok[:, None], d, d_rot, q_norm_ptr, cos, sin, eps, HEAD_DIM)  # [Q_ROWS, D]
    k_head = qkv + Q_SIZE + head * HEAD_DIM + tl.zeros((1, 1), tl.int32)
    k = _norm_rope(k_head, tl.full((1, 1), True, tl.int1), d, d_rot, k_norm_ptr, cos, sin, eps, HEAD_DIM)  # [1, D]
    v = tl.load(qkv + Q_SIZE + KV_SIZE + head * HEAD_DIM + d).to(tl.float32)

    first = split == 0
    tl.store(keys + pos * stride_len + d[None, :], k.to(dt), mask=first & (d[None, :] < HEAD_DIM))
    tl.store(values + pos * stride_len + d, v.to(dt), mask=first & (d < HEAD_DIM))

    # split 0 starts its online softmax from the new key when that key is in range
    s_new = _round(_round(tl.sum(q * k, axis=1), dt) * scale, dt)
    new_ok = first & (pos < read_len)
    m_i = tl.where(new_ok, s_new, -1.0e30)  # finite, so that exp(m_old - m_new) never sees inf - inf
    l_i = tl.where(new_ok, 1.0, 0.0) + tl.zeros((Q_ROWS,), tl.float32)
    acc = tl.where(new_ok, v[None, :], 0.0) + tl.zeros((Q_ROWS, HEAD_DIM), tl.float32)
    q = q.to(dt)
    if not EARLY_KEYS:
        kb, vb, ok = _key_block(keys, values, start, end, pos, stride_len, d, LIMIT_TO_POS, BLOCK_KEYS)
    j0 = start
    while j0 < end:  # a while loop: the interpreter cannot range() over runtime bounds with numpy >= 2.4
        s = _dot(q, tl.trans(kb), tl.zeros((Q_ROWS, BLOCK_KEYS), tl.float32), DOT_F32, PRECISION)
        s = tl.where(ok[None, :], _round(_round(s, dt) * scale, dt), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(dt), vb, acc * alpha[:, None], DOT_F32, PRECISION)
        m_i = m_new
        j0 += BLOCK_KEYS
        # the next block (fully masked past the end: no traffic). Loading it before reducing this one would
        # hold two blocks in registers, which made a batch of 256's attention 8% slower on an H200.
        kb, vb, ok = _key_block(keys, values, j0, end, pos, stride_len, d, LIMIT_TO_POS, BLOCK_KEYS)

    out = out_ptr + row * stride_out + (head * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
    if SPLITS == 1:
        tl.store(out, (acc / l_i[:, None]).to(dt), mask=g_ok[:, None])
    else:
        # partials of the GROUP real rows: acc [pid, split, GROUP, D], (m, l) [pid, split, 2, GROUP]
        part = part_ptr + (pid * SPLITS * GROUP + g[:, None]) * HEAD_DIM + d[None, :]
        stat = stat_ptr + pid * SPLITS * 2 * GROUP + g
        tl.store(part + split * GROUP * HEAD_DIM, acc, mask=g_ok[:, None])
        tl.store(stat + split * 2 * GROUP, m_i, mask=g_ok)
        tl.store(stat + split * 2 * GROUP + GROUP, l_i, mask=g_ok)
        if _arrived_last(count_ptr + pid, SPLITS):
            m_all = tl.full((Q_ROWS,), -1.0e30, tl.float32)
            l_all = tl.zeros((Q_ROWS,), tl.float32)
            merged = tl.zeros((Q_ROWS, HEAD_DIM), tl.float32)
            for s in tl.static_range(SPLITS):  # merge the splits' softmaxes in a fixed order
                m_s = tl.load(stat + s * 2 * GROUP, mask=g_ok, other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(stat + s * 2 * GROUP + GROUP, mask=g_ok, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(part + s * GROUP * HEAD_DIM, mask=g_ok[:, None], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_all, m_s)
                alpha, beta = tl.exp(m_all - m_new), tl.exp(m_s - m_new)
                l_all = l_all * alpha + l_s * beta
                merged = merged * alpha[:, None] + acc_s * beta[:, None]
                m_all = m_new
            tl.store(out, (merged / l_all[:, None]).to(dt), mask=g_ok[:, None])
            tl.store(count_ptr + pid, 0)  # ready for the next launch


# ----------------------------------------------------------------------------------------------- launchers


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters (zeroed once; every launch leaves them zeroed)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("call decode_layer once outside CUDA-graph capture: it allocates its counters then")
        counters = _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return counters


def programmatic_launch(device: torch.device) -> bool:
    """Whether the kernels launch on `device` with programmatic dependent launch (see PROGRAMMATIC_LAUNCH)."""
    if device.type != "cuda" or _interpreting() or PROGRAMMATIC_LAUNCH is False:
        return False
    return PROGRAMMATIC_LAUNCH or _capability(device) >= (9, 0)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _pdl(device: torch.device) -> dict[str, bool]:
    """Launch options for programmatic dependent launch: the PDL constexpr, and the launch flag when on."""
    return {"PDL": True, "launch_pdl": True} if programmatic_launch(device) else {"PDL": False}


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 models (no TF32); ignored for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class GemvTiles:
    """How one GEMV is cut: outputs and K per program, and how far K is split to fill the GPU."""

    block_n: int = 32
    block_k: int = 256  # 16-bit elements; fp32 tiles are capped at FP32_BLOCK_K
    programs_per_sm: int = 8  # K is split until the grid has about this many programs per SM
    num_warps: int = 4
    num_stages: int = 3


FP32_BLOCK_K = 64  # exact fp32 FMA products (no tensor cores) spill registers beyond this
MAX_BLOCK_M = 64  # rows per program; larger batches take several row tiles
DEFAULT_TILES = GemvTiles()


# Tiles per (flavour, n_out, k_dim, rows bucket) for the products of Qwen3-TTS frames, the fastest found by
# `benchmarks/sweep_gemv.py` on an H200 (see benchmarks/results/); other shapes use DEFAULT_TILES. The
# 1-row bucket was swept again with programmatic dependent launch on (benchmarks/results/2026-11-30-h200-b/):
# a kernel that leaves room on the SMs lets the next one start loading sooner, and the 0.6B layer's four
# products went from 22.2 to 17.0 µs back to back.
GEMV_TILES: dict[tuple[str, int, int, int], GemvTiles] = {
    # 0.6B talker and the code predictor (hidden 1024, FFN 3072); the predictor's heads
    ("norm", 4096, 1024, 1): GemvTiles(64, 512, 16, num_stages=4),
    ("norm", 4096, 1024, 16): GemvTiles(64, 256, 16, num_warps=8),
    ("norm", 4096, 1024, 64): GemvTiles(64, 256, 1),
    ("gated", 3072, 1024, 1): GemvTiles(64, 256, 8, num_stages=4),
    ("gated", 3072, 1024, 16): GemvTiles(64, 256, 4, num_warps=8),
    ("gated", 3072, 1024, 64): GemvTiles(32, 128, 1),
    ("residual", 1024, 2048, 1): GemvTiles(64, 512, 1, num_warps=8, num_stages=4),
    ("residual", 1024, 2048, 16): GemvTiles(32, 512, 8),
    ("residual", 1024, 2048, 64): GemvTiles(32, 256, 1),
    ("residual", 1024, 3072, 1): GemvTiles(32, 512, 8),
    ("residual", 1024, 3072, 16): GemvTiles(32, 256, 4),
    ("residual", 1024, 3072, 64): GemvTiles(32, 256, 1),
    ("norm", 2048, 1024, 1): GemvTiles(32, 1024, 16),
    ("norm", 2048, 1024, 16): GemvTiles(64, 256, 2, num_warps=8),
    ("norm", 2048, 1024, 64): GemvTiles(64, 256, 8, num_warps=8),
    # 1.7B talker (hidden 2048, FFN 6144)
    ("norm", 4096, 2048, 1): GemvTiles(64, 512, 4),
    ("norm", 4096, 2048, 16): GemvTiles(64, 512, 4, num_warps=8),
    ("norm", 4096, 2048, 64): GemvTiles(32, 256, 1),
    ("gated", 6144, 2048, 1): GemvTiles(64, 256, 4, num_stages=4),
    ("gated", 6144, 2048, 16): GemvTiles(32, 128, 2),
    ("gated", 6144, 2048, 64): GemvTiles(32, 64, 2),
    ("residual", 2048, 2048, 1): GemvTiles(64, 512, 1, num_warps=8),
    ("residual", 2048, 2048, 16): GemvTiles(32, 256, 2),
    ("residual", 2048, 2048, 64): GemvTiles(64, 256, 1),
    ("residual", 2048, 6144, 1): GemvTiles(64, 128, 2),
    ("residual", 2048, 6144, 16): GemvTiles(64, 128, 2),
    ("residual", 2048, 6144, 64): GemvTiles(64, 128, 2),
}


def gemv_tiles(flavour: str, n_out: int, k_dim: int, rows: int) -> GemvTiles:
    """The tiles for one product; flavour is "norm", "gated", "residual" or "plain"."""
    bucket = 1 if rows <= 4 else 16 if rows <= 16 else 64
    return GEMV_TILES.get((flavour, n_out, k_dim, bucket), DEFAULT_TILES)


def _gemv_grid(n_out: int, k_dim: int, rows: int, dtype: torch.dtype, tiles: GemvTiles, device: torch.device) -> dict[str, int]:
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    block_k = tiles.block_k if dtype != torch.float32 else min(tiles.block_k, FP32_BLOCK_K)
    block_k = max(16, min(block_k, triton.next_power_of_2(k_dim)))
    programs = _cdiv(n_out, tiles.block_n) * _cdiv(rows, block_m)
    k_blocks = _cdiv(k_dim, block_k)
    want = min(max(1, _cdiv(tiles.programs_per_sm * _sm_count(device), programs)), k_blocks)
    per_split = _cdiv(k_blocks, want)
    return {
        "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": block_k, "ROW_TILES": _cdiv(rows, block_m),
        "SPLITS": _cdiv(k_blocks, per_split), "SPLIT_BLOCKS": per_split,
    }


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
    late_trigger: bool = False,
) -> None:
    """out = x · wᵀ for a few rows x [rows, K] (row stride free), with optional fusions:

    `norm` (gains [K]): RMSNorm(x) first; `gated`: w holds [gate; up] and out = SiLU(gate)·up (needs `norm`);
    `residual` [rows, N]: out = residual + product; `bias` [N]: out = product + bias, as `F.linear` rounds it.
    out [rows, N] must be a distinct buffer. `late_trigger`: under PDL the next kernel starts only once this
    one's inputs are complete (see `_gemv_kernel`).
    """
    rows, k_dim = x.shape
    n_out = out.shape[1]
    if gated and norm is None:
        raise ValueError("the gated product is only fused behind a norm")
    if bias is not None:
        if norm is not None or residual is not None or bias.shape != (n_out,) or bias.stride(0) != 1:
            raise ValueError("a bias [N] (contiguous) goes on a plain product only")
        residual = bias.expand(rows, n_out)  # row stride 0
    if w.shape != ((2 if gated else 1) * n_out, k_dim) or not w.is_contiguous() or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"bad shapes or layouts: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    # a bias costs what a residual does: same tiles
    flavour = "gated" if gated else "norm" if norm is not None else "residual" if residual is not None else "plain"
    tiles = tiles or gemv_tiles(flavour, n_out, k_dim, rows)
    grid = _gemv_grid(n_out, k_dim, rows, x.dtype, tiles, x.device)
    programs = _cdiv(n_out, grid["BLOCK_N"]) * grid["ROW_TILES"]
    splits = grid["SPLITS"]
    partials = None
    if splits > 1:
        rows_pad = grid["ROW_TILES"] * grid["BLOCK_M"]
        partials = torch.empty(splits, 2 if gated else 1, n_out, rows_pad, device=x.device, dtype=torch.float32)
    _gemv_kernel[(programs, splits)](
        x, norm if norm is not None else x, w, residual if residual is not None else out, out, partials if partials is not None else out,
        _counters(x.device), rows, eps, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        N_OUT=n_out, K_DIM=k_dim, NORM=norm is not None, GATED=gated, RESIDUAL=residual is not None, BIAS=bias is not None,
        DOT_F32=_interpreting(), PRECISION=_precision(x.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        LATE_TRIGGER=late_trigger, **grid, **_pdl(x.device),
    )


def _kv_splits(programs: int, read_len: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) for attention: about two programs per SM and short loops, whole key blocks."""
    want = max(_cdiv(2 * _sm_count(device), programs), _cdiv(read_len, KEYS_PER_PROGRAM))
    want = min(want, MAX_KV_SPLITS, _cdiv(read_len, BLOCK_KEYS))
    per_split = _cdiv(_cdiv(read_len, want), BLOCK_KEYS) * BLOCK_KEYS
    return _cdiv(read_len, per_split), per_split


def _token(t: torch.Tensor, i: int) -> torch.Tensor:
    """[b, t, n] -> the [b, n] view of token i; kernels take the row stride (0 for expanded tensors)."""
    rows = t[:, i]
    if rows.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    return rows


def _attention(
    layer: FusedDecoderLayer,
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
) -> None:
    """One `_attention_kernel` launch for one token of each of b rows: qkv, out [b, n], pos [b]; cos and sin are
    the RoPE tables [positions, head_dim]."""
    b, d = qkv.shape[0], layer.head_dim
    kv_heads, group = layer.kv_size // d, layer.q_size // layer.kv_size
    splits, per_split = _kv_splits(b * kv_heads, read_len, qkv.device)
    partials = torch.empty(b * kv_heads, splits, group, d, device=qkv.device, dtype=torch.float32)
    stats = torch.empty(b * kv_heads, splits, 2, group, device=qkv.device, dtype=torch.float32)
    _attention_kernel[(b * kv_heads, splits)](
        qkv, cos, sin, pos, layer.q_norm, layer.k_norm, cache_k, cache_v, out,
        partials, stats, _counters(qkv.device), read_len, per_split, layer.eps, layer.scaling,
        qkv.stride(0), cos.stride(0), sin.stride(0), pos.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), out.stride(0),
        Q_SIZE=layer.q_size, KV_SIZE=layer.kv_size, KV_HEADS=kv_heads, GROUP=group,
        Q_ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_KEYS=BLOCK_KEYS, SPLITS=splits,
        LIMIT_TO_POS=masked, DOT_F32=_interpreting(), PRECISION=_precision(qkv.dtype), EARLY_KEYS=b <= EARLY_KEYS_MAX_ROWS,
        PREFETCH=prefetch,
        num_warps=8 if qkv.dtype == torch.float32 else 4,  # fp32 FMA dots need the registers of 8 warps
        **_pdl(qkv.device),
    )


def late_qkv_trigger(batch: int, tokens: int = 1) -> bool:
    """Whether `decode_layer`'s QKV product (under PDL) lets the next kernel start only after its own wait, so
    that the kernels after it may load, before their own wait, whatever was written before that product."""
    return batch <= PREFETCH_MAX_ROWS and batch * tokens <= GEMV_MAX_ROWS


def decode_layer(
    layer: FusedDecoderLayer,
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
    """`layer(x, cos[write_pos], sin[write_pos], cache_k, cache_v, arange(b)[:, None], write_pos, slice(0, b),
    read_len, mask)`.

    x [b, t, hidden], cos/sin the RoPE tables [positions, head_dim] (row p for position p), write_pos [b, t]
    int64 on the device: row r uses cache slot r and writes token i's key at write_pos[r, i]. Token i attends
    the keys below read_len - (t - 1 - i), i.e. not those of the tokens after it, and with `masked=True` only keys <= write_pos[r, i] (mask =
    arange(read_len) <= write_pos: the talker step). `masked=False` stands for mask=None; for t > 1 the layer
    then aligns its causal mask top-left (SDPA is_causal), which agrees only when read_len == t (the
    predictor's first step: positions 0 and 1). A row's positions must increase along t and stay below the
    cache length (unchecked: that would sync with the host). Returns a new [b, t, hidden] tensor and writes
    the caches in place.

    The four products take all b·t token rows at once, as `gemv` up to GEMV_MAX_ROWS rows and as cuBLAS GEMMs
    (with PyTorch's norms and SwiGLU) above. Attention is one launch per token index over strided views;
    token i reads the keys that the launches of tokens < i wrote, which stream order makes visible.
    """
    b, t, hidden = x.shape
    d = layer.head_dim
    kv_heads, n_q = layer.kv_size // d, layer.q_size // d
    if d & (d - 1) or n_q % kv_heads or cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        raise ValueError("needs a power-of-two head_dim, whole GQA groups and K/V caches of one contiguous layout")
    weights = (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)
    if any(w.dtype != x.dtype or not w.is_contiguous() for w in weights) or cache_k.dtype != x.dtype:
        raise ValueError("x, the (contiguous) weights and the caches must share one dtype")
    if write_pos.dtype != torch.int64 or write_pos.shape != (b, t) or not t <= read_len <= cache_k.shape[2]:
        raise ValueError("write_pos must be int64 [b, t] and read_len within the cache, at least t")
    dev, dt = x.device, x.dtype
    rows = b * t
    x2 = x.reshape(rows, hidden)

    gemv_rows = rows <= GEMV_MAX_ROWS
    # a few rows' first attention launch loads its cache block and RoPE rows while the QKV product runs
    prefetch = late_qkv_trigger(b, t)
    if gemv_rows:
        qkv = torch.empty(rows, layer.w_qkv.shape[0], device=dev, dtype=dt)
        gemv(x2, layer.w_qkv, qkv, norm=layer.in_norm, eps=layer.eps, late_trigger=prefetch)
    else:
        qkv = F.linear(F.rms_norm(x2, (hidden,), layer.in_norm, layer.eps), layer.w_qkv)

    attn = torch.empty(b, t, layer.q_size, device=dev, dtype=dt)
    qkv3 = qkv.view(b, t, -1)
    for i in range(t):
        _attention(
            layer, _token(qkv3, i), cos, sin, write_pos[:, i], cache_k, cache_v,
            _token(attn, i), read_len - (t - 1 - i), masked, prefetch and i == 0,  # token i > 0 reads token i - 1's key
        )
    attn = attn.view(rows, layer.q_size)

    if not gemv_rows:
        x1 = x2 + F.linear(attn, layer.w_o)
        gate, up = F.linear(F.rms_norm(x1, (hidden,), layer.post_norm, layer.eps), layer.w_gate_up).chunk(2, dim=-1)
        return (x1 + F.linear(F.silu(gate) * up, layer.w_down)).view(b, t, hidden)
    x1 = torch.empty(rows, hidden, device=dev, dtype=dt)
    gemv(attn, layer.w_o, x1, residual=x2)
    act = torch.empty(rows, layer.ffn, device=dev, dtype=dt)
    gemv(x1, layer.w_gate_up, act, norm=layer.post_norm, eps=layer.eps, gated=True)
    out = torch.empty(b, t, hidden, device=dev, dtype=dt)
    gemv(act, layer.w_down, out.view(rows, hidden), residual=x1)
    return out
