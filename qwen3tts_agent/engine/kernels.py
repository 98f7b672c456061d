"""Triton kernels for the single-token decode step of a `FusedDecoderLayer`: five launches per layer.

A decode frame runs 28 talker layers and 75 predictor layer calls at batch 1..16 inside one CUDA graph, and
the PyTorch path spends about 22 small kernels per layer, so the frame is bound by kernel count rather than
by bytes. Here one layer is five kernels:

1. `_norm_linear_kernel`: RMSNorm(x) · W_qkvᵀ. The norm is folded into the GEMV: the K loop feeds x∘g to the
   product and accumulates Σx² alongside, and the per-row 1/rms scales the result at the end.
2. `_attention_kernel`: per (row, kv head, key split): q_norm/k_norm, RoPE, the K/V cache write at
   `write_pos`, and single-query GQA attention with an online softmax in fp32: the query heads of one kv
   head, padded to 16 rows, meet each block of its keys and values in one `tl.dot`. Caches are split over
   keys (flash decoding) so that small batches still fill the GPU and each program's loop stays short; the
   last split to finish merges the partial softmaxes, so the merge costs no extra launch.
3. `_linear_residual_kernel`: attn · W_oᵀ + x, split over K when there are too few output tiles to fill the
   GPU; again the last split to arrive reduces the partial sums in a fixed order (deterministic, no atomics
   on data).
4. `_norm_linear_kernel` (gated): RMSNorm(x) · W_gate_upᵀ with matching gate and up rows in one program and
   the SiLU(gate)·up epilogue.
5. `_linear_residual_kernel`: act · W_downᵀ + x.

The GEMVs stream row-major weights [N, K] in [16, BLOCK_K] tiles (K contiguous, so loads vectorise) through
`tl.dot` against the rows padded to 16, accumulating in fp32. Grids and block sizes depend only on Python
ints (batch, widths, read_len), nothing is autotuned, and nothing synchronises with the host, so the path is
CUDA-graph capturable. Intermediate roundings to the model dtype follow the PyTorch path where that is cheap,
so bf16 results stay close to it and fp32 results match it to ~1e-6.

"Last to arrive" uses one arrival counter per output tile in a per-device int32 buffer that every launch
leaves zeroed; it is allocated by the first (eager) call, so call `decode_layer` once before capturing a
graph, and do not run two decode steps concurrently on different streams of one device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # keeps the module importable on installs without triton; available() reports False
    triton = None

from .layers import FusedDecoderLayer

MAX_ROWS = 16  # the GEMVs pad the batch to one 16-row tile; larger batches keep the cuBLAS path
BLOCK_N = 16  # output rows per GEMV program: small tiles, many programs (N = 1024 also splits over K)
# K extent of a GEMV tile by element size: 16-bit tiles are 16 rows x 512 B = 8 KB per pipeline stage;
# fp32 (exact FMA products, no tensor cores) spills registers beyond 64
BLOCK_K_ELEMS = {2: 256, 4: 64}
BLOCK_KEYS = 32  # keys per attention step
KEYS_PER_PROGRAM = 128  # the attention loop is not software-pipelined: keep it short by splitting over keys
MAX_KV_SPLITS = 16
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
def _norm_linear_kernel(
    x_ptr, g_ptr, w_ptr, out_ptr, rows, eps, stride_x, stride_out,
    N_OUT: tl.constexpr, K_DIM: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    """out = RMSNorm(x; g) · w[:N_OUT]ᵀ, or SiLU(that) * (RMSNorm(x; g) · w[N_OUT:]ᵀ) when GATED."""
    dt = x_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N_OUT, m < rows
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    sumsq = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K_DIM
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        xt = tl.trans((x * g[None, :]).to(dt))
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + n[:, None] * K_DIM + k[None, :], mask=w_ok, other=0.0)
        acc = _dot(w, xt, acc, DOT_F32, PRECISION)
        if GATED:
            w_up = tl.load(w_ptr + (n + N_OUT)[:, None] * K_DIM + k[None, :], mask=w_ok, other=0.0)
            acc_up = _dot(w_up, xt, acc_up, DOT_F32, PRECISION)
    rstd = tl.math.rsqrt(sumsq / K_DIM + eps)[None, :]
    y = _round(acc * rstd, dt)
    if GATED:
        up = _round(acc_up * rstd, dt)
        y = _round(_round(y / (1.0 + tl.exp(-y)), dt) * up, dt)
    tl.store(out_ptr + m[None, :] * stride_out + n[:, None], y.to(dt), mask=n_ok[:, None] & m_ok[None, :])


@_jit
def _store_residual(acc, res_ptr, out_ptr, n, m, n_ok, m_ok, stride_res, stride_out):
    """out[m, n] = round(acc[n, m]) + res[m, n], rounded: the PyTorch path's `x + linear(...)`."""
    dt = out_ptr.dtype.element_ty
    mask = n_ok[:, None] & m_ok[None, :]
    res = tl.load(res_ptr + m[None, :] * stride_res + n[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m[None, :] * stride_out + n[:, None], (_round(acc, dt) + res).to(dt), mask=mask)


@_jit
def _linear_residual_kernel(
    a_ptr, w_ptr, res_ptr, out_ptr, part_ptr, count_ptr, rows, stride_a, stride_res, stride_out,
    N_OUT: tl.constexpr, K_DIM: tl.constexpr, SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    """out = a · wᵀ + res, K split SPLITS ways (SPLIT_BLOCKS blocks each); a tile's last split sums them in order."""
    tile, split = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N_OUT, m < rows
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i in range(SPLIT_BLOCKS):
        k = (split * SPLIT_BLOCKS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < K_DIM
        w = tl.load(w_ptr + n[:, None] * K_DIM + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + m[:, None] * stride_a + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(w, tl.trans(a), acc, DOT_F32, PRECISION)
    if SPLITS == 1:
        _store_residual(acc, res_ptr, out_ptr, n, m, n_ok, m_ok, stride_res, stride_out)
    else:
        part = part_ptr + n[:, None] * BLOCK_M + m[None, :]  # partials [SPLITS, n_out, BLOCK_M] fp32
        tl.store(part + split * N_OUT * BLOCK_M, acc, mask=n_ok[:, None])
        if _arrived_last(count_ptr + tile, SPLITS):
            total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(part + s * N_OUT * BLOCK_M, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
            _store_residual(total, res_ptr, out_ptr, n, m, n_ok, m_ok, stride_res, stride_out)
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
def _attention_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_norm_ptr, k_norm_ptr, cache_k_ptr, cache_v_ptr, out_ptr,
    part_ptr, stat_ptr, count_ptr, read_len, keys_per_split, eps, scale,
    stride_qkv, stride_cos, stride_sin, stride_pos, stride_slot, stride_head, stride_len, stride_out,
    Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KEYS: tl.constexpr, SPLITS: tl.constexpr,
    LIMIT_TO_POS: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (row, kv head, key split): q/k norm + RoPE, K/V cache write, GQA attention of the head's GROUP queries.

    Key j is attended iff j < read_len (and j <= write_pos when LIMIT_TO_POS). The new key/value are used
    from registers rather than re-read from the cache, so no program reads a column another one writes. The
    GROUP queries are padded to Q_ROWS >= 16 rows so that both products run as tl.dot.
    """
    dt = cache_k_ptr.dtype.element_ty
    pid, split = tl.program_id(0), tl.program_id(1)
    row = pid // KV_HEADS
    head = pid % KV_HEADS
    d = tl.arange(0, HEAD_DIM)
    d_rot = (d + HEAD_DIM // 2) % HEAD_DIM
    g = tl.arange(0, Q_ROWS)
    g_ok = g < GROUP
    pos = tl.load(pos_ptr + row * stride_pos)
    cos = tl.load(cos_ptr + row * stride_cos + d).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sin + d).to(tl.float32)
    qkv = qkv_ptr + row * stride_qkv
    q_heads = qkv + (head * GROUP + g)[:, None] * HEAD_DIM
    q = _norm_rope(q_heads, g_ok[:, None], d, d_rot, q_norm_ptr, cos, sin, eps, HEAD_DIM)  # [Q_ROWS, D]
    k_head = qkv + Q_SIZE + head * HEAD_DIM + tl.zeros((1, 1), tl.int32)
    k = _norm_rope(k_head, tl.full((1, 1), True, tl.int1), d, d_rot, k_norm_ptr, cos, sin, eps, HEAD_DIM)  # [1, D]
    v = tl.load(qkv + Q_SIZE + KV_SIZE + head * HEAD_DIM + d).to(tl.float32)

    slot = row.to(tl.int64) * stride_slot + head * stride_head
    keys, values = cache_k_ptr + slot, cache_v_ptr + slot
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
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, read_len)
    j0 = start
    while j0 < end:  # a while loop: the interpreter cannot range() over runtime bounds with numpy >= 2.4
        j = j0 + tl.arange(0, BLOCK_KEYS)
        ok = (j < end) & (j != pos)
        if LIMIT_TO_POS:
            ok = ok & (j <= pos)
        offs = j[:, None] * stride_len + d[None, :]
        kb = tl.load(keys + offs, mask=ok[:, None], other=0.0)  # [BLOCK_KEYS, D]
        vb = tl.load(values + offs, mask=ok[:, None], other=0.0)  # issued with K: one latency per step
        s = _dot(q, tl.trans(kb), tl.zeros((Q_ROWS, BLOCK_KEYS), tl.float32), DOT_F32, PRECISION)
        s = tl.where(ok[None, :], _round(_round(s, dt) * scale, dt), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(dt), vb, acc * alpha[:, None], DOT_F32, PRECISION)
        m_i = m_new
        j0 += BLOCK_KEYS

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


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 models (no TF32); ignored for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _gemv_opts(x: torch.Tensor, k_dim: int) -> dict[str, object]:
    """Shared GEMV constexprs: K tiles of whole 16-byte vectors, exact fp32 products for fp32 models."""
    block_k = max(16, min(BLOCK_K_ELEMS[x.element_size()], triton.next_power_of_2(k_dim)))
    return {
        "BLOCK_M": MAX_ROWS, "BLOCK_N": BLOCK_N, "BLOCK_K": block_k, "DOT_F32": _interpreting(),
        "PRECISION": _precision(x.dtype), "num_warps": 4, "num_stages": 3,
    }


def _k_splits(n_out: int, k_dim: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(splits, K blocks per split): enough programs for about two per SM."""
    k_blocks = _cdiv(k_dim, block_k)
    per_split = _cdiv(k_blocks, min(_cdiv(2 * _sm_count(device), _cdiv(n_out, BLOCK_N)), k_blocks))
    return _cdiv(k_blocks, per_split), per_split


def _kv_splits(programs: int, read_len: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) for attention: about two programs per SM and short loops, whole key blocks."""
    want = max(_cdiv(2 * _sm_count(device), programs), _cdiv(read_len, KEYS_PER_PROGRAM))
    want = min(want, MAX_KV_SPLITS, _cdiv(read_len, BLOCK_KEYS))
    per_split = _cdiv(_cdiv(read_len, want), BLOCK_KEYS) * BLOCK_KEYS
    return _cdiv(read_len, per_split), per_split


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[b, 1, n] -> a [b, n] view; kernels take the row stride (which may be 0 for expanded tensors)."""
    rows = t[:, 0]
    if rows.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    return rows


def _norm_linear(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float, gated: bool) -> None:
    n_out, k_dim = out.shape[1], x.shape[1]
    _norm_linear_kernel[(_cdiv(n_out, BLOCK_N),)](
        x, g, w, out, x.shape[0], eps, x.stride(0), out.stride(0),
        N_OUT=n_out, K_DIM=k_dim, GATED=gated, **_gemv_opts(x, k_dim),
    )


def _linear_residual(a: torch.Tensor, w: torch.Tensor, res: torch.Tensor, out: torch.Tensor) -> None:
    n_out, k_dim = w.shape
    opts = _gemv_opts(a, k_dim)
    splits, split_blocks = _k_splits(n_out, k_dim, opts["BLOCK_K"], a.device)
    partials = torch.empty(splits, n_out, MAX_ROWS, device=a.device, dtype=torch.float32)
    _linear_residual_kernel[(_cdiv(n_out, BLOCK_N), splits)](
        a, w, res, out, partials, _counters(a.device), a.shape[0], a.stride(0), res.stride(0), out.stride(0),
        N_OUT=n_out, K_DIM=k_dim, SPLITS=splits, SPLIT_BLOCKS=split_blocks, **opts,
    )


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
    """`layer(x, cos, sin, cache_k, cache_v, arange(b)[:, None], write_pos, slice(0, b), read_len, mask)` for t == 1.

    Row r uses cache slot r. `masked=True` stands for mask = arange(read_len) <= write_pos (the talker step),
    `masked=False` for mask=None (every key below read_len). x [b, 1, hidden], cos/sin [b, 1, head_dim],
    write_pos [b, 1] int64 on the device, each below the cache length (unchecked: that would sync with the
    host); returns a new [b, 1, hidden] tensor and writes the caches in place.
    """
    b, t, hidden = x.shape
    if t != 1 or not 1 <= b <= MAX_ROWS:
        raise ValueError(f"decode_layer handles one token for 1..{MAX_ROWS} rows, got x of shape {tuple(x.shape)}")
    d = layer.head_dim
    kv_heads, n_q = layer.kv_size // d, layer.q_size // d
    if d & (d - 1) or n_q % kv_heads or cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        raise ValueError("needs a power-of-two head_dim, whole GQA groups and K/V caches of one contiguous layout")
    weights = (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)
    if any(w.dtype != x.dtype or not w.is_contiguous() for w in weights) or cache_k.dtype != x.dtype:
        raise ValueError("x, the (contiguous) weights and the caches must share one dtype")
    if write_pos.dtype != torch.int64 or not 1 <= read_len <= cache_k.shape[2]:
        raise ValueError("write_pos must be int64 and read_len within the cache")
    dev, dt = x.device, x.dtype
    x2 = _rows(x)
    counters = _counters(dev)

    qkv = torch.empty(b, layer.w_qkv.shape[0], device=dev, dtype=dt)
    _norm_linear(x2, layer.in_norm, layer.w_qkv, qkv, layer.eps, gated=False)

    group = n_q // kv_heads
    splits, per_split = _kv_splits(b * kv_heads, read_len, dev)
    attn = torch.empty(b, layer.q_size, device=dev, dtype=dt)
    partials = torch.empty(b * kv_heads, splits, group, d, device=dev, dtype=torch.float32)
    stats = torch.empty(b * kv_heads, splits, 2, group, device=dev, dtype=torch.float32)
    cos2, sin2, pos = _rows(cos), _rows(sin), write_pos[:, 0]
    _attention_kernel[(b * kv_heads, splits)](
        qkv, cos2, sin2, pos, layer.q_norm, layer.k_norm, cache_k, cache_v, attn,
        partials, stats, counters, read_len, per_split, layer.eps, layer.scaling,
        qkv.stride(0), cos2.stride(0), sin2.stride(0), pos.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), attn.stride(0),
        Q_SIZE=layer.q_size, KV_SIZE=layer.kv_size, KV_HEADS=kv_heads, GROUP=group,
        Q_ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_KEYS=BLOCK_KEYS, SPLITS=splits,
        LIMIT_TO_POS=masked, DOT_F32=_interpreting(), PRECISION=_precision(dt),
        num_warps=8 if dt == torch.float32 else 4,  # fp32 FMA dots need the registers of 8 warps
    )

    x1 = torch.empty(b, hidden, device=dev, dtype=dt)
    _linear_residual(attn, layer.w_o, x2, x1)
    act = torch.empty(b, layer.ffn, device=dev, dtype=dt)
    _norm_linear(x1, layer.post_norm, layer.w_gate_up, act, layer.eps, gated=True)
    out = torch.empty(b, 1, hidden, device=dev, dtype=dt)
    _linear_residual(act, layer.w_down, x1, out[:, 0])
    return out
