"""One-token prompt pieces after a cached voice prefix run as the Triton decode step in the staging cache
(`ModelRunner.staged_prefill`) and give the codes of a whole-prompt prefill on the PyTorch layers."""

from __future__ import annotations

import pytest

from qwen3tts_agent import SamplingParams, Voice
from qwen3tts_agent.engine.runner import TRITON_PATH
from qwen3tts_agent.kernels import common, gemv
from tests.engine_helpers import engine_for

FRAMES = 3
SMALL = dict(max_streams=2, max_seq_len=128)  # the interpreter copies every tensor a launch touches


@pytest.fixture(autouse=True)
def few_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in test_engine_kernels.py: wide GEMV tiles, no K splits (the interpreter pays per program)."""
    monkeypatch.setattr(gemv, "FP32_BLOCK_K", 1024)
    monkeypatch.setattr(gemv, "gemv_tiles", lambda *args: gemv.GemvTiles(block_n=256, block_k=1024))
    monkeypatch.setattr(common, "INTERPRETED_SM_COUNT", 1)


def test_staged_prefill_matches_a_full_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: dict[bool, list[list[list[int]]]] = {}
    staged_rows = []
    for cached in (True, False):
        engine = engine_for("synthetic:tiny-customvoice", prefix_cache=cached, **SMALL)
        runner = engine.core.runner
        staged = runner.staged_prefill
        monkeypatch.setattr(runner, "staged_prefill", lambda rows, staged=staged: (staged_rows.append(len(rows)), staged(rows)))
        try:
            assert runner.kernel_paths["talker"] == TRITON_PATH
            voice = Voice(speaker=engine.speakers[0])
            runs[cached] = [
                engine.synthesize_blocking(text, voice=voice, sampling=SamplingParams(seed=seed, max_frames=FRAMES))[1].codes
                for seed, text in enumerate(["Hello there.", "A second one.", "Hello there."])
            ]
        finally:
            engine.close()
        assert (runner.stage_rows > 0) == cached
    assert staged_rows == [1, 1], "the streams after the first copied the prefix and staged their one token"
    assert all(len(codes) == FRAMES for codes in runs[True])
    assert runs[True] == runs[False]
