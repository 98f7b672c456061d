"""The Triton decode-layer kernels against `FusedDecoderLayer.__call__`, under the Triton interpreter on CPU.

The interpreter has to be switched on before the kernels are decorated, and other tests in the same pytest
process may already have imported the engine (and with it the kernels), so the checks run in a fresh
subprocess: this file, run as a script with TRITON_INTERPRET=1, executes every case and prints the errors as
JSON; the tests below assert on them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

MARKER = "KERNEL-RESULTS "
MAX_LEN = 256  # cache length is MAX_LEN + 1: the spare column inactive rows write to

TINY = {"hidden": 48, "heads": 6, "kv_heads": 2, "head_dim": 16, "ffn": 80}  # widths off the tile sizes, GQA group 3
REAL = {"hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "ffn": 3072}
# The interpreter pays per program and per op, so the real-width cases use wider tiles and fewer "SMs" than
# the GPU defaults (the tiny cases use the GPU defaults); the kernels are the same, split paths included.
REAL_PATCH = {"BLOCK_N": 64, "BLOCK_K_ELEMS": {2: 2048, 4: 1024}, "_sm_count": 16}


def _case(shape: str, dtype: str, b: int, read_len: int, masked: bool) -> dict[str, Any]:
    return {"shape": shape, "dtype": dtype, "b": b, "read_len": read_len, "masked": masked}


CASES = (
    [_case("tiny", "float32", b, n, True) for b in (1, 3, 8) for n in (1, 37, 200)]
    + [_case("tiny", "float32", b, n, False) for b, n in ((1, 200), (3, 37), (8, 200))]
    + [_case("tiny", "bfloat16", b, n, m) for b, n, m in ((1, 37, True), (3, 200, True), (8, 200, False))]
    + [_case("real", "float32", 3, 200, True), _case("real", "bfloat16", 8, 37, False)]
)
# max |error| / max |reference|. The interpreter truncates fp32 -> bf16 casts (a GPU rounds to nearest even),
# so its bf16 errors run about twice those on a GPU.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _case_id(case: dict[str, Any]) -> str:
    return "{shape}-{dtype}-b{b}-len{read_len}-{mask}".format(**case, mask="mask" if case["masked"] else "nomask")


# ------------------------------------------------------------------------------------ child process (interpreter)


def _build_layer(shape: dict[str, int], dtype: Any) -> Any:
    """An official decoder layer with random weights and norm gains, as `FusedDecoderLayer`."""
    import torch

    from qwen3tts_agent.engine.layers import FusedDecoderLayer
    from qwen3tts_agent.models.compat import import_qwen_tts

    import_qwen_tts()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerCodePredictorConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSDecoderLayer

    config = Qwen3TTSTalkerCodePredictorConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["ffn"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], num_hidden_layers=1,
    )
    layer = Qwen3TTSDecoderLayer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:  # RMSNorm gains start at 1; random ones check that each is applied
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return FusedDecoderLayer(layer.to(dtype))


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    from qwen3tts_agent.engine import kernels
    from qwen3tts_agent.engine.layers import rope_tables

    shape = TINY if case["shape"] == "tiny" else REAL
    dtype = getattr(torch, case["dtype"])
    b, read_len, masked = case["b"], case["read_len"], case["masked"]
    torch.manual_seed(b * 1000 + read_len)
    layer = _build_layer(shape, dtype)
    kv_heads, d = shape["kv_heads"], shape["head_dim"]
    cache_k = torch.randn(b + 1, kv_heads, MAX_LEN + 1, d).to(dtype)  # one slot more than rows: must stay
    cache_v = torch.randn_like(cache_k)
    x = (2 * torch.randn(b, 1, shape["hidden"])).to(dtype)
    write_pos = torch.randint(0, read_len, (b, 1))
    write_pos[0] = read_len - 1  # the newest key is the last one read
    if b > 1:
        write_pos[-1] = MAX_LEN  # an inactive row: writes the spare column, attends every key below read_len
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(inv_freq, write_pos, dtype)
    mask = (torch.arange(read_len) <= write_pos).view(b, 1, 1, read_len) if masked else None
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    with torch.no_grad():
        ref = layer(x, cos, sin, ref_k, ref_v, torch.arange(b)[:, None], write_pos, slice(0, b), read_len, mask)

    patch = REAL_PATCH if case["shape"] == "real" else {}
    saved = {name: getattr(kernels, name) for name in patch}
    for name, value in patch.items():
        setattr(kernels, name, (lambda device, n=value: n) if name == "_sm_count" else value)
    try:
        assert kernels.available(torch.device("cpu"))
        out_k, out_v = cache_k.clone(), cache_v.clone()
        out = kernels.decode_layer(layer, x, cos, sin, out_k, out_v, write_pos, read_len, masked=masked)
        block_k = kernels._gemv_opts(x, shape["ffn"])["BLOCK_K"]
        gemv_splits = kernels._k_splits(shape["hidden"], shape["ffn"], block_k, x.device)[0]
        attn_splits = kernels._kv_splits(b * kv_heads, read_len, x.device)[0]
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)

    written = torch.zeros_like(cache_k, dtype=torch.bool)
    written[torch.arange(b), :, write_pos[:, 0]] = True

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max() / b.double().abs().max())

    return {
        "shape_ok": tuple(out.shape) == tuple(ref.shape) and out.dtype == ref.dtype,
        "out": err(out, ref),
        "k": err(out_k[written], ref_k[written]),
        "v": err(out_v[written], ref_v[written]),
        "rest_untouched": bool(torch.equal(out_k[~written], cache_k[~written]) and torch.equal(out_v[~written], cache_v[~written])),
        "written_changed": bool((out_k[written] != cache_k[written]).any()),
        "attn_splits": attn_splits,
        "gemv_splits": gemv_splits,
    }


def _run_engine() -> dict[str, Any]:
    """Two streams (one greedy, one sampled) on a tiny engine with the kernels, and again with PyTorch layers."""
    import torch

    from qwen3tts_agent import Engine, SamplingParams, Voice
    from qwen3tts_agent.models.loading import load_official_model

    official = load_official_model("synthetic:tiny-customvoice", device="cpu", dtype=torch.float32, progress=False)
    speaker = sorted(official.get_supported_speakers())[0]
    runs = {}
    for fused in (True, False):
        engine = Engine(official, max_streams=2, keep_codes=True, fused_kernels=fused)  # type: ignore[arg-type]
        try:
            streams = [
                engine.open_stream("Hello there.", voice=Voice(speaker=speaker), sampling=SamplingParams.greedy(max_frames=4)),
                engine.open_stream("A second voice.", voice=Voice(speaker=speaker), sampling=SamplingParams(seed=5, max_frames=4)),
            ]
            for stream in streams:
                list(stream.chunks(timeout=600))
            runs["kernels" if fused else "torch"] = {"used": engine._runner.fused_kernels, "codes": [s.result.codes for s in streams]}
        finally:
            engine.close()
    return runs


# ------------------------------------------------------------------------------------------------ pytest side


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    # triton is a dev dependency: its absence is a failure, not a skip
    assert importlib.util.find_spec("triton") is not None, "triton is not installed (pip install -e '.[dev]')"
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=900
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, f"kernel checks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len(MARKER) :])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_layer_matches_torch_path(results: dict[str, dict[str, Any]], case: dict[str, Any]) -> None:
    r = results[_case_id(case)]
    tol = TOLERANCE[case["dtype"]]
    assert r["shape_ok"]
    assert r["out"] <= tol, r
    assert r["k"] <= tol and r["v"] <= tol, r
    assert r["rest_untouched"], "only the written cache columns may change"
    assert r["written_changed"], "the new keys were not written"


def test_engine_with_kernels_matches_torch_layers(results: dict[str, dict[str, Any]]) -> None:
    """The runner's use of the kernels (talker masked, predictor unmasked, batched rows) gives the same codes."""
    engine = results["engine"]
    assert engine["kernels"]["used"] and not engine["torch"]["used"]
    assert all(len(codes) == 4 for codes in engine["kernels"]["codes"])
    assert engine["kernels"]["codes"] == engine["torch"]["codes"]


def test_cases_cover_single_and_split_paths(results: dict[str, dict[str, Any]]) -> None:
    attn = {results[_case_id(c)]["attn_splits"] > 1 for c in CASES}
    gemv = {results[_case_id(c)]["gemv_splits"] > 1 for c in CASES}
    assert attn == {True, False} and gemv == {True, False}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    out = {}
    for case in CASES:
        started = time.perf_counter()
        out[_case_id(case)] = _run_case(case)
        print(f"{_case_id(case)} ({time.perf_counter() - started:.1f} s): {out[_case_id(case)]}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    out["engine"] = _run_engine()
    print(f"engine ({time.perf_counter() - started:.1f} s): {out['engine']}", file=sys.stderr, flush=True)
    print(MARKER + json.dumps(out), flush=True)
