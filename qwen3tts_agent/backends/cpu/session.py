"""ONNX Runtime sessions whose inputs and outputs are PyTorch tensors, bound once and run many times.

A binding holds raw pointers into tensors the runner keeps for its whole life (slot tables, KV caches, step
buffers), so a frame re-runs prepared bindings without copying or re-binding anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_NUMPY_DTYPES = {torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64}
_shared_pool_threads: int | None = None  # the size of this process's shared pool, once made


def shared_pool(threads: int) -> None:
    """Make this process's shared ONNX Runtime intra-op pool of `threads` threads, once (before any session
    uses it); later calls cannot change its size. From then on ONNX Runtime refuses to create
    any session in this process that asks for a pool of its own (the default of `SessionOptions`)."""
    global _shared_pool_threads
    if _shared_pool_threads is None:
        import onnxruntime as ort

        ort.set_global_thread_pool_sizes(threads, 1)  # its threads may spin (ONNX Runtime's default for it)
        _shared_pool_threads = threads
    elif _shared_pool_threads != threads:
        logger.warning("ONNX Runtime's shared pool has %d threads; %d asked for", _shared_pool_threads, threads)


def session_options(threads: int, spin: bool = False, shared: bool = False) -> object:
    """One intra-op pool of `threads` threads, sequential execution, all graph optimisations.

    `spin`: pool threads busy-wait for the next op instead of sleeping. That saves a wake-up per op on
    dedicated cores, but spinning threads steal the cores from the PyTorch ops between graph calls and from
    other processes, which on a shared machine costs far more (docs/cpu-backend.md).
    `shared`: the session runs on the process's shared pool (`shared_pool`) instead of a pool of its own, so
    the talker, the predictor and its fifteen heads, which run one after the other, keep one team of
    threads between them (ONNX Runtime's shared pool spins between ops, whatever `spin` says).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    if shared:  # the pool's size is the shared pool's (sizes given here would be ignored, with a warning)
        shared_pool(threads)
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # warnings about unused initializers etc. are noise here
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return options


class SpareCores:
    """Whether the codec's cores are idle now, so that the graphs may run on them too (`BoundSession`).

    The engine's core thread, which makes every graph call, is also the only one that gives the codec work:
    cores found idle when a call starts stay idle until it returns."""

    def __init__(self) -> None:
        self._probe: Callable[[], bool] = lambda: False
        self.calls = 0  # graph calls of the sessions that may borrow them
        self.lent = 0  # ... of which ran on them too

    def watch(self, codec_idle: Callable[[], bool]) -> None:
        """From now on ask `codec_idle()` before each graph call."""
        self._probe = codec_idle

    def lend(self) -> bool:
        """Whether the graph call about to run may run on the codec's cores too (each call is counted)."""
        idle = self._probe()
        self.calls += 1
        self.lent += idle
        return idle


class BoundSession:
    """An `InferenceSession` on the CPU provider, run through IOBindings over torch tensors.

    With `wide_threads` and `spare`, the graph is loaded twice: on `threads` threads, and on `wide_threads`
    (the step side's cores and the codec's) for the calls `spare.lend()` lets run there. The second copy costs the
    graph's weights again in memory; it exists because a batch-1 step is bound by memory bandwidth that one
    core cannot draw alone, and a prompt by arithmetic."""

    def __init__(
        self, path: Path, threads: int, spin: bool = False, shared: bool = False,
        wide_threads: int = 0, spare: SpareCores | None = None,
    ) -> None:
        import onnxruntime as ort

        self.path = path
        self.spare = spare if wide_threads > threads and not shared else None
        self._sessions = [
            ort.InferenceSession(str(path), session_options(n, spin, shared), providers=["CPUExecutionProvider"])
            for n in ((threads, wide_threads) if self.spare is not None else (threads,))
        ]
        self.session = self._sessions[0]

    def bind(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> object:
        """IOBindings over these tensors (contiguous, on the CPU), one per loaded copy; they must outlive them."""
        bindings = []
        for session in self._sessions:
            binding = session.io_binding()
            for name, tensor in inputs.items():
                binding.bind_input(name, "cpu", 0, _dtype(tensor), list(tensor.shape), tensor.data_ptr())
            for name, tensor in outputs.items():
                binding.bind_output(name, "cpu", 0, _dtype(tensor), list(tensor.shape), tensor.data_ptr())
            bindings.append(binding)
        return bindings

    def run(self, binding: object) -> None:
        wide = self.spare is not None and self.spare.lend()
        self._sessions[wide].run_with_iobinding(binding[wide])  # type: ignore[index]


def _dtype(tensor: torch.Tensor) -> type:
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("ONNX Runtime bindings need contiguous CPU tensors")
    return _NUMPY_DTYPES[tensor.dtype]
