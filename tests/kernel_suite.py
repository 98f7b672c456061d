"""The kernel tests' own pytest process (tests/test_kernel_suite.py says why they need one), started as soon
as a session has collected the test that waits for it.

Under Triton's interpreter that process keeps one core busy for minutes, while much of the rest of the suite
waits on sockets, subprocesses and audio paced in real time; started at collection, it runs beside them
instead of after them. It gets one thread, so it leaves the other core to the tests beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", str(ROOT / "tests" / "kernels")]

_process: subprocess.Popen[str] | None = None
_output: IO[str] | None = None


def start() -> None:
    """Start the kernel tests' process, once per session."""
    global _process, _output
    if _process is not None:
        return
    _output = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the process writes it until it ends; `result` closes it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _process = subprocess.Popen(COMMAND, cwd=ROOT, stdout=_output, stderr=subprocess.STDOUT, text=True, env=env)


def result(timeout: float) -> tuple[int, str]:
    """The process's exit code and output, once it ends (started now if it was not); killed past `timeout`."""
    start()
    assert _process is not None and _output is not None
    try:
        code = _process.wait(timeout)
    except subprocess.TimeoutExpired:
        stop()
        raise
    _output.seek(0)
    output = _output.read()
    _output.close()
    return code, output


def stop() -> None:
    """Kill the process if it still runs (a session that ends before its test, or one that timed out)."""
    if _process is not None and _process.poll() is None:
        _process.kill()
        _process.wait()
