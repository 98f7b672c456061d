"""The CPU backend (`qwen3tts_agent.backends`): exact in fp32, end to end in int8 and int4, conversion cached.

Parity: with fp32 weights the ONNX Runtime graphs give the official package's codes and audio on the tiny
synthetic models of every type, through the real Engine. The int8 format changes the numbers (random
weights cannot say whether for better or worse), so its tests check that the engine's features work on it;
its agreement with fp32 is a benchmark output (benchmarks/cpu/bench_cpu.py).
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
import torch

from qwen3tts_agent import SamplingParams, TextLayout, Voice
from qwen3tts_agent.backends import create_codec, create_runner, resolve_backend
from qwen3tts_agent.backends.cpu import draws
from qwen3tts_agent.backends.cpu.codec import CpuCodecDecoder
from qwen3tts_agent.backends.cpu.runner import CpuRunner
from qwen3tts_agent.backends.cpu.store import conversion_folder, prepare
from qwen3tts_agent.engine.runner import ModelRunner, PrefillRow
from qwen3tts_agent.engine.runner.sampling import gumbel_noise_at, uniform_noise
from tests.engine.audio.test_codec_streaming import tiny_decoder
from tests.engine_helpers import (
    REF_TEXT,
    TEXT,
    engine_for,
    official_model,
    recorded_decode_codes,
    reference_audio,
)

FRAMES = 24
GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1)


def _ours(engine, voice: Voice, layout: TextLayout, language: str = "english") -> tuple[np.ndarray, torch.Tensor]:
    stream = engine.open_stream(
        TEXT, voice=voice, language=language, text_layout=layout,
        sampling=SamplingParams.greedy(max_frames=FRAMES), chunk_schedule=(1, 2, 4, 8),
    )
    chunks = list(stream.chunks(timeout=120))
    return np.concatenate([c.pcm for c in chunks]), torch.tensor(stream.result.codes)


def _assert_same_audio(ours: np.ndarray, official: np.ndarray) -> None:
    assert 0 <= len(official) - len(ours) <= 1, (len(ours), len(official))
    np.testing.assert_allclose(ours, official[len(official) - len(ours):], atol=1e-4, rtol=0)
    assert np.abs(ours).max() > 1e-3, "audio is silent"


# ----------------------------------------------------------------- fp32: exact against the official package
@pytest.mark.parametrize("layout", [TextLayout.INTERLEAVED, TextLayout.PREFILL])
@pytest.mark.parametrize("icl", [True, False], ids=["icl", "xvector"])
def test_fp32_voice_clone_matches_official(layout: TextLayout, icl: bool) -> None:
    official = official_model("synthetic:tiny")
    ref = reference_audio()
    items = official.create_voice_clone_prompt(ref_audio=ref, ref_text=REF_TEXT if icl else None, x_vector_only_mode=not icl)
    with recorded_decode_codes(official) as seen:
        wavs, _ = official.generate_voice_clone(
            TEXT, language="english", voice_clone_prompt=items, non_streaming_mode=layout is TextLayout.PREFILL, **GREEDY
        )
    official_codes = seen[0][items[0].ref_code.shape[0]:] if icl else seen[0]
    engine = engine_for("synthetic:tiny", backend="fp32")
    try:
        assert isinstance(engine.core.runner, CpuRunner) and isinstance(engine.core.audio.codec, CpuCodecDecoder)
        voice = engine.create_voice(ref, REF_TEXT if icl else None, x_vector_only=not icl)
        pcm, codes = _ours(engine, Voice(prompt=voice), layout)
    finally:
        engine.close()
    assert torch.equal(codes, official_codes.cpu()), "codes differ from the official generation"
    _assert_same_audio(pcm, wavs[0])


@pytest.mark.parametrize("layout", [TextLayout.INTERLEAVED, TextLayout.PREFILL])
def test_fp32_custom_voice_matches_official(layout: TextLayout) -> None:
    official = official_model("synthetic:tiny-customvoice")
    speaker = sorted(official.get_supported_speakers())[0]
    with recorded_decode_codes(official) as seen:
        wavs, _ = official.generate_custom_voice(
            TEXT, speaker=speaker, language="english", non_streaming_mode=layout is TextLayout.PREFILL, **GREEDY
        )
    engine = engine_for("synthetic:tiny-customvoice", backend="fp32")
    try:
        pcm, codes = _ours(engine, Voice(speaker=speaker), layout)
    finally:
        engine.close()
    assert torch.equal(codes, seen[0].cpu())
    _assert_same_audio(pcm, wavs[0])


def test_fp32_voice_design_matches_official() -> None:
    official = official_model("synthetic:tiny-voicedesign")
    instruct = "A warm, low voice speaking slowly."
    with recorded_decode_codes(official) as seen:
        wavs, _ = official.generate_voice_design(TEXT, instruct=instruct, language="auto", non_streaming_mode=False, **GREEDY)
    engine = engine_for("synthetic:tiny-voicedesign", backend="fp32")
    try:
        pcm, codes = _ours(engine, Voice(instruct=instruct), TextLayout.INTERLEAVED, language="auto")
    finally:
        engine.close()
    assert torch.equal(codes, seen[0].cpu())
    _assert_same_audio(pcm, wavs[0])


def test_fp32_batched_streams_match_single_streams() -> None:
    """Streams that join a running batch (rows inactive meanwhile, slots at different positions) decode as alone."""
    engine = engine_for("synthetic:tiny", max_streams=4, backend="fp32")
    sampling = SamplingParams(seed=7, max_frames=16)
    try:
        voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
        texts = [TEXT, "A second, shorter sentence.", "Third one joins late and speaks for a while."]
        alone = [engine.synthesize_blocking(text, voice=voice, sampling=sampling) for text in texts]
        first = engine.open_stream(texts[0], voice=voice, sampling=sampling)
        first_chunks = first.chunks(timeout=120)
        head = next(first_chunks)
        others = [engine.open_stream(t, voice=voice, sampling=sampling) for t in texts[1:]]
        together = [np.concatenate([head.pcm] + [c.pcm for c in first_chunks])]
        together += [np.concatenate([c.pcm for c in s.chunks(timeout=120)]) for s in others]
        results = [first.result, *(s.result for s in others)]
    finally:
        engine.close()
    for (pcm_alone, result_alone), pcm, result in zip(alone, together, results, strict=True):
        assert result.codes == result_alone.codes
        np.testing.assert_allclose(pcm, pcm_alone, atol=1e-5)


# ----------------------------------------------------------------- the draws between the graph calls
class _RecordedRunner(CpuRunner):
    """The frame as `CpuRunner` ran it before `backends.cpu.draws`: the same graph calls, then `ModelRunner`'s
    own bookkeeping and `engine.runner.sampling.sample` (the reference the fewer ops must equal, bit for bit)."""

    def predict_codes(self, b: int, sampling: bool = True) -> None:
        for code in range(1, self.num_groups):
            self._predictor.run(self._predictor_binding(b, code))
            hidden = self._p_out[2 if code == 1 else 1][:b, -1]
            self._record_code(self._logits(hidden, self.p_norm, self.p_heads[code - 1], False), code, b, sampling)
            self._code_embeds[code - 1, :b] = self.p_step_input[:b]  # where the next step's graph reads its input

    def talker_step(self, b: int, kv_len: int, sampling: bool = True) -> None:
        self._t_seqlens[:b].copy_(self.pos[:b])
        self._talker.run(self._talker_binding(b))
        hidden = self._t_out[:b, 0]
        logits = self._logits(hidden, self.norm, self.codec_head, False)
        self._record_code0(logits, self._arange_slots[:b], self.active[:b], hidden, frame=True, sampling=sampling)


# Rows in the order that lets a batch of the first b rows be: all sampling with no cut below the candidate cap
# (b=1), with a top-k cut (2), with a greedy row (3), with top-p (4), with an inactive row (5).
DRAW_SLOTS = [
    dict(seed=2**40 + 3, top_k=64, subtalker_top_k=64, temperature=0.7),  # the seed's high word matters too
    dict(seed=11),  # the official defaults: top-k 50, temperature 0.9, repetition penalty 1.05
    dict(do_sample=False, subtalker_do_sample=False),
    dict(seed=-7, top_p=0.8, top_k=5, subtalker_top_p=0.7, subtalker_temperature=1.3, repetition_penalty=1.3),
    dict(seed=5),
]
DRAW_DEFAULTS = dict(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, subtalker_do_sample=True,
                     subtalker_temperature=0.9, subtalker_top_k=50, subtalker_top_p=1.0, seed=0, ignore_eos=False)
DRAW_STATE = ("frame_out", "code0", "p_input", "p_step_input", "embed_sum", "talker_input", "write_pos", "seen", "pos",
              "n_sampled", "step_idx", "kv_cache")


@pytest.mark.parametrize("fmt", ["int8", "fp32"])
def test_frame_draws_equal_the_sampling_they_replace(fmt: str) -> None:
    """`CpuRunner`'s frame (the draws of `backends.cpu.draws`, the bookkeeping on slices) leaves exactly the
    state of the graph calls followed by `ModelRunner`'s own sampling and bookkeeping: every code and every
    per-slot tensor, frame after frame, for greedy, sampled, top-k, top-p and mixed batches, an inactive row,
    and the engine's all-greedy shortcut (sampling flags False)."""
    model = official_model("synthetic:tiny").model
    folder = prepare(model, fmt, progress=False)
    kwargs = dict(max_slots=len(DRAW_SLOTS), max_seq_len=64, max_text_tokens=64)
    runners = [cls(model, folder, fmt, **kwargs) for cls in (CpuRunner, _RecordedRunner)]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randn(len(DRAW_SLOTS), 6, runners[0].hidden_size, generator=gen) * 0.1
    # (rows stepped, rows active, sampling flags): the batch grows, the last row stays inactive, rows leave
    schedule = [(b, min(b, 4), True) for b in (1, 2, 3, 4, 5, 5)] + [(3, 2, True), (5, 1, True), (3, 0, True)]
    schedule += [(5, 4, True)] * 3
    with torch.inference_mode():
        for runner in runners:
            for slot, overrides in enumerate(DRAW_SLOTS):
                runner.reset_slot(slot, {**DRAW_DEFAULTS, **overrides})
                runner.append_text(slot, 0, [151671 + slot, 151672, 151673])
            runner.prefill([PrefillRow(slot, 0, prompt[slot], sample=True) for slot in range(len(DRAW_SLOTS))])
        for frame, (b, active, sampling) in enumerate(schedule):
            for runner in runners:
                runner.active.zero_()
                runner.active[:active] = True
                runner.frame_step(b, 64, talker_sampling=sampling, predictor_sampling=sampling)
            for name in DRAW_STATE:
                assert torch.equal(getattr(runners[0], name), getattr(runners[1], name)), f"{name} differs in frame {frame}"
        # the all-greedy shortcut: a batch of the greedy row alone, flags as the engine sets them
        for runner in runners:
            runner.reset_slot(0, {**DRAW_DEFAULTS, "do_sample": False, "subtalker_do_sample": False})
            runner.active[:1] = True
        for sampling in (False, True):
            for runner in runners:
                runner.frame_step(1, 64, talker_sampling=sampling, predictor_sampling=sampling)
            for name in DRAW_STATE:
                assert torch.equal(getattr(runners[0], name), getattr(runners[1], name)), f"{name} differs (greedy)"
    codes = runners[0].frame_out[:4, :16]
    assert len({tuple(row) for row in codes.tolist()}) == 4, "rows drew the same codes"


