"""Kernel tests that run under Triton's interpreter on the CPU, in a process of their own.

The interpreter has to be switched on before the kernels are decorated, and other tests in the same pytest
process may already have imported them. So a kernel test file runs itself as a script with
TRITON_INTERPRET=1 (`run_interpreted`), computes every case there and prints the results as JSON
(`report_results`), and its pytest tests assert on them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MARKER = "INTERPRETED-RESULTS "
ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: float) -> dict[str, Any]:
    """Run `script` under the interpreter and return what it reported; fail with its output otherwise."""
    # triton is a dev dependency: its absence is a failure, not a skip
    assert importlib.util.find_spec("triton") is not None, "triton is not installed (pip install -e '.[dev]')"
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)  # the script imports `tests.` and the package
    proc = subprocess.run([sys.executable, script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, f"{Path(script).name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len(MARKER) :])


def start_child() -> None:
    """In the script: check the interpreter is on, and speed it up."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    _fast_xor_sum()


def report_results(results: dict[str, Any]) -> None:
    print(MARKER + json.dumps(results), flush=True)


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
