"""ONNX graphs of the talker and code-predictor decoder stacks, built from the official modules' weights.

One graph runs a whole stack of Qwen3 decoder layers (RMSNorm, q/k RMSNorm, RoPE, grouped-query attention,
SwiGLU) for a batch of rows, so a talker step or a predictor step is ONE ONNX Runtime call instead of
hundreds of PyTorch ops. The projections are `MatMulNBits` (8-bit weights in blocks along the input
dimension, int8 activations: ONNX Runtime's VNNI GEMV kernels) in the int8 format, the same with 4-bit
weights in the int4 format (half the bytes a frame reads, coarser numbers: opt-in), or plain fp32 `MatMul`
in the fp32 format, which exists to prove the graphs exact against the official model.

The KV caches are graph inputs and outputs bound to the same memory (`GroupQueryAttention` with a shared
past/present buffer): the op writes each row's new keys at its position `seqlens_k` and attends over the
keys before it, so a step touches only the cache it needs. The caches themselves are PyTorch tensors owned
by the runner (`session.BoundSession`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ...models.compat import OfficialModule

WEIGHT_FORMATS = ("int8", "int4", "fp32")
QUANTIZED_BITS = {"int8": 8, "int4": 4}  # the formats with MatMulNBits weights, and their bits per weight
MS_DOMAIN = "com.microsoft"
OPSET = 17
# The IR version of opset 17's release (onnx 1.13), not the installed onnx package's newest: an onnxruntime
# older than that package refuses a newer IR ("Unsupported model IR version"), whatever the opset.
IR_VERSION = 8
QUANT_BLOCK = 128  # weights per scale along the input dimension (MatMulNBits block_size)


def block_size(k: int) -> int:
    """The MatMulNBits block: QUANT_BLOCK, or the largest power of two >= 16 dividing K (tiny models)."""
    size = QUANT_BLOCK
    while size > 16 and k % size:
        size //= 2
    if k % size:
        raise ValueError(f"input dimension {k} is not a multiple of 16")
    return size


def quantize_blocks(weight: torch.Tensor, block: int, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric `bits`-bit blocks of a Linear weight [N, K] in MatMulNBits' layout: (uint8 [N, K/block,
    block * bits / 8], scales [N * K/block]).

    The scale of a block is its largest magnitude / (2**(bits-1) - 1), so every weight maps to -127..127 (8
    bits) or -7..7 (4 bits), stored offset by 2**(bits-1), MatMulNBits' zero point when none is given; 4-bit
    values go two to a byte, the first of each pair in the low half.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = weight.shape
    levels = 2 ** (bits - 1) - 1
    blocks = weight.detach().float().reshape(n, k // block, block)
    scales = blocks.abs().amax(dim=-1).clamp(min=1e-12) / levels
    q = (torch.round(blocks / scales.unsqueeze(-1)).clamp(-levels, levels).to(torch.int16) + levels + 1).to(torch.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q.contiguous().numpy(), scales.reshape(-1).numpy().astype(np.float32)


@dataclass(frozen=True)
class StackShape:
    """The dimensions of one decoder stack (read from the official config)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    scaling: float


class GraphBuilder:
    """Collects nodes and initializers; `linear` emits MatMulNBits or MatMul depending on the format."""

    def __init__(self, weight_format: str) -> None:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weight_format!r}; known: {', '.join(WEIGHT_FORMATS)}")
        self.format = weight_format
        self.nodes: list = []
        self.initializers: list = []
        self._names = 0

    def name(self, prefix: str) -> str:
        self._names += 1
        return f"{prefix}_{self._names}"

    def const(self, prefix: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(prefix)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs: Any) -> list[str]:
        from onnx import helper

        names = [self.name(op.lower()) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op, inputs, names, domain=domain, **attrs))
        return names

    def linear(self, x: str, weight: torch.Tensor, bias: torch.Tensor | None = None, out: str | None = None) -> str:
        """x @ weight.T (+ bias): weight [N, K] as 8- or 4-bit blocks, or fp32."""
        n, k = weight.shape
        outputs = [out] if out is not None and bias is None else 1
        bits = QUANTIZED_BITS.get(self.format)
        if bits is not None:
            block = block_size(k)
            q, scales = quantize_blocks(weight, block, bits)
            (y,) = self.node(
                "MatMulNBits", [x, self.const("w", q), self.const("s", scales)], outputs, domain=MS_DOMAIN,
                K=k, N=n, bits=bits, block_size=block, accuracy_level=4,
            )
        else:
            (y,) = self.node("MatMul", [x, self.const("w", weight.detach().float().T.contiguous().numpy())], outputs)
        if bias is not None:
            (y,) = self.node("Add", [y, self.const("b", bias.detach().float().numpy())], [out] if out else 1)
        return y

    def rms_norm(self, x: str, weight: torch.Tensor, eps: float) -> str:
        (y,) = self.node(
            "SimplifiedLayerNormalization", [x, self.const("norm", weight.detach().float().numpy())],
            axis=-1, epsilon=eps, stash_type=1,
        )
        return y

    def shape_const(self, *dims: int) -> str:
        return self.const("shape", np.asarray(dims, dtype=np.int64))


