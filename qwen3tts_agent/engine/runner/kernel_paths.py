"""Which of a model's stacks run as the Triton kernels (`choose_kernel_paths`), decided once at load.

The runner turns the answer into two flags (`ModelRunner.fused_talker`, `fused_predictor`) and keeps it as
`kernel_paths`, which the engine's stats report per stack (`EngineStats.kernel_paths`); the codec decoder
makes the same `conv_epilogue.supports_decoder` and `codec_layer.supports_transformer` checks itself. Kept apart from the
runner because the choice reads only the stacks' shapes and the kernels' `supports` checks, none of the
runner's state.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...kernels import codec_layer, conv_epilogue, decode_layer, gemv
from ...kernels import common as kernel_common
from ...kernels import frame as frame_kernels
from ...kernels import sampling as sampling_kernels
from .layers import FusedDecoderLayer

logger = logging.getLogger(__name__)

TRITON_PATH = "triton"  # a `kernel_paths` value: the stack runs as the Triton kernels


def choose_kernel_paths(
    talker: list[FusedDecoderLayer],
    predictor: list[FusedDecoderLayer],
    codec_decoder: nn.Module,  # the official `Qwen3TTSTokenizerV2Decoder` (pre-transformer and audio decoder)
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_slots: int,
    requested: bool,
) -> dict[str, str]:
    """Which stacks run as the Triton kernels: "triton", or "pytorch (why not)" per stack.

    A stack runs fused only if every kernel family it uses takes its shapes (`supports`), so no shape
    ever fails a step: the rest stays on the PyTorch layers, which the CUDA graphs capture just the
    same. Shapes the kernels refuse are worth a warning (that stack is slower); no GPU or
    `fused_kernels=False` (`requested`) is not. The codec's kernels (the conv epilogues, the fused transformer) do not
    follow `fused_kernels`.
    """

    def stack(layers: list[FusedDecoderLayer]) -> list[kernel_common.Support]:
        first = layers[0]
        heads, kv_heads = first.q_size // first.head_dim, first.kv_size // first.head_dim
        return [
            decode_layer.supports(first.head_dim, heads, kv_heads, dtype, max_slots),
            gemv.supports(dtype), sampling_kernels.supports(dtype), frame_kernels.supports(dtype),
        ]

    checks = {
        "talker": stack(talker),
        "predictor": stack(predictor),
        "codec": [
            conv_epilogue.supports_decoder(codec_decoder.decoder),
            codec_layer.supports_transformer(codec_decoder.pre_transformer),
        ],
    }
    available = kernel_common.available(device)
    paths, refused = {}, []
    for name, supports in checks.items():
        failed = next((s for s in supports if not s), None)
        if not available:
            paths[name] = f"pytorch (no Triton kernels on {device.type})"
        elif not requested and name != "codec":
            paths[name] = "pytorch (fused kernels off)"
        elif failed is not None:
            paths[name] = f"pytorch ({failed.reason})"
            refused.append(f"{name}: {failed.reason}")
        else:
            paths[name] = TRITON_PATH
    if refused:
        logger.warning(
            "The Triton kernels do not take this checkpoint's shapes (%s); those stacks run on the PyTorch "
            "layers, still graphed but slower.", "; ".join(refused),
        )
    return paths
