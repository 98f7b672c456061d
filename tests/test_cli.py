"""The main job: `qwen3tts-agent say` streams to a WAV file and reports latency; unreachable models fail fast."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import soundfile as sf

from qwen3tts_agent.cli import main


def test_say_streams_a_wav_and_reports_latency(tmp_path, capsys) -> None:
    out = tmp_path / "hello.wav"
    code = main(["say", "Hello there, how can I help?", "--model", "synthetic:tiny", "--out", str(out),
                 "--max-frames", "9", "--seed", "1", "--stream-text"])
    assert code == 0
    audio, rate = sf.read(out)
    assert rate == 24000 and len(audio) == 9 * 1920 and abs(audio).max() > 1e-3
    printed = capsys.readouterr().out
    assert "first audio:" in printed and "real-time factor:" in printed


def test_say_with_a_named_speaker_and_language(tmp_path) -> None:
    out = tmp_path / "speaker.wav"
    assert main(["say", "Bonjour.", "--model", "synthetic:tiny-customvoice", "--speaker", "ryan",
                 "--language", "french", "--out", str(out), "--max-frames", "3", "--greedy"]) == 0
    assert sf.info(out).frames == 3 * 1920


def test_unreachable_default_model_fails_fast_with_alternatives(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: the hub id must be fetched
    started = time.monotonic()
    code = main(["say", "Hello.", "--out", str(tmp_path / "x.wav")])
    assert code == 2 and time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert "synthetic:tiny" in err and "folder" in err


def test_bad_input_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["say", "   ", "--model", "synthetic:tiny", "--out", str(tmp_path / "x.wav")]) == 2
    assert "text is empty" in capsys.readouterr().err


def test_demo_output_is_clean_off_a_terminal(tmp_path) -> None:
    """`make demo`'s command through pipes, without the SoX binary: our lines only, no notices, no bar redraws."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(root)}
    out = tmp_path / "hello.wav"
    run = subprocess.run(
        [sys.executable, "-m", "qwen3tts_agent.cli", "say", "Hello there, how can I help?",
         "--model", "synthetic:tiny", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "no --voice given", "synthetic model", f"wrote {out}", "first audio",
    ]


def test_serve_gives_a_gpu_engine_an_api_worker_per_four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen3tts_agent.server.cli import MAX_AUTO_WORKERS, api_workers

    for cores, expected in ((2, 1), (8, 2), (16, 4), (64, MAX_AUTO_WORKERS), (None, 1)):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        assert api_workers("auto", engine_core="process", device="auto") == expected
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert api_workers("auto", engine_core="process", device="cpu") == 1  # a CPU engine serves few streams
    assert api_workers("auto", engine_core="thread", device="cuda") == 1
    assert api_workers("3", engine_core="process", device="cuda") == 3
    for bad, core in (("0", "process"), ("2", "thread")):
        with pytest.raises(ValueError):
            api_workers(bad, engine_core=core, device="cuda")
    with pytest.raises(ValueError):
        api_workers("many", engine_core="process", device="cuda")


def test_serve_without_the_server_extra_says_how_to_install_it() -> None:
    """The CLI looks the server's packages up without importing them (`serve` imports them after starting
    its engine core); one missing still gets the install hint, not a traceback."""
    code = ("import sys; sys.modules['fastapi'] = None\n"  # as if not installed
            "from qwen3tts_agent.cli import main; raise SystemExit(main(['serve', '--model', 'synthetic:tiny']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "No module named 'fastapi'" in result.stderr and 'pip install "qwen3tts-agent[server]"' in result.stderr


def test_serve_passes_its_engine_scheduling_options_to_the_engine() -> None:
    """`--codec-hold-ms`, `--step-period-ms`, `--first-frame-step-load`, `--clock-first-frame-load`,
    `--shed-lateness-ms`, `--max-seq-len` and `--chunk-schedule` reach the Engine's keywords, in its units; a negative value or a malformed schedule is
    a clear error, and options left out keep the engine's defaults."""
    import argparse

    from qwen3tts_agent.server.cli import add_server_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)

    def options(*extra: str) -> dict[str, object]:
        return engine_options(parser.parse_args(["--model", "synthetic:tiny", *extra]), 16)

    assert options() == {"max_streams": 16, "backend": "auto"}
    assert options("--codec-hold-ms", "30", "--step-period-ms", "15", "--first-frame-step-load", "0",
                   "--clock-first-frame-load", "64", "--shed-lateness-ms", "20", "--max-seq-len", "512") == {
        "max_streams": 16, "backend": "auto", "codec_hold_s": 0.03, "step_period_s": 0.015, "first_frame_step_load": 0,
        "clock_first_frame_load": 64, "shed_lateness_s": 0.02, "max_seq_len": 512,
    }
    for flag in ("--codec-hold-ms", "--step-period-ms", "--first-frame-step-load", "--clock-first-frame-load",
                 "--shed-lateness-ms", "--max-seq-len"):
        with pytest.raises(ValueError, match=flag):
            options(flag, "-1")
    assert options("--chunk-schedule", "1,1,2,4,8")["chunk_schedule"] == (1, 1, 2, 4, 8)
    for bad in ("1,0", "1,x", "", "65", "1,1,1,1,1,1,1,1,1"):  # frames 1..64, 1 to 8 chunks
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "synthetic:tiny", "--chunk-schedule", bad])
