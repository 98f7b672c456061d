"""The engine on the Triton kernels (interpreted) against the official generation and the PyTorch layers.

Checkpoints in shapes no released model has (`synthetic:odd*`: head_dim 24 and 40, GQA 5:1 and 3:1, a code
predictor as wide as the talker) run every stack on the kernels and give the official greedy codes for each
model type; `synthetic:widehead`'s predictor (head_dim 272) is one the kernels refuse, so it runs on the
PyTorch layers beside a Triton talker, said once in the log, and still gives the official codes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from qwen3tts_agent import SamplingParams, TextLayout, Voice
from qwen3tts_agent.engine.runner.kernel_paths import TRITON_PATH
from qwen3tts_agent.kernels import common, gemv
from tests.engine_helpers import TEXT, engine_for, official_model, recorded_decode_codes, reference_audio

FRAMES = 3
# The interpreter copies every tensor a launch touches to numpy and back: small caches and text tracks
SMALL = dict(max_streams=1, max_seq_len=128)
GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1)


@pytest.fixture(autouse=True)
def few_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide GEMV tiles and no K splits: the interpreter pays per program, and the kernel tests cover the
    GPU's tiles and splits; here what counts is how the engine uses the kernels."""
    monkeypatch.setattr(gemv, "FP32_BLOCK_K", 1024)
    monkeypatch.setattr(gemv, "gemv_tiles", lambda *args: gemv.GemvTiles(block_n=256, block_k=1024))
    monkeypatch.setattr(common, "INTERPRETED_SM_COUNT", 1)


def _official_greedy(spec: str) -> tuple[torch.Tensor, Voice]:
    """The official greedy codes of TEXT for the spec's model type, and the same voice for the engine."""
    official = official_model(spec)
    model_type = official.model.config.tts_model_type
    with recorded_decode_codes(official) as seen:
        if model_type == "base":
            items = official.create_voice_clone_prompt(ref_audio=reference_audio(), x_vector_only_mode=True)
            official.generate_voice_clone(TEXT, language="english", voice_clone_prompt=items, non_streaming_mode=False, **GREEDY)
            voice = None
        elif model_type == "custom_voice":
            speaker = sorted(official.get_supported_speakers())[0]
            official.generate_custom_voice(TEXT, speaker=speaker, language="english", non_streaming_mode=False, **GREEDY)
            voice = Voice(speaker=speaker)
        else:
            instruct = "A warm, low voice speaking slowly."
            official.generate_voice_design(TEXT, instruct=instruct, language="english", non_streaming_mode=False, **GREEDY)
            voice = Voice(instruct=instruct)
    return seen[0].cpu(), voice


def _engine_codes(spec: str, voice: Voice | None) -> tuple[torch.Tensor, dict[str, str]]:
    engine = engine_for(spec, **SMALL)
    try:
        if voice is None:
            voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
        stream = engine.open_stream(TEXT, voice=voice, language="english", text_layout=TextLayout.INTERLEAVED,
                                    sampling=SamplingParams.greedy(max_frames=FRAMES))
        list(stream.chunks(timeout=600))
        return torch.tensor(stream.result.codes), dict(engine.core.runner.kernel_paths)
    finally:
        engine.close()


@pytest.mark.parametrize("spec", ["synthetic:odd", "synthetic:odd-customvoice", "synthetic:odd-voicedesign"])
def test_odd_shapes_run_on_the_kernels_and_match_official(spec: str) -> None:
    official_codes, voice = _official_greedy(spec)
    codes, paths = _engine_codes(spec, voice)
    assert paths == {"talker": TRITON_PATH, "predictor": TRITON_PATH, "codec": TRITON_PATH}
    assert codes.shape == (FRAMES, 16)
    assert torch.equal(codes, official_codes), "codes differ from the official generation"


def test_a_stack_the_kernels_refuse_runs_on_pytorch_and_matches_official(caplog: pytest.LogCaptureFixture) -> None:
    official_codes, voice = _official_greedy("synthetic:widehead")
    with caplog.at_level(logging.WARNING, logger="qwen3tts_agent.engine.runner.kernel_paths"):
        codes, paths = _engine_codes("synthetic:widehead", voice)
    assert paths["talker"] == TRITON_PATH and paths["codec"] == TRITON_PATH
    assert paths["predictor"] == "pytorch (head_dim 272 above 256 not supported)"
    said = [r.getMessage() for r in caplog.records if r.name == "qwen3tts_agent.engine.runner.kernel_paths"]
    assert len(said) == 1 and "predictor: head_dim 272" in said[0], f"said once, with the reason: {said}"
    assert torch.equal(codes, official_codes)


def test_engine_with_kernels_matches_torch_layers() -> None:
    """Two streams (one greedy, one sampled: the fused sampling draws) on a tiny engine with the kernels, and
    again with the PyTorch layers; then the greedy one again with an EOS row that fires (synthetic
    checkpoints never end on their own), so the kernels' EOS flag ends the stream."""
    official = official_model("synthetic:tiny-customvoice")
    speaker = sorted(official.get_supported_speakers())[0]
    head = official.model.talker.codec_head.weight
    eos = official.model.config.talker_config.codec_eos_token_id
    saved = head.data[eos].clone()
    runs = {}
    for fused in (True, False):
        engine = engine_for("synthetic:tiny-customvoice", max_streams=2, max_seq_len=128, fused_kernels=fused)
        try:
            streams = [
                engine.open_stream("Hello there.", voice=Voice(speaker=speaker), sampling=SamplingParams.greedy(max_frames=4)),
                engine.open_stream("A second voice.", voice=Voice(speaker=speaker), sampling=SamplingParams(seed=5, max_frames=4)),
            ]
            for stream in streams:
                list(stream.chunks(timeout=600))
            head.data[eos] = 2 * head.data[streams[0].result.codes[2][0]]  # EOS outscores the code of frame 2
            ending = engine.open_stream("Hello there.", voice=Voice(speaker=speaker), sampling=SamplingParams.greedy(max_frames=6))
            list(ending.chunks(timeout=600))
            runs[fused] = {
                "paths": dict(engine.core.runner.kernel_paths), "codes": [s.result.codes for s in streams],
                "ending": (ending.result.finish_reason, ending.result.codes),
            }
        finally:
            head.data[eos] = saved
            engine.close()
    assert set(runs[True]["paths"].values()) == {TRITON_PATH}
    assert runs[False]["paths"]["talker"] == runs[False]["paths"]["predictor"] == "pytorch (fused kernels off)"
    assert all(len(codes) == 4 for codes in runs[True]["codes"])
    assert runs[True]["codes"] == runs[False]["codes"]
    reason, codes = runs[True]["ending"]
    assert reason == "eos" and 2 <= len(codes) < 6, "the kernels' EOS flag ends the stream"
    assert runs[True]["ending"] == runs[False]["ending"]
