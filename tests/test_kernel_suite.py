"""The kernel tests (tests/kernels/) in a pytest process of their own, under Triton's interpreter.

Triton fixes when the kernels are first imported whether they run interpreted or compiled. This process
imports them compiled (so on a CPU every engine test here runs the PyTorch layers), while tests/kernels
needs them interpreted; so this test runs `pytest tests/kernels` as a subprocess, and that run's report,
failing lines included, is the assertion message. See tests/kernels/conftest.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)
def test_kernel_tests_pass_under_the_interpreter() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", str(ROOT / "tests" / "kernels")],
        cwd=ROOT, capture_output=True, text=True, timeout=1750,
    )
    report = proc.stdout[-20000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in report and " skipped" not in report, report
