"""benchmarks/serving/turn_latency.py on the tiny models: every path runs (engine API, a Pipecat pipeline in TOKEN and
SENTENCE mode, the server's WebSocket) and the report holds what the benchmark claims to measure. Timings
on a shared CPU say nothing; the H200 figures come from `benchmarks/run_h200.sh OUT turn-latency`."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.serving import turn_latency

RATE = 100.0


def test_turn_latency_benchmark_runs_every_path(tmp_path: Path) -> None:
    out = tmp_path / "turn.json"
    report = turn_latency.main([
        "--models", "synthetic:tiny-customvoice,synthetic:tiny", "--device", "cpu", "--backend", "torch", "--quick",
        "--voices", "customvoice,xvector,icl-2s", "--out", str(out),
    ])
    assert json.loads(out.read_text()) == report
    rows = {(r["model"].split(":")[1], r["voice"], r["path"]): r for r in report["rows"]}
    expected = {
        (model, voice, path)
        for model, voices in (("tiny-customvoice", ("customvoice",)), ("tiny", ("xvector", "icl-2s")))
        for voice in voices
        for path in turn_latency.PATHS
    }
    assert set(rows) == expected
    for key, row in rows.items():
        assert row["error"] is None and row["runs"] == 1, (key, row)
        assert row["tokens_per_s"] == RATE and row["first_audio_ms"]["p50"] > 0
        # the engine's own result rides along where the engine's result is at hand
        assert (row["text_wait_ms_p50"] is None) == (key[2] == "ws"), key
    # the first frame of a TOKEN-mode stream waits for its second token (an x-vector clone) or for text
    # covering the reference's span (an in-context clone): the LLM's pacing sets the wait
    needed = report["voices"]["synthetic:tiny/icl-2s"]["needed_tokens"]
    assert needed > 10
    for path in ("engine", "pipecat-token"):
        icl_wait = rows[("tiny", "icl-2s", path)]["text_wait_ms_p50"]
        assert icl_wait >= 0.9 * 1000 * (needed - 1) / RATE, (path, icl_wait)
        assert rows[("tiny", "xvector", path)]["text_wait_ms_p50"] < icl_wait
    # a whole sentence is a closed text: no wait for more of it once it is there
    assert rows[("tiny", "icl-2s", "pipecat-sentence")]["text_wait_ms_p50"] < 50
