"""One-token prompt pieces after a cached voice prefix run as the Triton decode step in the staging cache
(`StagingCache.prefill`; graphed on a GPU: `GraphedStagedPrefill`) and give the codes of a whole-prompt
prefill on the PyTorch layers, also while another stream's frames run beside them on the GPU."""

from __future__ import annotations

import pytest

from qwen3tts_agent import Engine, SamplingParams, Voice
from qwen3tts_agent.engine.runner.kernel_paths import TRITON_PATH
from qwen3tts_agent.kernels import common, gemv
from qwen3tts_agent.models.loading import load_official_model
from tests.engine_helpers import official_model

FRAMES = 3
SMALL = dict(max_streams=2, max_seq_len=128)  # the interpreter copies every tensor a launch touches
TEXTS = ["Hello there.", "A second one."]


@pytest.fixture(autouse=True)
def few_programs(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """As in test_engine_kernels.py: under the interpreter, wide GEMV tiles and no K splits (it pays per
    program); compiled, the GPU's own tiles."""
    if device == "cpu":
        monkeypatch.setattr(gemv, "FP32_BLOCK_K", 1024)
        monkeypatch.setattr(gemv, "gemv_tiles", lambda *args: gemv.GemvTiles(block_n=256, block_k=1024))
        monkeypatch.setattr(common, "INTERPRETED_SM_COUNT", 1)


def test_staged_prefill_matches_a_full_prefill(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # compiled, a released model's depth: the small checkpoints have two talker layers, as many as a cache's
    # keys-and-values pair, so a layer count taken from the wrong axis would pass on them
    spec = "synthetic:tiny-customvoice" if device == "cpu" else "synthetic:1.7b-customvoice"
    official = official_model(spec) if device == "cpu" else load_official_model(spec, device=device, progress=False)
    runs: dict[bool, list[list[list[int]]]] = {}
    staged_rows: list[int] = []
    for cached in (True, False):
        # under the interpreter the reference run takes the PyTorch layers (exact against the kernels in fp32:
        # test_engine_kernels.py), sparing the interpreter that run's frames; compiled, the kernels
        fused = cached or device == "cuda"
        engine = Engine(
            official, keep_codes=True, prefix_cache=cached, staged_prefill=cached, fused_kernels=fused,  # type: ignore[arg-type]
            backend="torch", **SMALL,
        )
        runner = engine.core.runner
        recorded = len(staged_rows)  # the cached run's, when the uncached one warms up (it has no staging cache)
        if runner.staging is not None:
            finish = runner.staging.finish  # the eager path and the graphs both end here
            monkeypatch.setattr(
                runner.staging, "finish", lambda rows, hidden, finish=finish: (staged_rows.append(len(rows)), finish(rows, hidden))
            )
        try:
            assert (runner.kernel_paths["talker"] == TRITON_PATH) == fused
            if device == "cuda":
                engine.warmup(progress=False)  # captures the graphs, the staged prefill's among them
                del staged_rows[recorded:]  # the capture's own calls
            voice = Voice(speaker=engine.speakers[1])  # not the warm-up's
            # The voice's first stream prefills its head (and stores it); it runs on beside the measured ones,
            # so on a GPU its frames overlap their prompts.
            beside = engine.open_stream(
                "Someone else is talking.", voice=voice,
                sampling=SamplingParams(seed=9, max_frames=40 if device == "cuda" else FRAMES + 1),
            )
            beside_chunks = beside.chunks(timeout=600)
            next(beside_chunks)
            runs[cached] = [
                engine.synthesize_blocking(text, voice=voice, sampling=SamplingParams(seed=seed, max_frames=FRAMES))[1].codes
                for seed, text in enumerate(TEXTS)
            ]
            list(beside_chunks)
        finally:
            engine.close()
        assert (runner.staging is not None) == cached
    assert staged_rows == [1] * len(TEXTS), "the streams after the first copied the prefix and staged their token"
    assert all(len(codes) == FRAMES for codes in runs[True])
    assert runs[True] == runs[False]
