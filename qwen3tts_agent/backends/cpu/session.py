"""ONNX Runtime sessions whose inputs and outputs are PyTorch tensors, bound once and run many times.

A binding holds raw pointers into tensors the runner keeps for its whole life (slot tables, KV caches, step
buffers), so a frame re-runs prepared bindings without copying or re-binding anything.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_NUMPY_DTYPES = {torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64}


def session_options(threads: int, spin: bool = False) -> object:
    """One intra-op pool of `threads` threads, sequential execution, all graph optimisations.

    `spin`: pool threads busy-wait for the next op instead of sleeping. That saves a wake-up per op on
    dedicated cores, but spinning threads steal the cores from the PyTorch ops between graph calls and from
    other processes, which on a shared machine costs far more (docs/cpu-backend.md).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # warnings about unused initializers etc. are noise here
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return options


class BoundSession:
    """An `InferenceSession` on the CPU provider, run through IOBindings over torch tensors."""

    def __init__(self, path: Path, threads: int, spin: bool = False) -> None:
        import onnxruntime as ort

        self.path = path
        self.session = ort.InferenceSession(str(path), session_options(threads, spin), providers=["CPUExecutionProvider"])

    def bind(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> object:
        """An IOBinding over these tensors (contiguous, on the CPU); they must outlive it."""
        binding = self.session.io_binding()
        for name, tensor in inputs.items():
            binding.bind_input(name, "cpu", 0, _dtype(tensor), list(tensor.shape), tensor.data_ptr())
        for name, tensor in outputs.items():
            binding.bind_output(name, "cpu", 0, _dtype(tensor), list(tensor.shape), tensor.data_ptr())
        return binding

    def run(self, binding: object) -> None:
        self.session.run_with_iobinding(binding)


def _dtype(tensor: torch.Tensor) -> type:
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("ONNX Runtime bindings need contiguous CPU tensors")
    return _NUMPY_DTYPES[tensor.dtype]
