"""A Qwen3 decoder layer (q/k RMSNorm, RoPE, GQA, SwiGLU) computed over a static KV cache with few kernels.

The official modules launch about 56 kernels per layer; on a GPU a frame is bound by kernel count, not by
bytes, so this path fuses what plain PyTorch can fuse without changing results: q/k/v and gate/up share one
matmul each (the official weights become views into the fused tensors, so nothing is duplicated), RMSNorm is
one `F.rms_norm`, q and k are rotated together, and single-token attention uses grouped matmuls instead of
repeating keys for GQA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...models.compat import OfficialModule


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor:
    """Concatenate Linear weights along the output dim and make the modules view into the result."""
    if any(lin.bias is not None for lin in linears):
        raise NotImplementedError("biased projections are not used by Qwen3-TTS")
    fused = torch.cat([lin.weight.data for lin in linears], dim=0).contiguous()
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[offset : offset + rows]
        offset += rows
    return fused


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [..., head_dim] for integer positions, in float32 as the official modules do.

    The official rotation is x*cos + cat(-x2, x1)*sin; with sin's first half negated it becomes
    x*cos + cat(x2, x1)*sin, and cat(x2, x1) is one roll.
    """
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return emb.cos().to(dtype), sin.to(dtype)


class FusedDecoderLayer:
    """Weights of one official decoder layer, rearranged for the decode path (and, as they are, the
    `kernels.decode_layer.DecoderLayerWeights` the Triton decode step reads)."""

    def __init__(self, layer: OfficialModule) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.q_size = attn.q_proj.weight.shape[0]
        self.kv_size = attn.k_proj.weight.shape[0]
        self.ffn = mlp.gate_proj.weight.shape[0]
        self.eps = layer.input_layernorm.variance_epsilon
        self.in_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.q_norm = attn.q_norm.weight
        self.k_norm = attn.k_norm.weight
        self.w_qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.w_o = attn.o_proj.weight
        self.w_gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.w_down = mlp.down_proj.weight
        if mlp.act_fn.__class__.__name__ not in ("SiLU", "SiLUActivation"):
            raise NotImplementedError(f"unexpected activation {mlp.act_fn}")

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        write_rows: torch.Tensor,
        write_pos: torch.Tensor,
        read_rows: slice | torch.Tensor,
        read_len: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [b, t, hidden] -> [b, t, hidden]. cos/sin [b, t, head_dim]. caches [slots, kv_heads, len, dim].

        New keys/values go to (write_rows [b, 1], write_pos [b, t]); attention then reads cache rows
        `read_rows` (a slice, or slot indices [b]), positions [0, read_len), under `mask`
        (bool [b, 1, t, read_len]; None = causal).
        """
        b, t, _ = x.shape
        d = self.head_dim
        h = F.rms_norm(x, (x.shape[-1],), self.in_norm, self.eps)
        q, k, v = F.linear(h, self.w_qkv).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = F.rms_norm(q.view(b, t, -1, d), (d,), self.q_norm, self.eps)
        k = F.rms_norm(k.view(b, t, -1, d), (d,), self.k_norm, self.eps)
        n_q = q.shape[2]
        qk = torch.cat((q, k), dim=2)  # rotate q and k in one go: [b, t, heads + kv_heads, d]
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        qk = qk * c + qk.roll(d // 2, dims=-1) * s
        q, k = qk[:, :, :n_q], qk[:, :, n_q:]
        cache_k[write_rows, :, write_pos] = k
        cache_v[write_rows, :, write_pos] = v.view(b, t, -1, d)
        # separate K and V tensors keep (slot, head) flattenable, so the batched matmuls read the cache in place
        keys = cache_k[read_rows, :, :read_len]  # [b, kv_heads, L, d]
        values = cache_v[read_rows, :, :read_len]
        kv_heads = keys.shape[1]
        if t == 1:
            # grouped single-token attention: queries of one kv head share its keys, no repeat needed
            qg = q.view(b, kv_heads, -1, d)
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scaling
            if mask is not None:
                scores = torch.where(mask, scores, float("-inf"))
            out = torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(qg.dtype), values)
            out = out.reshape(b, 1, -1)
        else:
            groups = n_q // kv_heads
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1),
                attn_mask=mask, is_causal=mask is None, scale=self.scaling,
            )
            out = out.transpose(1, 2).reshape(b, t, -1)
        x = x + F.linear(out, self.w_o)
        h = F.rms_norm(x, (x.shape[-1],), self.post_norm, self.eps)
        gate, up = F.linear(h, self.w_gate_up).split((self.ffn, self.ffn), dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w_down)