def test_noise_tables_equal_the_hash_they_batch() -> None:
    """`draws.uniform_table` (NumPy's uint32 hash of a frame's every counter and token id) gives exactly
    `sampling.uniform_noise`'s values, for negative seeds and counters and seeds past 32 bits; and
    `draws.gumbel_table`, gathered at candidates, `gumbel_noise_at`'s, however many candidates a row has."""
    gen = torch.Generator().manual_seed(1)
    seed = torch.tensor([0, -1, -7, 2**40 + 3, 2**63 - 1, -(2**63), *torch.randint(-(2**62), 2**62, (4,), generator=gen)])
    counter = torch.randint(-40, 2**31, (seed.shape[0], 16), generator=gen)
    counter[0] = torch.arange(-8, 8)
    for vocab in (2048, 3072, 5):
        ids_hash = draws.index_hash(vocab)
        assert torch.equal(draws.uniform_table(ids_hash, seed, counter), uniform_noise(seed, counter, vocab))
    table = draws.gumbel_table(draws.index_hash(3072), seed, counter)
    for k in (64, 50, 7, 1):
        ids = torch.randint(0, 3072, (seed.shape[0], k), generator=gen)
        for j in (0, 5, 15):
            assert torch.equal(table[:, j].gather(1, ids), gumbel_noise_at(seed, counter[:, j], ids))


