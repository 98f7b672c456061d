"""The Triton kernels against their PyTorch references: under Triton's interpreter on the CPU, compiled on a GPU.

Triton decides when a kernel is decorated, i.e. when `qwen3tts_agent.kernels` is first imported, whether it
runs interpreted (TRITON_INTERPRET=1) or compiled, and the choice holds for the whole process. So this
directory runs in a pytest process of its own, in one of two modes chosen here before any test module
imports the kernels:

- `pytest tests/kernels` (on any machine): the interpreter on the CPU. The tests parametrised by `device`
  run their "cpu" variants; the "cuda" ones carry the `gpu` marker, deselected by default.
- `pytest -m gpu tests/kernels` (on a CUDA machine): compiled, the "cuda" variants only.

The main suite does not collect this directory (tests/conftest.py); tests/test_kernel_suite.py runs it as
`pytest tests/kernels` in a subprocess instead, so a plain `pytest` still covers the kernels. Running the
engine tests and these in one process would run the engine's kernels interpreted, or these compiled.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

_MODE_MESSAGE = (
    "tests/kernels runs in a pytest process of its own: `pytest tests/kernels` (Triton's interpreter) or "
    "`pytest -m gpu tests/kernels` (compiled, on a GPU); see tests/kernels/conftest.py"
)


def _compiled_run(config: pytest.Config) -> bool:
    """Whether this run selects the GPU variants: the marker expression is `gpu` (possibly with others)."""
    words = str(config.getoption("markexpr") or "").replace("(", " ").replace(")", " ").split()
    return "gpu" in words and "not" not in words


def pytest_configure(config: pytest.Config) -> None:
    compiled = _compiled_run(config)
    if "qwen3tts_agent.kernels.common" in sys.modules:
        from qwen3tts_agent.kernels import common

        if common.interpreting() == compiled:
            raise pytest.UsageError(f"the kernels were imported in the other mode before this conftest ran; {_MODE_MESSAGE}")
    if compiled:
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise pytest.UsageError(f"-m gpu runs the compiled kernels: unset TRITON_INTERPRET; {_MODE_MESSAGE}")
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("-m gpu runs the compiled kernels on a CUDA GPU, and torch sees none here")
        return
    os.environ["TRITON_INTERPRET"] = "1"
    _fast_xor_sum()
    _patch_language_once_per_launch()


def _fast_xor_sum() -> None:
    """Reduce xor_sum with numpy: the interpreter loops over elements in Python, once per tl.topk swap step."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    generic = interpreter.ReduceOps.apply_impl

    def apply_impl(self: Any, input: Any) -> Any:
        if self.combine_fn != tl.standard._xor_combine:
            return generic(self, input)
        data = np.bitwise_xor.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(data, input[0].dtype)

    interpreter.ReduceOps.apply_impl = apply_impl


def _patch_language_once_per_launch() -> None:
    """Let the interpreter patch triton.language for a module's @jit helpers once per launch, not per call.

    A launch patches the language for its run; every nested @jit call then patches it again for the callee's
    module (`inspect.getmembers` over the language), which is about half of an interpreted launch's time in
    these kernels, which call many small helpers. Here a callee's module is patched at its first call in a
    launch only; the patching itself is the interpreter's.
    """
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__
    patched: list[set[int]] = []  # per running launch: the globals of the callees patched in it

    def run_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def call_nested(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = id(self.fn.__globals__)
        if not patched or module not in patched[-1]:
            interpreter._patch_lang(self.fn)
            if patched:
                patched[-1].add(module)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = run_launch
    interpreter.InterpretedFunction.__call__ = call_nested


DEVICES = [pytest.param("cpu", id="interpreted"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a kernel test runs on: "cpu" under the interpreter, "cuda" compiled (with -m gpu)."""
    compiled = _compiled_run(request.config)
    if (request.param == "cuda") != compiled:
        pytest.skip(f"the {request.param} variants run in the other mode; {_MODE_MESSAGE}")
    return request.param
