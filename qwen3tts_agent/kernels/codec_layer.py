"""The codec transformer's small per-layer ops as one launch each: `rms_norm`, `rope_window`, `silu_mul`; and
`add_rms_norm`, which with `rms_norm` and `silu_mul` also serves the talker's and predictor's decoder layers
between their cuBLAS products above GEMV_MAX_ROWS rows (`decode_layer.decode_layer`).

A streaming codec chunk is one to a few frames per stream, so the codec's 8-layer sliding-window transformer
(`engine/audio/codec_transformer.py`) is bound by kernel launches, not by bytes or arithmetic: on the PyTorch
layers a layer is about 60 small kernels (each RMSNorm six, RoPE five for q and five for k, the key/value
history's index_select + cat + index_copy for keys and for values, ...) in a graph of ~770 launches. These
three kernels replace those elementwise chains; the products stay cuBLAS GEMMs and attention stays SDPA.

- `rms_norm`: the official `Qwen3TTSTokenizerV2DecoderRMSNorm` (the talker's `Qwen3TTSRMSNorm` computes the
  same), one program per row; `add_rms_norm`: the same of a sum, which it also returns (the residual stream).
- `rope_window`: per (batch row, head): RoPE of the new queries and keys from the fused q/k/v projection,
  and each key/value head's window [slot's history, new rows], whose newest rows then replace the history
  in place (the slot's state, as `engine.audio.codec.SlotHistory` keeps it).
- `silu_mul`: SiLU(gate) · up of the fused gate/up projection.

Each intermediate is rounded to the model dtype where PyTorch's kernels store it, fp32 products are not
contracted into FMAs (`enable_fp_fusion=False`), and exp, division and rsqrt are the accurate ones PyTorch's
CUDA kernels use (libdevice expf, IEEE division, rsqrtf), so RoPE and SiLU·up equal the eager ops on a GPU.
RMSNorm differs only in the order of its sum of squares (a tree here, PyTorch's reduction kernel its own),
i.e. by at most about an ulp of the 1/rms factor. None of the kernels needs arrival counters or PDL.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..models.compat import OfficialModule
from . import common
from .common import expf, jit, round_to, rsqrtf

try:
    import triton
    import triton.language as tl
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

MAX_HEAD_DIM = 256
MAX_NORM_WIDTH = 16384  # one program holds a whole row
BLOCK_ROWS = 32  # history rows a `rope_window` program copies per step
MAX_BLOCK_FRAMES = 16  # new frames a `rope_window` program rotates per step
SILU_BLOCK = 1024


def supports(head_dim: int, width: int, dtype: torch.dtype) -> common.Support:
    """Whether the kernels take a codec transformer: even head_dim up to MAX_HEAD_DIM, hidden width up to
    MAX_NORM_WIDTH, fp32 or bf16."""
    if head_dim % 2 or not 0 < head_dim <= MAX_HEAD_DIM:
        return common.unsupported(f"head_dim {head_dim} not even or above {MAX_HEAD_DIM}")
    if not 0 < width <= MAX_NORM_WIDTH:
        return common.unsupported(f"hidden width {width} above {MAX_NORM_WIDTH}")
    return common.dtype_support(dtype)


_SILU_TYPES = ("SiLU", "SiLUActivation")  # torch's module, and transformers' ACT2FN["silu"]


def supports_transformer(transformer: OfficialModule) -> common.Support:
    """Whether the engine's `FusedCodecTransformer` (engine/audio/codec_transformer.py) takes an official
    `Qwen3TTSTokenizerV2DecoderTransformerModel`: identity q/k norms, no attention or MLP biases, a SiLU MLP,
    RMSNorms and LayerScales of the hidden width, and shapes the kernels take. It says nothing about the
    device (`kernels.common.available`). Here rather than beside that module so that the runner's choice of
    kernel paths (`engine/runner/kernel_paths.py`) makes the same check without importing the codec."""
    layers = list(transformer.layers)
    if not layers:
        return common.unsupported("no transformer layers")
    width = transformer.norm.weight.shape[0]
    attn = layers[0].self_attn
    head_dim = attn.head_dim
    heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
            return common.unsupported("q/k norms are not identities")
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(p.bias is not None for p in projections):
            return common.unsupported("attention or MLP projections with bias")
        if type(mlp.act_fn).__name__ not in _SILU_TYPES:
            return common.unsupported(f"MLP activation {type(mlp.act_fn).__name__} is not SiLU")
        if (attn.head_dim != head_dim or attn.q_proj.out_features != heads * head_dim
                or attn.k_proj.out_features != kv_heads * head_dim or attn.v_proj.out_features != kv_heads * head_dim
                or heads % kv_heads or attn.num_key_value_groups != heads // kv_heads):
            return common.unsupported("attention shapes differ between layers or heads")
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        scales = (layer.self_attn_layer_scale.scale, layer.mlp_layer_scale.scale)
        if any(not _is_rms_norm(n, width) for n in norms) or any(s.shape != (width,) for s in scales):
            return common.unsupported("norms or layer scales of an unexpected kind or width")
    if not _is_rms_norm(transformer.norm, width):
        return common.unsupported("final norm of an unexpected kind")
    return supports(head_dim, width, transformer.norm.weight.dtype)


def _is_rms_norm(module: nn.Module, width: int) -> bool:
    """The official decoder RMSNorm (matched by class name: the class lives in qwen_tts) of `width`."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor)
            and weight.shape == (width,) and isinstance(getattr(module, "variance_epsilon", None), float))