# ----------------------------------------------------------------- int8: the engine's features run on it
def test_int8_engine_streams_text_batches_and_cancels() -> None:
    engine = engine_for("synthetic:tiny", max_streams=4, backend="auto")  # on a CPU: int8
    try:
        assert isinstance(engine.core.runner, CpuRunner) and engine.core.runner.weight_format == "int8"
        voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
        sampling = SamplingParams(seed=3, max_frames=20)
        # streaming text, word by word, next to a whole-text stream and one that is cancelled
        pushed = engine.open_stream(voice=voice, sampling=sampling, chunk_schedule=(1, 2, 4))
        whole = engine.open_stream(TEXT, voice=voice, sampling=sampling)
        doomed = engine.open_stream(TEXT, voice=voice, sampling=SamplingParams(seed=4, max_frames=2000, ignore_eos=True))
        for word in TEXT.split(" "):
            pushed.push_text(word + " ")
        pushed.close_input()
        next(doomed.chunks(timeout=60))
        doomed.cancel()
        outputs = {}
        for name, stream in (("pushed", pushed), ("whole", whole)):
            chunks = list(stream.chunks(timeout=120))
            assert chunks[-1].is_last and [c.frame_start for c in chunks] == [0] + [c.frame_end for c in chunks[:-1]]
            outputs[name] = np.concatenate([c.pcm for c in chunks])
            assert stream.result.finish_reason in ("eos", "max_frames")
            assert np.abs(outputs[name]).max() > 1e-3 and np.isfinite(outputs[name]).all()
        assert doomed.result.finish_reason == "cancelled"
        # the same request alone gives the same codes: batching does not leak between rows
        alone, result = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
        assert result.codes == whole.result.codes
        np.testing.assert_allclose(alone, outputs["whole"], atol=1e-5)
        assert engine.stats().active_streams == 0
    finally:
        engine.close()


