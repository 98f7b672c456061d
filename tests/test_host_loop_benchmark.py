"""`benchmarks/engine/bench_host_loop.py`: the core's host bookkeeping per step, the engine's own scheduler driven
as the core drives it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.engine import bench_host_loop


def test_every_stream_steps_and_their_chunks_fall_due_on_every_step(tmp_path: Path) -> None:
    """Staggered as streams that arrived at different times are, 24 streams on the schedule (1, 2, 4, 8) cut three
    8-frame chunks on every step (in step, 24 on one step of eight and none on the others), and each call is
    timed on every step."""
    out = tmp_path / "host-loop.json"
    bench_host_loop.main(["--rows", "24", "--steps", "40", "--warmup", "16", "--out", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["rows"] == 24 and result["steps"] == 40
    assert result["chunks_per_step_range"] == [3, 3]
    assert set(result["us"]) == {"runnable", "on_launched", "on_frame", "deliver"}
    assert all(0 < t["p50"] <= t["p95"] for t in result["us"].values())
