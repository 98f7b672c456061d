"""The codec's sliding-window transformer in about ten launches a layer (`FusedCodecTransformer`).

`StreamingCodecDecoder` decodes a chunk of a frame or a few per stream, where its eight transformer layers
are bound by kernel launches: on the official modules a layer is about 60 small kernels (see
`kernels/codec_layer.py`). Here a layer is

    rms_norm -> qkv GEMM -> rope_window -> SDPA -> attention-output GEMM (+ residual)
             -> rms_norm -> gate/up GEMM -> silu_mul -> down GEMM (+ residual)

with the q/k/v and the gate/up weights concatenated, and each LayerScale folded into the weight before it
(`scale[:, None] * W`), so that `hidden + scale * (x @ Wᵀ)` is one in-place `addmm_` on the residual stream. Folding the scale (and the
residual add inside the GEMM) changes where results are rounded, so this path equals the official layers to
float rounding, not bitwise; the norms, RoPE, SiLU·up, the mask and SDPA are the official arithmetic.

The keys and values live in the decoder's own per-slot history buffers (`rope_window` updates them in
place), so snapshot / restore / reset of the decoder see the same state on either path. The weights are read
once, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kernels import codec_layer
from ...models.compat import OfficialModule


@dataclass
class _Layer:
    in_norm: torch.Tensor
    in_eps: float
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    w_o_t: torch.Tensor  # (self_attn_layer_scale · W_o)ᵀ: [Hq D, hidden]
    post_norm: torch.Tensor
    post_eps: float
    w_gate_up: torch.Tensor  # [2 F, hidden]
    w_down_t: torch.Tensor  # (mlp_layer_scale · W_down)ᵀ: [F, hidden]
    k_history: torch.Tensor  # [max_streams, Hkv, W - 1, D], the decoder's own buffer
    v_history: torch.Tensor
    scaling: float
    groups: int


def _scaled_t(scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(scale[:, None] · weight)ᵀ, the product in fp32 rounded once to the weight's dtype.

    Folding the LayerScale into the weight rounds differently from the official scale · (x · Wᵀ) (the scaled
    weight is rounded, the projection's output is not): the fused path equals the official one to float
    rounding, not bitwise."""
    return (scale.detach().float()[:, None] * weight.detach().float()).to(weight.dtype).t()


class FusedCodecTransformer:
    """The official transformer's layers and final norm / output projection on the `codec_layer` kernels;
    `kernels.codec_layer.supports_transformer(transformer)` must hold. `histories`: each layer's key and value
    history buffers [max_streams, Hkv, W - 1, D], updated in place."""

    def __init__(self, transformer: OfficialModule, histories: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.output_proj = transformer.output_proj
        self.norm = transformer.norm.weight.detach()
        self.eps = float(transformer.norm.variance_epsilon)
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for layer, (k_history, v_history) in zip(transformer.layers, histories, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                self.layers.append(_Layer(
                    in_norm=layer.input_layernorm.weight.detach(),
                    in_eps=float(layer.input_layernorm.variance_epsilon),
                    w_qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                    w_o_t=_scaled_t(layer.self_attn_layer_scale.scale, attn.o_proj.weight),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    post_eps=float(layer.post_attention_layernorm.variance_epsilon),
                    w_gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                    w_down_t=_scaled_t(layer.mlp_layer_scale.scale, mlp.down_proj.weight),
                    k_history=k_history, v_history=v_history,
                    scaling=float(attn.scaling), groups=int(attn.num_key_value_groups),
                ))

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
    ) -> torch.Tensor:
        """The layers, final norm and output projection over `input_proj`'s output [B, T, hidden] (overwritten:
        the residual stream is updated in place); cos, sin [B, T, D] from the rotary embedding, `mask` as the
        eager path builds it. Returns [B, T, latent]."""
        batch, frames, width = hidden.shape
        h = hidden.reshape(batch * frames, width).contiguous()  # a view of `hidden` where it is contiguous
        for layer in self.layers:
            qkv = F.linear(codec_layer.rms_norm(h, layer.in_norm, layer.in_eps), layer.w_qkv)
            query, keys, values = codec_layer.rope_window(
                qkv.view(batch, frames, -1), cos, sin, slots, layer.k_history, layer.v_history,
            )
            if layer.groups > 1:
                keys = keys.repeat_interleave(layer.groups, dim=1)
                values = values.repeat_interleave(layer.groups, dim=1)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=layer.scaling)
            # in place: out-of-place addmm would first copy h into its output (one more kernel)
            h.addmm_(attended.transpose(1, 2).reshape(batch * frames, -1), layer.w_o_t)
            gate_up = F.linear(codec_layer.rms_norm(h, layer.post_norm, layer.post_eps), layer.w_gate_up)
            h.addmm_(codec_layer.silu_mul(gate_up), layer.w_down_t)
        return self.output_proj(codec_layer.rms_norm(h, self.norm, self.eps)).view(batch, frames, -1)
