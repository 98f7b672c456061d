"""The kernel tests (tests/kernels/) in a pytest process of their own, under Triton's interpreter.

Triton fixes when the kernels are first imported whether they run interpreted or compiled. This process
imports them compiled (so on a CPU every engine test here runs the PyTorch layers), while tests/kernels
needs them interpreted; so this test runs `pytest tests/kernels` as a subprocess, and that run's report,
failing lines included, is the assertion message. See tests/kernels/conftest.py. The process starts when the
session has collected this test (tests/kernel_suite.py), so it runs beside the rest of the suite.
"""

from __future__ import annotations

import pytest

from tests import kernel_suite


@pytest.mark.timeout(1800)
def test_kernel_tests_pass_under_the_interpreter() -> None:
    code, output = kernel_suite.result(timeout=1750)
    report = output[-23000:]
    assert code == 0, report
    assert " passed" in report and " skipped" not in report, report