_POOL_RUN = """
import json, sys, torch
torch.set_num_threads(4)  # three graph threads beside the codec's: a pool with threads to share
from qwen3tts_agent import SamplingParams, Voice
from tests.engine_helpers import REF_TEXT, TEXT, engine_for, reference_audio
engine = engine_for("synthetic:tiny", max_streams=2, backend="int8")
runner = engine.core.runner
voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
codes = [engine.synthesize_blocking(TEXT, voice=voice, sampling=SamplingParams(seed=s, max_frames=16))[1].codes
         for s in (1, 2)]
engine.close()
print(json.dumps({"shared": runner.shared_pool, "threads": runner.threads, "codes": codes}))
"""


def test_int8_on_the_shared_pool_gives_the_codes_of_a_pool_per_graph() -> None:
    """QWEN3TTS_CPU_POOL=shared puts every graph on ONNX Runtime's one process-wide pool (a process each, as
    that pool cannot be undone): the same requests give the same codes as with a pool per graph."""
    import json
    import os
    import subprocess
    import sys

    runs = {}
    for pool in ("session", "shared"):
        env = {**os.environ, "QWEN3TTS_CPU_POOL": pool}
        out = subprocess.run([sys.executable, "-c", _POOL_RUN], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[pool] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["session"]["shared"] is False and runs["shared"]["shared"] is True
    assert runs["shared"]["threads"] == runs["session"]["threads"] > 1
    assert runs["shared"]["codes"] == runs["session"]["codes"]
    assert runs["shared"]["codes"][0] != runs["shared"]["codes"][1]  # two seeds: the codes say something


# ----------------------------------------------------------------- int4 (opt-in): 4-bit weights
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_projections_read_the_rounded_weights(bits: int) -> None:
    """A MatMulNBits projection gives x @ Wq.T, Wq the weight rounded to `bits`-bit blocks of 128 (within
    the int8 activations' rounding): the packing is MatMulNBits' own, and int4 really is 4-bit."""
    import onnxruntime as ort

    from qwen3tts_agent.backends.cpu.graphs import linear_graph

    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    session = ort.InferenceSession(
        linear_graph(weight, f"int{bits}").SerializeToString(), providers=["CPUExecutionProvider"]
    )
    y = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
    levels = 2 ** (bits - 1) - 1
    blocks = weight.reshape(64, 2, 128)
    scales = blocks.abs().amax(dim=-1, keepdim=True) / levels
    rounded = (torch.round(blocks / scales).clamp(-levels, levels) * scales).reshape(64, 256)
    scale = (x @ weight.T).abs().max()
    assert (y - x @ rounded.T).abs().max() < 0.02 * scale
    if bits == 4:  # 4-bit rounding moves the result well beyond the activations' rounding
        assert (y - x @ weight.T).abs().max() > 0.05 * scale


def test_int4_engine_streams_batches_and_repeats_itself() -> None:
    engine = engine_for("synthetic:tiny", max_streams=2, backend="int4")
    try:
        assert isinstance(engine.core.runner, CpuRunner) and engine.core.runner.weight_format == "int4"
        voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
        sampling = SamplingParams(seed=3, max_frames=20)
        streams = [engine.open_stream(TEXT, voice=voice, sampling=sampling) for _ in range(2)]
        audio = [np.concatenate([c.pcm for c in s.chunks(timeout=120)]) for s in streams]
        alone, result = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling)
    finally:
        engine.close()
    assert streams[0].result.codes == streams[1].result.codes == result.codes
    for pcm in audio:
        np.testing.assert_allclose(pcm, alone, atol=1e-5)
    assert np.abs(alone).max() > 1e-3 and np.isfinite(alone).all()


