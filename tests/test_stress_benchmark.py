"""`benchmarks/engine/stress.py`: open-loop mixed streams through the engine in-process (the GPU fault hunt's
harness, runnable under compute-sanitizer), here on the CPU with the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.engine import stress


def test_the_stress_run_accounts_for_every_stream_it_opened(tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    code = stress.main([
        "--model", "synthetic:tiny-customvoice", "--device", "cpu", "--rate", "6", "--duration", "3",
        "--frames", "8", "--max-streams", "4", "--chunk-schedule", "1,1,2,4,8", "--cancel-share", "0.4",
        "--streamed-share", "0.5", "--no-shed", "--no-graphs", "--out", str(out),
    ])
    report = json.loads(out.read_text())
    assert code == 0 and report["ok"], report
    assert report["opened"] > 5 and report["refused_busy"] == 0  # a CPU engine queues rather than refuses
    assert sum(report["finished"].values()) == report["opened"] and not report["errors"] and report["hung"] == 0
    assert report["finished"].get("cancelled", 0) > 0 and report["finished"].get("max_frames", 0) > 0
    assert len([ms for ms in report["first_audio_ms"].values() if ms is not None]) == 2
    assert report["engine"]["frames_generated"] >= 8 * report["finished"]["max_frames"]