# ------------------------------------------------------------------------------------------------ RMSNorm


@jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, width, stride_x, stride_r, width_f, inv_width, eps,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, MEAN_BY_RECIPROCAL: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """One row: x · rsqrt(mean(x²) + eps) in fp32, rounded to the dtype, times the weight, rounded again. With
    RESIDUAL, x is first the sum of two rows rounded to the dtype (as PyTorch's add stores it), kept at `sum_ptr`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    if RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        xf = round_to(xf + r, dt)
        tl.store(sum_ptr + row * width + cols, xf.to(dt), mask=ok)
    total = tl.sum(xf * xf, axis=0)
    # PyTorch's mean: CUDA multiplies the sum by the fp32 reciprocal of the count, the CPU divides by it
    variance = total * inv_width if MEAN_BY_RECIPROCAL else tl.math.div_rn(total, width_f)
    normed = round_to(xf * rsqrtf(variance + eps, LIBDEVICE), dt)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (w * normed).to(dt), mask=ok)


@functools.cache
def _fp32_reciprocal(n: int) -> float:
    """1/n rounded to fp32, the factor PyTorch's CUDA mean multiplies the sum by."""
    return float(torch.tensor(1.0 / n, dtype=torch.float32))


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    width = x.shape[-1]
    if weight.shape != (width,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x, width)
    r2 = x2 if residual is None else _rows(residual, width)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    total = out if residual is None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
    block = common.next_power_of_2(width)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, total, out, width, x2.stride(0), r2.stride(0), float(width), _fp32_reciprocal(width), eps,
        BLOCK=block, RESIDUAL=residual is not None, MEAN_BY_RECIPROCAL=x.device.type == "cuda",
        LIBDEVICE=not common.interpreting(), num_warps=4 if block <= 2048 else 8, enable_fp_fusion=False,
    )
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The official decoder RMSNorm of x [..., width] (last dim contiguous) with `weight` [width] of x's dtype."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, `rms_norm` of that sum) in one launch: a decoder layer's residual stream and the input of
    its next product, which PyTorch makes in two kernels (the add, then the norm reading the sum back)."""
    return _norm(x, residual, weight, eps)


# ----------------------------------------------------------------------------------- RoPE and the window


@jit
def _rope_rows(
    row_ptr, cos_ptr, sin_ptr, t, stride_t, stride_cos_t, stride_sin_t, frames, d,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    """Rows t [BT] of one head (row_ptr: its first lane at frame 0) rotated as x·cos + rotate_half(x)·sin,
    each product and the sum rounded to the dtype like the eager ops; [BT, HEAD_DIM_P] in fp32, mask."""
    half: tl.constexpr = HEAD_DIM // 2
    lanes = d < HEAD_DIM
    mask = (t < frames)[:, None] & lanes[None, :]
    first = d < half
    d_rot = tl.where(first, d + half, d - half)
    x = tl.load(row_ptr + t[:, None] * stride_t + d[None, :], mask=mask, other=0.0)
    dt = x.dtype
    x_rot = tl.load(row_ptr + t[:, None] * stride_t + d_rot[None, :], mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.where(first[None, :], -x_rot, x_rot)
    cos = tl.load(cos_ptr + t[:, None] * stride_cos_t + d[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t[:, None] * stride_sin_t + d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = round_to(round_to(x.to(tl.float32) * cos, dt) + round_to(x_rot * sin, dt), dt)
    return out, mask


@jit
def _copy_rows(
    k_src, v_src, stride_src, k_dst, v_dst, stride_dst, rows, d, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """k_dst[r] = k_src[r] and v_dst[r] = v_src[r] for r < rows, HEAD_DIM lanes a row."""
    r0 = 0
    while r0 < rows:  # not `for ... in range(runtime bound)`: the interpreter cannot index with a runtime scalar
        r = r0 + tl.arange(0, BLOCK_ROWS)
        mask = (r < rows)[:, None] & (d < HEAD_DIM)[None, :]
        src = r[:, None] * stride_src + d[None, :]
        dst = r[:, None] * stride_dst + d[None, :]
        keys = tl.load(k_src + src, mask=mask, other=0.0)
        values = tl.load(v_src + src, mask=mask, other=0.0)
        tl.store(k_dst + dst, keys, mask=mask)
        tl.store(v_dst + dst, values, mask=mask)
        r0 += BLOCK_ROWS


@jit
def _rope_window_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slots_ptr, k_hist_ptr, v_hist_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    frames, history, stride_qkv_b, stride_qkv_t, stride_cos_b, stride_cos_t, stride_sin_b, stride_sin_t,
    stride_hist_slot, stride_hist_head, stride_hist_row,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """Program (b, h): query head h < HEADS, else key/value head h - HEADS with its slot's window.

    A key/value program first writes its whole window [history, new rows] to the outputs, then (after a
    barrier, so that all its threads' stores are visible) copies the window's newest `history` rows from its
    own output back into the slot's history: no program reads what another one writes.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM_P)
    qkv_row = qkv_ptr + b * stride_qkv_b
    cos_row = cos_ptr + b * stride_cos_b
    sin_row = sin_ptr + b * stride_sin_b
    if h < HEADS:
        q_out = q_out_ptr + (b * HEADS + h) * frames * HEAD_DIM
        t0 = 0
        while t0 < frames:
            t = t0 + tl.arange(0, BLOCK_T)
            q, mask = _rope_rows(
                qkv_row + h * HEAD_DIM, cos_row, sin_row, t, stride_qkv_t, stride_cos_t, stride_sin_t, frames,
                d, HEAD_DIM, HEAD_DIM_P,
            )
            tl.store(q_out + t[:, None] * HEAD_DIM + d[None, :], q.to(q_out_ptr.dtype.element_ty), mask=mask)
            t0 += BLOCK_T
    else:
        kv = h - HEADS
        slot = tl.load(slots_ptr + b).to(tl.int64)
        length = history + frames
        k_hist = k_hist_ptr + slot * stride_hist_slot + kv * stride_hist_head
        v_hist = v_hist_ptr + slot * stride_hist_slot + kv * stride_hist_head
        k_out = k_out_ptr + (b * KV_HEADS + kv) * length * HEAD_DIM
        v_out = v_out_ptr + (b * KV_HEADS + kv) * length * HEAD_DIM
        _copy_rows(k_hist, v_hist, stride_hist_row, k_out, v_out, HEAD_DIM, history, d, HEAD_DIM, BLOCK_ROWS)
        t0 = 0
        while t0 < frames:
            t = t0 + tl.arange(0, BLOCK_T)
            key, mask = _rope_rows(
                qkv_row + (HEADS + kv) * HEAD_DIM, cos_row, sin_row, t, stride_qkv_t, stride_cos_t, stride_sin_t,
                frames, d, HEAD_DIM, HEAD_DIM_P,
            )
            rows = (history + t)[:, None] * HEAD_DIM + d[None, :]
            tl.store(k_out + rows, key.to(k_out_ptr.dtype.element_ty), mask=mask)
            value_ptrs = qkv_row + (HEADS + KV_HEADS + kv) * HEAD_DIM + t[:, None] * stride_qkv_t + d[None, :]
            tl.store(v_out + rows, tl.load(value_ptrs, mask=mask, other=0.0), mask=mask)
            t0 += BLOCK_T
        tl.debug_barrier()  # every thread's window stores are visible to the copy back below
        newest = frames * HEAD_DIM  # the window's rows frames .. frames + history - 1
        _copy_rows(
            k_out + newest, v_out + newest, HEAD_DIM, k_hist, v_hist, stride_hist_row, history, d, HEAD_DIM, BLOCK_ROWS,
        )


def rope_window(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
    k_hist: torch.Tensor, v_hist: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE and the key/value window of one attention layer, updating the slots' histories in place.

    qkv [B, T, (Hq + 2·Hkv)·D]: the q, k and v projections side by side (any batch and frame strides, lanes
    contiguous); cos, sin [B, T, D] (lanes contiguous); slots [B] int64, distinct; k_hist, v_hist
    [max_streams, Hkv, W - 1, D] (lanes contiguous). Returns query [B, Hq, T, D] (rotated), keys and values
    [B, Hkv, W - 1 + T, D] (the slot's history, then the new rotated keys / new values), all contiguous, and
    leaves the newest W - 1 rows of each window as the slot's history.
    """
    batch, frames, width = qkv.shape
    _, kv_heads, history, head_dim = k_hist.shape
    heads = width // head_dim - 2 * kv_heads
    if heads < 1 or width != (heads + 2 * kv_heads) * head_dim or v_hist.shape != k_hist.shape:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit histories {tuple(k_hist.shape)}")
    if cos.shape != (batch, frames, head_dim) or sin.shape != cos.shape or slots.shape != (batch,):
        raise ValueError(f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} or slots {tuple(slots.shape)} do not fit")
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_window needs contiguous lanes")
    if k_hist.stride() != v_hist.stride() or k_hist.stride(-1) != 1:
        raise ValueError("rope_window needs key and value histories of one layout, lanes contiguous")
    query = torch.empty(batch, heads, frames, head_dim, device=qkv.device, dtype=qkv.dtype)
    keys = torch.empty(batch, kv_heads, history + frames, head_dim, device=qkv.device, dtype=qkv.dtype)
    values = torch.empty_like(keys)
    _rope_window_kernel[(batch, heads + kv_heads)](
        qkv, cos, sin, slots, k_hist, v_hist, query, keys, values, frames, history,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        k_hist.stride(0), k_hist.stride(1), k_hist.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEAD_DIM_P=common.next_power_of_2(head_dim),
        BLOCK_T=min(common.next_power_of_2(frames), MAX_BLOCK_FRAMES), BLOCK_ROWS=BLOCK_ROWS,
        num_warps=4, enable_fp_fusion=False,
    )
    return query, keys, values


# ------------------------------------------------------------------------------------------------ SiLU·up


@jit
def _silu_mul_kernel(x_ptr, out_ptr, features, stride_x, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """out[row, f] = silu(gate) · up with gate = x[row, f], up = x[row, features + f]; silu rounded first."""
    row = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = f < features
    gate = tl.load(x_ptr + row * stride_x + f, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + features + f, mask=ok, other=0.0).to(tl.float32)
    dt = gate.dtype
    g = gate.to(tl.float32)
    e = expf(-g, LIBDEVICE)
    silu = round_to(tl.math.div_rn(g, 1.0 + e), dt)  # PyTorch's x / (1 + exp(-x)), IEEE division
    tl.store(out_ptr + row * features + f, (silu * up).to(dt), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2F] (gate then up; lanes contiguous) -> SiLU(gate) · up [N, F], contiguous."""
    rows, double = gate_up.shape
    if double % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul needs [rows, 2F] with contiguous lanes, got {tuple(gate_up.shape)}")
    features = double // 2
    out = torch.empty(rows, features, device=gate_up.device, dtype=gate_up.dtype)
    block = min(common.next_power_of_2(features), SILU_BLOCK)
    _silu_mul_kernel[(rows, triton.cdiv(features, block))](
        gate_up, out, features, gate_up.stride(0), BLOCK=block, LIBDEVICE=not common.interpreting(),
        num_warps=4, enable_fp_fusion=False,
    )
    return out
