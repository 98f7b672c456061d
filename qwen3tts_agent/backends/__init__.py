"""Backends: which implementation runs the model maths under the engine.

The engine drives a runner (`ModelRunner`'s interface: slot tables, `prefill`, `frame_step`, `frame_out`)
and a streaming codec decoder (`StreamingCodecDecoder`'s interface). Both come from here:

- "torch": the PyTorch path (`engine.runner`, `engine.audio.codec`), with Triton kernels and CUDA graphs on a GPU;
  on a CPU it is eager fp32 PyTorch.
- "int8": the CPU backend (`backends.cpu`): the talker and the code predictor as ONNX Runtime graphs with
  8-bit weights; the codec decoder with its short convolutions as GEMMs, in bfloat16 where the CPU has it.
- "int4" (opt-in): the same with 4-bit weights, half the bytes a frame reads and coarser numbers
  (docs/cpu-backend.md says what that changes).
- "fp32": the same CPU backend with fp32 weights, which exists to prove it exact against the official model.
- "auto": "int8" on a CPU, "torch" on a GPU (and on a CPU where the Triton kernels run interpreted, which
  only their tests do).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine.audio import StreamingCodecDecoder
from ..engine.runner import ModelRunner
from ..kernels import common as kernel_common
from ..models.compat import OfficialModule

BACKENDS = ("auto", "torch", "int8", "int4", "fp32")
CPU_BACKENDS = ("int8", "int4", "fp32")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The concrete backend for `backend` on `device` ("auto": "int8" on a CPU, "torch" elsewhere).

    "auto" picks the CPU backend only where the PyTorch path would be eager PyTorch: under TRITON_INTERPRET
    (the Triton kernels' tests) it keeps the kernels' path.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        return "int8" if device.type == "cpu" and not kernel_common.available(device) else "torch"
    if backend in CPU_BACKENDS and device.type != "cpu":
        raise ValueError(f"backend {backend!r} runs on the CPU; the model is on {device}")
    return backend


def create_runner(
    model: OfficialModule, backend: str = "auto", *, cache_root: Path | None = None, progress: bool = True,
    threads: int | None = None, spare_threads: int = 0, **runner_kwargs: object,
) -> ModelRunner:
    """The runner of `model` (an official `Qwen3TTSForConditionalGeneration`) for `backend`.

    `runner_kwargs` are `ModelRunner`'s (max_slots, max_seq_len, max_text_tokens, top_k_cap, fused_kernels);
    the CPU backends convert the weights first (cached, see `backends.cpu.store`) and run their graphs on
    `threads` cores (default: PyTorch's thread count; the PyTorch backend runs on its caller's), and on
    `spare_threads` more while the codec's cores are idle (`ModelRunner.lend_codec_cores`).
    """
    device = next(model.talker.parameters()).device
    backend = resolve_backend(backend, device)
    if backend == "torch":
        return ModelRunner(model, **runner_kwargs)  # type: ignore[arg-type]
    from .cpu.runner import CpuRunner
    from .cpu.store import prepare

    runner_kwargs.pop("fused_kernels", None)  # Triton kernels are a GPU matter
    folder = prepare(model, backend, cache_root=cache_root, progress=progress)
    return CpuRunner(model, folder, backend, threads=threads, spare_threads=spare_threads, **runner_kwargs)  # type: ignore[arg-type]


def create_codec(decoder: OfficialModule, backend: str = "auto", **codec_kwargs: object) -> StreamingCodecDecoder:
    """The streaming codec decoder of the official `decoder` for `backend` (`max_streams=` as the engine's).

    "int8" and "int4" decode in bfloat16 where the CPU has it natively (`cpu.codec.native_bfloat16`), else in
    float32; "fp32" keeps the decoder's float32, exact.
    """
    backend = resolve_backend(backend, next(decoder.parameters()).device)
    if backend == "torch":
        return StreamingCodecDecoder(decoder, **codec_kwargs)  # type: ignore[arg-type]
    from .cpu.codec import CpuCodecDecoder, native_bfloat16

    if backend in ("int8", "int4") and "compute_dtype" not in codec_kwargs and native_bfloat16():
        codec_kwargs["compute_dtype"] = torch.bfloat16
    return CpuCodecDecoder(decoder, **codec_kwargs)  # type: ignore[arg-type]
