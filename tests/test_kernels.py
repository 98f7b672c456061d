"""The Triton decode-layer kernels against `FusedDecoderLayer.__call__`, under the Triton interpreter on CPU.

The interpreter has to be switched on before the kernels are decorated, and other tests in the same pytest
process may already have imported the engine (and with it the kernels), so the checks run in a fresh
subprocess: this file, run as a script with TRITON_INTERPRET=1, executes every case and prints the errors as
JSON; the tests below assert on them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.interpreted import report_results, run_interpreted, start_child

MAX_LEN = 256  # cache length is MAX_LEN + 1: the spare column inactive rows write to

TINY = {"hidden": 48, "heads": 6, "kv_heads": 2, "head_dim": 16, "ffn": 80}  # widths off the tile sizes, GQA group 3
REAL = {"hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "ffn": 3072}
# The interpreter pays per program and per op, so the real-width cases use wider tiles and fewer "SMs" than
# the GPU defaults (the tiny cases use the GPU defaults); the kernels are the same, split paths included.
REAL_TILES = {"block_n": 64, "block_k": 2048}
REAL_PATCH = {"FP32_BLOCK_K": 1024, "_sm_count": 16}


def _case(shape: str, dtype: str, b: int, read_len: int, masked: bool, t: int = 1) -> dict[str, Any]:
    return {"shape": shape, "dtype": dtype, "b": b, "read_len": read_len, "masked": masked, "t": t}


CASES = (
    [_case("tiny", "float32", b, n, True) for b in (1, 3, 8) for n in (1, 37, 200)]
    + [_case("tiny", "float32", b, n, False) for b, n in ((1, 200), (3, 37), (8, 200))]
    + [_case("tiny", "bfloat16", b, n, m) for b, n, m in ((1, 37, True), (3, 200, True), (8, 200, False))]
    + [_case("tiny", "float32", b, n, True) for b, n in ((20, 37), (70, 200))]  # 32-row tile; two 64-row tiles
    + [_case("real", "float32", 3, 200, True), _case("real", "bfloat16", 8, 37, False)]
    # two tokens per row: the predictor's first step (positions 0 and 1, causal), b * t rows up to 80
    # (cuBLAS); and masked, with a row's two consecutive positions anywhere below read_len
    + [_case("tiny", dt, b, 2, False, t=2) for dt in ("float32", "bfloat16") for b in (1, 3, 40)]
    + [_case("tiny", "float32", b, 200, True, t=2) for b in (3, 40)]
    + [_case("real", "bfloat16", 3, 2, False, t=2)]
)
# max |error| / max |reference|. The interpreter truncates fp32 -> bf16 casts (a GPU rounds to nearest even),
# so its bf16 errors run about twice those on a GPU.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _case_id(case: dict[str, Any]) -> str:
    mask, tokens = "mask" if case["masked"] else "nomask", f"-t{case['t']}" if case["t"] > 1 else ""
    return "{shape}-{dtype}-b{b}-len{read_len}-{mask}{tokens}".format(**case, mask=mask, tokens=tokens)


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
    b, t, read_len, masked = case["b"], case["t"], case["read_len"], case["masked"]
    torch.manual_seed(b * 1000 + read_len)
    layer = _build_layer(shape, dtype)
    kv_heads, d = shape["kv_heads"], shape["head_dim"]
    cache_k = torch.randn(b + 1, kv_heads, MAX_LEN + 1, d).to(dtype)  # one slot more than rows: must stay
    cache_v = torch.randn_like(cache_k)
    x = (2 * torch.randn(b, t, shape["hidden"])).to(dtype)
    write_pos = torch.randint(0, read_len - t + 1, (b, 1)) + torch.arange(t)  # a row's tokens: consecutive
    write_pos[0] = torch.arange(read_len - t, read_len)  # the newest key is the last one read
    if b > 1 and t == 1:
        write_pos[-1] = MAX_LEN  # an inactive row: writes the spare column, attends every key below read_len
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(inv_freq, torch.arange(MAX_LEN + 1), dtype)  # rows by position, spare column's too
    mask = (torch.arange(read_len) <= write_pos[..., None]).unsqueeze(1) if masked else None  # [b, 1, t, len]
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    with torch.no_grad():
        ref = layer(x, cos[write_pos], sin[write_pos], ref_k, ref_v, torch.arange(b)[:, None], write_pos, slice(0, b), read_len, mask)

    with _patched(kernels, case["shape"] == "real"):
        assert kernels.available(torch.device("cpu"))
        out_k, out_v = cache_k.clone(), cache_v.clone()
        out = kernels.decode_layer(layer, x, cos, sin, out_k, out_v, write_pos, read_len, masked=masked)
        tiles = kernels.gemv_tiles("residual", shape["hidden"], shape["ffn"], b * t)
        grid = kernels._gemv_grid(shape["hidden"], shape["ffn"], b * t, dtype, tiles, x.device)
        attn_splits = kernels._kv_splits(b * kv_heads, read_len, x.device)[0]

    written = torch.zeros_like(cache_k, dtype=torch.bool)
    written[torch.arange(b)[:, None], :, write_pos] = True

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
        "gemv_splits": grid["SPLITS"],
    }


@contextlib.contextmanager
def _patched(kernels: Any, real: bool) -> Iterator[None]:
    """Interpreter-sized tiles for the real-width cases (see REAL_TILES)."""
    if not real:
        yield
        return
    saved = {name: getattr(kernels, name) for name in (*REAL_PATCH, "gemv_tiles")}
    kernels.FP32_BLOCK_K = REAL_PATCH["FP32_BLOCK_K"]
    kernels._sm_count = lambda device: REAL_PATCH["_sm_count"]
    kernels.gemv_tiles = lambda *args: kernels.GemvTiles(**REAL_TILES)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)


GEMV_CASES = [
    # (name, rows, n_out, k_dim, flavour, dtype, tiles): flavours as the decode layer and the heads use them
    ("norm-b1", 1, 40, 48, "norm", "float32", None),
    ("norm-b5-split", 5, 40, 200, "norm", "float32", {"block_n": 16, "block_k": 32, "programs_per_sm": 8}),
    ("gated-b3", 3, 24, 48, "gated", "float32", None),
    ("gated-b9-split", 9, 24, 200, "gated", "bfloat16", {"block_n": 16, "block_k": 32, "programs_per_sm": 8}),
    ("residual-b2-split", 2, 48, 80, "residual", "float32", {"block_n": 16, "block_k": 16, "programs_per_sm": 8}),
    ("residual-b40", 40, 48, 80, "residual", "bfloat16", None),
    ("norm-b70-split", 70, 40, 96, "norm", "float32", {"block_n": 32, "block_k": 32, "programs_per_sm": 4}),
    ("gated-b130", 130, 24, 48, "gated", "float32", {"block_n": 16, "block_k": 16, "programs_per_sm": 1}),
    # the 1.7B talker-to-predictor projection: a biased Linear, one rounding after the bias
    ("bias-b2", 2, 40, 96, "bias", "bfloat16", None),
    ("bias-b3-split", 3, 40, 96, "bias", "float32", {"block_n": 16, "block_k": 16, "programs_per_sm": 8}),
]


def _run_gemv(rows: int, n_out: int, k_dim: int, flavour: str, dtype_name: str, tiles: dict | None) -> dict[str, Any]:
    """`kernels.gemv` against the PyTorch expression it replaces."""
    import torch
    import torch.nn.functional as F

    from qwen3tts_agent.engine import kernels

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(rows * 7 + n_out)
    gated = flavour == "gated"
    x = (2 * torch.randn(rows, 2 * k_dim)).to(dtype)[:, :k_dim]  # a row stride other than k_dim
    w = (torch.randn((2 if gated else 1) * n_out, k_dim) / k_dim**0.5).to(dtype)
    g = (1 + 0.3 * torch.randn(k_dim)).to(dtype)
    res = torch.randn(rows, n_out).to(dtype)
    out = torch.empty(rows, n_out, dtype=dtype)
    chosen = kernels.GemvTiles(**tiles) if tiles else None
    if flavour == "residual":
        ref = res + F.linear(x, w)
        kernels.gemv(x, w, out, residual=res, tiles=chosen)
    elif flavour == "bias":
        bias = res[0].contiguous()
        ref = F.linear(x, w, bias)
        kernels.gemv(x, w, out, bias=bias, tiles=chosen)
    else:
        h = F.rms_norm(x, (k_dim,), g, 1e-6)
        ref = F.linear(h, w)
        if gated:
            gate, up = ref.split(n_out, dim=-1)
            ref = F.silu(gate) * up
        kernels.gemv(x, w, out, norm=g, eps=1e-6, gated=gated, tiles=chosen)
    tiles = chosen or kernels.gemv_tiles("residual" if flavour == "bias" else flavour, n_out, k_dim, rows)
    grid = kernels._gemv_grid(n_out, k_dim, rows, dtype, tiles, x.device)
    counters_clear = bool((kernels._counters(x.device) == 0).all())
    return {
        "err": float((out.double() - ref.double()).abs().max() / ref.double().abs().max()),
        "splits": grid["SPLITS"],
        "row_tiles": grid["ROW_TILES"],
        "counters_clear": counters_clear,
    }


def _run_engine() -> dict[str, Any]:
    """Two streams (one greedy, one sampled) on a tiny engine with the kernels, and again with PyTorch layers;
    then the greedy one again with an EOS row that fires (synthetic checkpoints never end on their own)."""
    import torch

    from qwen3tts_agent import Engine, SamplingParams, Voice
    from qwen3tts_agent.models.loading import load_official_model

    official = load_official_model("synthetic:tiny-customvoice", device="cpu", dtype=torch.float32, progress=False)
    speaker = sorted(official.get_supported_speakers())[0]
    head = official.model.talker.codec_head.weight
    eos = official.model.config.talker_config.codec_eos_token_id
    saved = head.data[eos].clone()
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
            head.data[eos] = 2 * head.data[streams[0].result.codes[2][0]]  # EOS outscores the code of frame 2
            ending = engine.open_stream("Hello there.", voice=Voice(speaker=speaker), sampling=SamplingParams.greedy(max_frames=6))
            list(ending.chunks(timeout=600))
            runs["kernels" if fused else "torch"] = {
                "used": engine.core.runner.fused_kernels, "codes": [s.result.codes for s in streams],
                "ending": [ending.result.finish_reason, ending.result.codes],
            }
        finally:
            head.data[eos] = saved
            engine.close()
    return runs


# ------------------------------------------------------------------------------------------------ pytest side


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_interpreted(__file__, timeout=900)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_layer_matches_torch_path(results: dict[str, dict[str, Any]], case: dict[str, Any]) -> None:
    r = results[_case_id(case)]
    tol = TOLERANCE[case["dtype"]]
    assert r["shape_ok"]
    assert r["out"] <= tol, r
    assert r["k"] <= tol and r["v"] <= tol, r
    assert r["rest_untouched"], "only the written cache columns may change"
    assert r["written_changed"], "the new keys were not written"


@pytest.mark.parametrize("case", GEMV_CASES, ids=[c[0] for c in GEMV_CASES])
def test_gemv_matches_torch(results: dict[str, dict[str, Any]], case: tuple) -> None:
    r = results["gemv-" + case[0]]
    assert r["err"] <= TOLERANCE[case[5]], r
    assert r["counters_clear"], "every launch must leave its arrival counters zeroed"


def test_gemv_cases_cover_splits_and_row_tiles(results: dict[str, dict[str, Any]]) -> None:
    gemv = [results["gemv-" + c[0]] for c in GEMV_CASES]
    assert {r["splits"] > 1 for r in gemv} == {True, False}
    assert {r["row_tiles"] > 1 for r in gemv} == {True, False}


def test_engine_with_kernels_matches_torch_layers(results: dict[str, dict[str, Any]]) -> None:
    """The runner's use of the kernels (talker masked, predictor unmasked, batched rows) gives the same codes."""
    engine = results["engine"]
    assert engine["kernels"]["used"] and not engine["torch"]["used"]
    assert all(len(codes) == 4 for codes in engine["kernels"]["codes"])
    assert engine["kernels"]["codes"] == engine["torch"]["codes"]
    reason, codes = engine["kernels"]["ending"]
    assert reason == "eos" and 2 <= len(codes) < 6, "the kernels' EOS flag ends the stream"
    assert engine["kernels"]["ending"] == engine["torch"]["ending"]