# ----------------------------------------------------------------- the codec's GEMM convolutions
@pytest.mark.parametrize(("gemm_max_steps", "dtype"), [(0, None), (64, None), (100_000, None), (64, torch.bfloat16)],
                         ids=["direct", "default", "all-gemm", "bfloat16"])
def test_cpu_codec_equals_the_full_decode(gemm_max_steps: int, dtype: torch.dtype | None) -> None:
    decoder = tiny_decoder()
    codes = torch.randint(0, 2048, (2, 40, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = decoder(codes.transpose(1, 2)).squeeze(1)
    codec = CpuCodecDecoder(decoder, max_streams=3, gemm_max_steps=gemm_max_steps, compute_dtype=dtype)
    assert next(decoder.parameters()).dtype == torch.float32  # a bfloat16 codec decodes from its own copy
    codec.prime(2, codes[1, :10])
    chunks, start = [], 0
    for size in (1, 2, 4, 8, 8, 7):
        chunks.append(codec.decode([0, 2], torch.stack([codes[0, start : start + size], codes[1, 10 + start : 10 + start + size]])))
        start += size
    audio = torch.cat(chunks, dim=-1).float()
    expected = torch.stack([reference[0, : start * 1920], reference[1, 10 * 1920 : (10 + start) * 1920]])
    if dtype is None:
        assert (audio - expected).abs().max().item() < 1e-5
    else:  # bfloat16 keeps about 3 significant digits: close, not exact
        assert (audio - expected).pow(2).mean().sqrt() < 0.1 * expected.pow(2).mean().sqrt()


# ----------------------------------------------------------------- factory and conversion cache
def test_backend_resolution() -> None:
    assert resolve_backend("auto", "cpu") == "int8"
    assert resolve_backend("auto", "cuda") == "torch"
    assert resolve_backend("fp32", "cpu") == "fp32"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("int2", "cpu")
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_backend("int8", "cuda:0")
    model = official_model("synthetic:tiny").model
    runner = create_runner(model, "torch", max_slots=1, max_seq_len=64, max_text_tokens=64)
    assert type(runner) is ModelRunner
    assert type(create_codec(model.speech_tokenizer.model.decoder, "int8", max_streams=1)) is CpuCodecDecoder


def test_conversion_is_cached_per_format(tmp_path) -> None:
    model = official_model("synthetic:tiny").model
    folders = {fmt: conversion_folder(model, fmt, tmp_path) for fmt in ("int8", "fp32")}
    assert folders["int8"] != folders["fp32"] and all(f is not None and not f.exists() for f in folders.values())
    built = prepare(model, "int8", cache_root=tmp_path, progress=False)
    assert built == folders["int8"] and (built / "talker.onnx").is_file() and len(list(built.glob("head_*.onnx"))) == 15
    # opset 17's IR, not the onnx package's newest: the H200 image's older onnxruntime refused IR 14 files
    assert {onnx.load(str(f), load_external_data=False).ir_version for f in built.glob("*.onnx")} == {8}
    stamp = (built / "talker.onnx").stat().st_mtime_ns
    started = time.perf_counter()
    assert prepare(model, "int8", cache_root=tmp_path, progress=False) == built
    assert (built / "talker.onnx").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert time.perf_counter() - started < 1.0
    assert not list(tmp_path.glob(".*-building-*"))


def test_prompt_in_pieces_equals_one_piece(monkeypatch) -> None:
    """A prompt longer than PREFILL_CHUNK continues the slot's cache piece by piece, as if in one call."""
    from qwen3tts_agent.backends.cpu import runner as cpu_runner

    model = official_model("synthetic:tiny").model
    embeds = torch.randn(23, model.config.talker_config.hidden_size, generator=torch.Generator().manual_seed(5))
    states = []
    for chunk in (1000, 7):
        monkeypatch.setattr(cpu_runner, "PREFILL_CHUNK", chunk)
        runner = create_runner(model, "fp32", max_slots=2, max_seq_len=64, max_text_tokens=64)
        runner.reset_slot(1, dict(top_k=50, subtalker_top_k=50, seed=1, temperature=0.9, top_p=1.0, repetition_penalty=1.05,
                                  subtalker_temperature=0.9, subtalker_top_p=1.0, do_sample=False, subtalker_do_sample=False,
                                  ignore_eos=True))
        runner.prefill([PrefillRow(1, 0, embeds[:5], False)])  # a head piece, then the rest
        runner.prefill([PrefillRow(1, 5, embeds[5:], True)])
        states.append((runner.k_cache[0][1, :, :23].clone(), runner.p_input[1].clone(), int(runner.code0[1])))
    (k_one, p_one, code_one), (k_pieces, p_pieces, code_pieces) = states
    torch.testing.assert_close(k_pieces, k_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_pieces, p_one, atol=1e-5, rtol=1e-5)
    assert code_pieces == code_one


def test_prepare_command_converts_ahead_of_time(capsys) -> None:
    from qwen3tts_agent.cli import main

    assert main(["prepare", "--model", "synthetic:tiny", "--backend", "int8"]) == 0
    folder = conversion_folder(official_model("synthetic:tiny").model, "int8")
    assert folder is not None and (folder / "talker.onnx").is_file()
    assert str(folder) in capsys.readouterr().out
