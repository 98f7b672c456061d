"""`decode_layer.decode_layer` against the PyTorch layer it replaces (`FusedDecoderLayer.__call__`).

Official decoder layers with random weights and norm gains, at tiny widths off the tile sizes, at odd shapes
(head_dim 24 and 40: not powers of two; GQA groups of 5 and 3), and at the released widths: output, the
written cache columns, and every other cache column untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qwen3tts_agent.engine.runner.layers import FusedDecoderLayer, rope_tables
from qwen3tts_agent.kernels import common, decode_layer, gemv
from qwen3tts_agent.models.compat import import_qwen_tts

MAX_LEN = 256  # cache length is MAX_LEN + 1: the spare column inactive rows write to
# max |error| / max |reference|. The interpreter truncates fp32 -> bf16 casts (a GPU rounds to nearest even),
# so its bf16 errors run about twice those on a GPU.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


SHAPES = {
    "tiny": Shape(48, 6, 2, 16, 80),  # widths off the tile sizes, GQA group 3
    "odd-talker": Shape(120, 5, 1, 24, 200),  # head_dim 24 (padded to 32), 5 query heads per kv head
    "odd-predictor": Shape(120, 3, 1, 40, 160),  # head_dim 40 (padded to 64), as wide as the odd talker
    "real": Shape(1024, 16, 8, 128, 3072),  # the released 0.6B talker and code predictor
}


@dataclass(frozen=True)
class Case:
    shape: str
    dtype: str
    b: int
    read_len: int
    masked: bool
    t: int = 1

    @property
    def id(self) -> str:
        tokens = f"-t{self.t}" if self.t > 1 else ""
        return f"{self.shape}-{self.dtype}-b{self.b}-len{self.read_len}-{'mask' if self.masked else 'nomask'}{tokens}"


CASES = (
    [Case("tiny", "float32", b, n, True) for b in (1, 3, 8) for n in (1, 37, 200)]
    + [Case("tiny", "float32", b, n, False) for b, n in ((1, 200), (3, 37), (8, 200))]
    + [Case("tiny", "bfloat16", b, n, m) for b, n, m in ((1, 37, True), (3, 200, True), (8, 200, False))]
    + [Case("tiny", "float32", b, n, True) for b, n in ((20, 37), (70, 200))]  # 32-row tile; two 64-row tiles
    + [Case("real", "float32", 3, 200, True), Case("real", "bfloat16", 8, 37, False)]
    # 16-bit tilings (`attention_tiles`): a few keys as one 16-key block, and many rows in longer key splits
    + [Case("tiny", "bfloat16", 3, 9, True), Case("tiny", "bfloat16", 48, 200, True)]
    # two tokens per row: the predictor's first step (positions 0 and 1, causal), b * t rows up to 80
    # (cuBLAS); and masked, with a row's two consecutive positions anywhere below read_len
    + [Case("tiny", dt, b, 2, False, t=2) for dt in ("float32", "bfloat16") for b in (1, 3, 40)]
    + [Case("tiny", "float32", b, 200, True, t=2) for b in (3, 40)]
    + [Case("real", "bfloat16", 3, 2, False, t=2)]
    # odd shapes: the talker's masked single-token step and the predictor's two-token first step and later
    # steps, split and unsplit, in both dtypes
    + [Case("odd-talker", dt, b, n, True) for dt in ("float32", "bfloat16") for b, n in ((1, 37), (3, 200))]
    + [Case("odd-talker", "float32", 20, 200, True)]
    + [Case("odd-predictor", dt, b, 2, False, t=2) for dt in ("float32", "bfloat16") for b in (1, 3)]
    + [Case("odd-predictor", "float32", b, n, False) for b, n in ((3, 9), (8, 200))]
)


def _layer(shape: Shape, dtype: torch.dtype, device: str) -> FusedDecoderLayer:
    """An official code-predictor decoder layer with random weights and norm gains, as `FusedDecoderLayer`."""
    import_qwen_tts()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerCodePredictorConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSDecoderLayer

    config = Qwen3TTSTalkerCodePredictorConfig(
        hidden_size=shape.hidden, intermediate_size=shape.ffn, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, num_hidden_layers=1,
    )
    layer = Qwen3TTSDecoderLayer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:  # RMSNorm gains start at 1; random ones check that each is applied
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return FusedDecoderLayer(layer.to(device, dtype))


def _interpreter_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter pays per program and per op: at the released widths, wider GEMV tiles and fewer "SMs"
    than the GPU uses (the kernels are the same, split paths included)."""
    monkeypatch.setattr(gemv, "FP32_BLOCK_K", 1024)
    monkeypatch.setattr(gemv, "gemv_tiles", lambda *args: gemv.GemvTiles(block_n=64, block_k=2048))
    monkeypatch.setattr(common, "INTERPRETED_SM_COUNT", 16)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_layer_matches_the_pytorch_layer(device: str, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.shape == "real" and device == "cpu":
        _interpreter_sized(monkeypatch)
    shape, dtype = SHAPES[case.shape], getattr(torch, case.dtype)
    b, t, read_len = case.b, case.t, case.read_len
    torch.manual_seed(b * 1000 + read_len)
    layer = _layer(shape, dtype, device)
    d = shape.head_dim
    cache_k = torch.randn(b + 1, shape.kv_heads, MAX_LEN + 1, d).to(device, dtype)  # one slot more than rows: must stay
    cache_v = torch.randn_like(cache_k)
    x = (2 * torch.randn(b, t, shape.hidden)).to(device, dtype)
    write_pos = torch.randint(0, read_len - t + 1, (b, 1)) + torch.arange(t)  # a row's tokens: consecutive
    write_pos[0] = torch.arange(read_len - t, read_len)  # the newest key is the last one read
    if b > 1 and t == 1:
        write_pos[-1] = MAX_LEN  # an inactive row: writes the spare column, attends every key below read_len
    write_pos = write_pos.to(device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(inv_freq.to(device), torch.arange(MAX_LEN + 1, device=device), dtype)  # rows by position
    keys = torch.arange(read_len, device=device)
    mask = (keys <= write_pos[..., None]).unsqueeze(1) if case.masked else None  # [b, 1, t, len]
    rows = torch.arange(b, device=device)[:, None]
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    with torch.no_grad():
        ref = layer(x, cos[write_pos], sin[write_pos], ref_k, ref_v, rows, write_pos, slice(0, b), read_len, mask)

    out_k, out_v = cache_k.clone(), cache_v.clone()
    out = decode_layer.decode_layer(layer, x, cos, sin, out_k, out_v, write_pos, read_len, masked=case.masked)

    written = torch.zeros_like(cache_k, dtype=torch.bool)
    written[rows, :, write_pos] = True
    tol = TOLERANCE[case.dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel_err(out, ref) <= tol
    assert _rel_err(out_k[written], ref_k[written]) <= tol
    assert _rel_err(out_v[written], ref_v[written]) <= tol
    assert torch.equal(out_k[~written], cache_k[~written]) and torch.equal(out_v[~written], cache_v[~written]), (
        "only the written cache columns may change"
    )
    assert bool((out_k[written] != cache_k[written]).any()), "the new keys were not written"


@pytest.mark.parametrize("b", [8, 70])  # the GEMV path, and the cuBLAS path whose residual adds move into the norms
def test_a_stack_equals_its_layers_one_by_one(device: str, b: int) -> None:
    """`decode_layers` over three layers gives `decode_layer`'s output layer after layer, bit for bit in fp32 (above
    64 rows each layer's last residual add goes into the next layer's input norm, rounded as the add rounds it),
    and writes the same cache columns."""
    shape, dtype, read_len = SHAPES["tiny"], torch.float32, 37
    torch.manual_seed(b)
    layers = [_layer(shape, dtype, device) for _ in range(3)]
    caches_k = [torch.randn(b, shape.kv_heads, MAX_LEN + 1, shape.head_dim).to(device, dtype) for _ in layers]
    caches_v = [torch.randn_like(k) for k in caches_k]
    x = (2 * torch.randn(b, 1, shape.hidden)).to(device, dtype)
    write_pos = torch.randint(0, read_len, (b, 1)).to(device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
    cos, sin = rope_tables(inv_freq.to(device), torch.arange(MAX_LEN + 1, device=device), dtype)

    one_k, one_v = [k.clone() for k in caches_k], [v.clone() for v in caches_v]
    expected = x
    for layer, k, v in zip(layers, one_k, one_v, strict=True):
        expected = decode_layer.decode_layer(layer, expected, cos, sin, k, v, write_pos, read_len)
    got = decode_layer.decode_layers(layers, caches_k, caches_v, x, cos, sin, write_pos, read_len)
    assert float((expected - x).abs().max()) > 0.1, "vacuous: the layers did nothing"
    assert torch.equal(got, expected)
    assert all(torch.equal(a, e) for a, e in zip(caches_k + caches_v, one_k + one_v, strict=True))


def test_a_masked_rows_attention_ends_at_its_position_whatever_the_bucket(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A talker step's rows sit at every position below its KV bucket (`read_len`, from the furthest row), and the
    kernel stops each row's keys at its own position rather than at the bucket. The same rows, keys and cache in a
    bucket of 96 and one of 224: the same output and cache, bit for bit (one key split each, so that the two
    add their keys in one order), with rows at the first position, in the middle and at the last of the smaller
    bucket, and an inactive row (the spare column: every key of its bucket). In bf16, the talker's dtype, on the many-row
    tiling a loaded step runs (fp32 runs the same loop)."""
    monkeypatch.setattr(common, "sm_count", lambda device: 1)  # one split per row, whatever the bucket
    shape, dt, b = SHAPES["tiny"], torch.bfloat16, 60  # 60 rows: the many-row tiling
    torch.manual_seed(7)
    layer = _layer(shape, dt, device)
    cache_k = torch.randn(b, shape.kv_heads, MAX_LEN + 1, shape.head_dim).to(device, dt)
    cache_v = torch.randn_like(cache_k)
    x = (2 * torch.randn(b, 1, shape.hidden)).to(device, dt)
    write_pos = torch.randint(0, 96, (b, 1))
    write_pos[:3, 0] = torch.tensor([0, 47, 95])
    write_pos = write_pos.to(device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
    cos, sin = rope_tables(inv_freq.to(device), torch.arange(MAX_LEN + 1, device=device), dt)
    outs = []
    for read_len in (96, 224):
        k, v = cache_k.clone(), cache_v.clone()
        outs.append((decode_layer.decode_layer(layer, x, cos, sin, k, v, write_pos, read_len), k, v))
    (short, short_k, short_v), (long, long_k, long_v) = outs
    assert torch.equal(short, long) and torch.equal(short_k, long_k) and torch.equal(short_v, long_v)
    # an inactive row attends every key below its bucket: there the bucket matters
    inactive = write_pos.clone()
    inactive[-1] = MAX_LEN
    spare = [decode_layer.decode_layer(layer, x, cos, sin, cache_k.clone(), cache_v.clone(), inactive, n) for n in (96, 224)]
    assert torch.equal(spare[0][:-1], spare[1][:-1]) and not torch.equal(spare[0][-1], spare[1][-1])


def test_cases_cover_single_and_split_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid reaches attention with and without key splits, GEMVs with and without K splits, and the
    padded head lanes (odd shapes) beside unpadded ones, as the interpreted cases run them."""
    cpu = torch.device("cpu")
    attn, products, padded = set(), set(), set()
    for case in CASES:
        shape, rows = SHAPES[case.shape], case.b * case.t
        with monkeypatch.context() as patch:
            if case.shape == "real":
                _interpreter_sized(patch)
            attn.add(decode_layer.kv_splits(case.b * shape.kv_heads, case.read_len, cpu)[0] > 1)
            tiles = gemv.gemv_tiles("residual", shape.hidden, shape.ffn, rows, "")
            grid = gemv.gemv_grid(shape.hidden, shape.ffn, rows, getattr(torch, case.dtype), tiles, cpu)
            products.add(grid["SPLITS"] > 1)
        padded.add(decode_layer.padded_head_dim(shape.head_dim) != shape.head_dim)
    assert attn == {True, False}
    assert products == {True, False}
    assert padded == {True, False}


@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "dtype", "supported"),
    [
        (128, 16, 8, torch.bfloat16, True),
        (24, 5, 1, torch.float32, True),
        (40, 3, 1, torch.bfloat16, True),
        (256, 4, 4, torch.bfloat16, True),
        (272, 2, 1, torch.float32, False),  # wider than the attention kernel's registers hold
        (25, 5, 1, torch.float32, False),  # odd: RoPE rotates halves
        (128, 6, 4, torch.float32, False),  # not whole GQA groups
        (128, 16, 8, torch.float16, False),  # a dtype the kernels are not tested in
    ],
)
def test_supports(head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype, supported: bool) -> None:
    support = decode_layer.supports(head_dim, heads, kv_heads, dtype, max_rows=256)
    assert bool(support) == supported
    assert bool(support.reason) != supported, "a refusal says why"


def test_unsupported_shapes_raise_with_the_reason() -> None:
    """A direct call with shapes `supports` refuses fails clearly (the runner never makes one)."""
    layer = _layer(Shape(32, 2, 1, 272, 64), torch.float32, "cpu")
    cache = torch.zeros(1, 1, 8, 272)
    with pytest.raises(ValueError, match="head_dim 272 above 256"):
        decode_layer.decode_layer(layer, torch.zeros(1, 1, 32), torch.zeros(8, 272), torch.zeros(8, 272), cache,
                                  cache.clone(), torch.zeros(1, 1, dtype=torch.int64), 1)