def _ptx(kernel: Any, signature: dict[str, str], constants: dict[str, Any], pdl: bool) -> list[str]:
    """The kernel compiled for sm_90 (no GPU needed), as PTX lines; pointers and strides 16-byte aligned."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items()) if kind.startswith("*") or name.startswith("stride")}
    source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl}).asm["ptx"].splitlines()


def _first(lines: list[str], text: str) -> int:
    return next((i for i, line in enumerate(lines) if text in line), -1)


@pytest.mark.parametrize("pdl,late", [(True, False), (False, False), (True, True)])
def test_programmatic_launch_prefetches_weights_then_waits(pdl: bool, late: bool) -> None:
    """With PDL on, the GEMV loads its weights, then waits for its inputs; it lets the next kernel start before
    that wait, or after it with LATE_TRIGGER."""
    from qwen3tts_agent.engine import kernels

    pointers = dict.fromkeys(("x_ptr", "g_ptr", "w_ptr", "res_ptr", "out_ptr"), "*bf16")
    signature = {**pointers, "part_ptr": "*fp32", "count_ptr": "*i32", "rows": "i32", "eps": "fp32",
                 "stride_x": "i32", "stride_res": "i32", "stride_out": "i32"}
    constants = dict(N_OUT=1024, K_DIM=1024, NORM=True, GATED=False, RESIDUAL=False, BIAS=False, ROW_TILES=1, SPLITS=4,
                     SPLIT_BLOCKS=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT_F32=False, PRECISION="tf32", PDL=pdl,
                     LATE_TRIGGER=late)
    lines = _ptx(kernels._gemv_kernel, signature, constants, pdl)
    wait, trigger = _first(lines, "griddepcontrol.wait"), _first(lines, "griddepcontrol.launch_dependents")
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    assert (wait >= 0) == pdl and (trigger >= 0) == pdl
    if pdl:
        assert len([i for i in loads if i < wait]) == 8, "the 32 x 256 bf16 weight tile: eight 16-byte loads per thread"
        assert any(i > wait for i in loads), "the inputs are loaded after the wait"
        assert (trigger > wait) == late


@pytest.mark.parametrize("prefetch", [True, False])
def test_attention_prefetch_loads_before_its_wait(prefetch: bool) -> None:
    """PREFETCH: the position, RoPE rows and first cache block are loaded before the wait for q/k/v."""
    from qwen3tts_agent.engine import kernels

    signature = {
        **dict.fromkeys(("qkv_ptr", "cos_ptr", "sin_ptr"), "*bf16"), "pos_ptr": "*i64",
        **dict.fromkeys(("q_norm_ptr", "k_norm_ptr", "cache_k_ptr", "cache_v_ptr", "out_ptr"), "*bf16"),
        "part_ptr": "*fp32", "stat_ptr": "*fp32", "count_ptr": "*i32", "read_len": "i32", "keys_per_split": "i32",
        "eps": "fp32", "scale": "fp32",
        **dict.fromkeys(("stride_qkv", "stride_cos", "stride_sin", "stride_pos", "stride_slot", "stride_head",
                         "stride_len", "stride_out"), "i32"),
    }
    constants = dict(Q_SIZE=2048, KV_SIZE=1024, KV_HEADS=8, GROUP=2, Q_ROWS=16, HEAD_DIM=128, BLOCK_KEYS=32, SPLITS=1,
                     LIMIT_TO_POS=False, DOT_F32=False, PRECISION="tf32", PDL=True, EARLY_KEYS=True, PREFETCH=prefetch)
    lines = _ptx(kernels._attention_kernel, signature, constants, True)
    wait = _first(lines, "griddepcontrol.wait")
    early = [i for i, line in enumerate(lines[:wait]) if "ld.global" in line]
    assert wait >= 0 and bool(early) == prefetch
    assert any("ld.global" in line for line in lines[wait:]), "q/k/v are loaded after the wait"


def test_cases_cover_single_and_split_paths(results: dict[str, dict[str, Any]]) -> None:
    attn = {results[_case_id(c)]["attn_splits"] > 1 for c in CASES}
    gemv = {results[_case_id(c)]["gemv_splits"] > 1 for c in CASES}
    assert attn == {True, False} and gemv == {True, False}


if __name__ == "__main__":
    start_child()
    out = {}
    for case in CASES:
        started = time.perf_counter()
        out[_case_id(case)] = _run_case(case)
        print(f"{_case_id(case)} ({time.perf_counter() - started:.1f} s): {out[_case_id(case)]}", file=sys.stderr, flush=True)
    for name, *args in GEMV_CASES:
        out["gemv-" + name] = _run_gemv(*args)
        print(f"gemv-{name}: {out['gemv-' + name]}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    out["engine"] = _run_engine()
    print(f"engine ({time.perf_counter() - started:.1f} s): {out['engine']}", file=sys.stderr, flush=True)
    report_results(out)