def stack_shape(layers: list[OfficialModule], config: OfficialModule) -> StackShape:
    attn, mlp = layers[0].self_attn, layers[0].mlp
    return StackShape(
        hidden=config.hidden_size, heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, head_dim=attn.head_dim,
        ffn=mlp.gate_proj.weight.shape[0], eps=layers[0].input_layernorm.variance_epsilon, scaling=attn.scaling,
    )


def decoder_stack_graph(
    layers: list[OfficialModule], shape: StackShape, weight_format: str, in_proj: OfficialModule | None = None,
    progress: object | None = None,
) -> Any:
    """The ONNX model of a stack of official Qwen3 decoder layers (`Qwen3TTS*DecoderLayer`).

    Inputs: x [B, S, hidden_in], seqlens_k int32 [B] (each row's last position after this call),
    total_len int32 [1] (the largest seqlens_k + 1), cos/sin [positions, head_dim / 2], and per layer
    past_key_i / past_value_i [B, kv_heads, cache_len, head_dim]. Outputs: y [B, S, hidden] (the last
    layer's output, before the final norm) and present_key_i / present_value_i, to be bound to the same
    memory as the past ones. `in_proj`: the predictor's talker-to-predictor Linear, applied first.
    """
    from onnx import TensorProto, helper

    g = GraphBuilder(weight_format)
    d, heads, kv = shape.head_dim, shape.heads, shape.kv_heads
    q_size, kv_size = heads * d, kv * d
    x = "x"
    if isinstance(in_proj, nn.Linear):
        x = g.linear(x, in_proj.weight, in_proj.bias)
    per_head = g.shape_const(0, 0, -1, d)  # [B, S, heads, d]: Reshape's 0 copies the input dim
    flat = g.shape_const(0, 0, -1)
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", in_proj.in_features if isinstance(in_proj, nn.Linear) else shape.hidden]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_len", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["positions", d // 2]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["positions", d // 2]),
    ]
    outputs = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", TensorProto.FLOAT, ["batch", kv, "cache", d]))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", TensorProto.FLOAT, ["batch", kv, "cache", d]))
        h = g.rms_norm(x, layer.input_layernorm.weight, shape.eps)
        qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        qkv = g.linear(h, qkv_weight)
        q, k, v = g.node("Split", [qkv, g.const("split", np.asarray([q_size, kv_size, kv_size], np.int64))], 3, axis=-1)
        q = g.node("Reshape", [g.rms_norm(g.node("Reshape", [q, per_head])[0], attn.q_norm.weight, shape.eps), flat])[0]
        k = g.node("Reshape", [g.rms_norm(g.node("Reshape", [k, per_head])[0], attn.k_norm.weight, shape.eps), flat])[0]
        (att,) = g.node(
            "GroupQueryAttention",
            [q, k, v, f"past_key_{i}", f"past_value_{i}", "seqlens_k", "total_len", "cos", "sin"],
            [g.name("attn"), f"present_key_{i}", f"present_value_{i}"],
            domain=MS_DOMAIN, num_heads=heads, kv_num_heads=kv, scale=shape.scaling, do_rotary=1, rotary_interleaved=0,
        )[:1]
        (x,) = g.node("Add", [x, g.linear(att, attn.o_proj.weight)])
        h = g.rms_norm(x, layer.post_attention_layernorm.weight, shape.eps)
        gate_up = g.linear(h, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        gate, up = g.node("Split", [gate_up, g.const("split", np.asarray([shape.ffn, shape.ffn], np.int64))], 2, axis=-1)
        (silu,) = g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])
        (act,) = g.node("Mul", [silu, up])
        last = i == len(layers) - 1
        (x,) = g.node("Add", [x, g.linear(act, mlp.down_proj.weight)], ["y"] if last else 1)
        if progress is not None:
            progress.update(1)  # type: ignore[attr-defined]
    outputs.insert(0, helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", shape.hidden]))
    graph = helper.make_graph(g.nodes, "decoder_stack", inputs, outputs, g.initializers)
    return onnx_model(graph)


def linear_graph(weight: torch.Tensor, weight_format: str) -> Any:
    """One Linear (no bias) as an ONNX model: x [rows, K] -> y [rows, N] (the output heads)."""
    from onnx import TensorProto, helper

    g = GraphBuilder(weight_format)
    n, k = weight.shape
    g.linear("x", weight, out="y")
    graph = helper.make_graph(
        g.nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])], g.initializers,
    )
    return onnx_model(graph)


def onnx_model(graph: Any) -> Any:
    """`graph` as a model of the opsets and IR version the backend's sessions load."""
    from onnx import helper

    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, producer_name="qwen3tts-agent", ir_version=IR_VERSION)
