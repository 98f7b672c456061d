"""The core-outputs benchmark (`benchmarks/serving/bench_core_outputs.py`): chunks handed to a real `HostedEngine`'s
output path reach real `EngineClient`s in processes of their own, every one of them, and the report says what they
cost and how long they took."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_chunk_reaches_its_client_and_the_report_says_what_it_cost(tmp_path: Path) -> None:
    out = tmp_path / "outputs.json"
    command = [sys.executable, "-m", "benchmarks.serving.bench_core_outputs", "--seconds", "2", "--clients", "2",
               "--turns-per-s", "100", "--out", str(out)]
    subprocess.run(command, check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["chunks"] > 500 and report["received"] == report["chunks"]  # nothing lost on the way
    assert 0 < report["isolated_send_us_per_chunk"] < report["engine_thread_us_per_chunk"]["p99"]
    assert 0 < report["delivery_us"]["p50"] <= report["delivery_us"]["p99"]
    assert report["io_thread_us_per_chunk"] > 0
