"""Every layer of a decoder stack in one persistent launch, for single-token steps of up to 16 rows.

Launched layer by layer (`kernels.decode_layer`), a frame's 98 single-token layer calls (28 talker layers,
14 predictor steps of 5) cost five launches each, and on an H200 each launch spends ~6 µs ramping up and
draining for ~1-3 µs of weight bytes. Here one launch runs the whole stack: one program per SM walks the
phases of every layer (the QKV product, attention, the O product, the gated product, the down product:
the same tile code as `kernels.py`), and the programs meet at a grid barrier between phases. Before
waiting at a barrier a program loads the first weight block of its next tile, which nothing in flight
writes, so the weight stream runs on through the barrier.

A grid barrier needs every program resident at once: the grid is one program per SM, so every program
finds an SM once the kernels before it drain. A wait that spins far longer than any step could take gives
up and raises a flag (`DecodeStack.barrier_timed_out`) instead of hanging the GPU.

Triton's interpreter runs programs one after another, where a barrier can never be met, so there (and only
there) the same kernel is launched once per (layer, phase) without barriers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import kernels
from .kernels import _attention_item, _gemv_tile, _grid_arrive, _grid_wait, _interpreting, _jit
from .layers import FusedDecoderLayer

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # kernels.available() reports False then, and no DecodeStack is built
    triton = None

MAX_ROWS = 16  # one 16-row tile per product; larger batches take `kernels.decode_layer`
# a layer's addresses in the stack table, in this order
_TABLE_FIELDS = ("w_qkv", "w_o", "w_gate_up", "w_down", "in_norm", "post_norm", "q_norm", "k_norm", "cache_k", "cache_v")
_PHASES = 5
_INTERPRETER_PROGRAMS = 4
# A program's cost per round of tiles beyond its weight bytes, and the extra of a K-split reduction, in
# bytes of weights (the tile choice in `_phase_tiles`)
_ROUND_COST = 8192
_SPLIT_COST = 8192


@_jit
def _gemv_phase(
    pid, x_ptr, g_ptr, w_ptr, res_ptr, out_ptr, part_ptr, count_ptr, bar_ptr, bar_target, rows, eps,
    stride_x, stride_res, stride_out,
    N_OUT: tl.constexpr, K_DIM: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    SPLITS: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PROGRAMS: tl.constexpr,
    BARRIERS: tl.constexpr,
):
    """The (tile, split) items of one product, dealt round-robin to the programs; barrier-bracketed when BARRIERS."""
    TILES: tl.constexpr = (N_OUT + BLOCK_N - 1) // BLOCK_N
    ITEMS: tl.constexpr = TILES * SPLITS
    item = pid
    if BARRIERS:
        if pid < ITEMS:  # the first tile prefetches its weights, then waits
            _gemv_tile(
                pid % TILES, pid // TILES, x_ptr, g_ptr, w_ptr, res_ptr, out_ptr, part_ptr, count_ptr, bar_ptr,
                bar_target, rows, eps, stride_x, stride_res, stride_out, N_OUT, K_DIM, NORM, GATED, RESIDUAL, 1,
                SPLITS, SPLIT_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION, 2,
            )
        else:
            _grid_wait(bar_ptr, bar_target)
        item += PROGRAMS
    while item < ITEMS:
        _gemv_tile(
            item % TILES, item // TILES, x_ptr, g_ptr, w_ptr, res_ptr, out_ptr, part_ptr, count_ptr, bar_ptr,
            bar_target, rows, eps, stride_x, stride_res, stride_out, N_OUT, K_DIM, NORM, GATED, RESIDUAL, 1,
            SPLITS, SPLIT_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PRECISION, 0,
        )
        item += PROGRAMS
    if BARRIERS:
        _grid_arrive(bar_ptr)


@_jit
def _grid_rearm(bar_ptr, PROGRAMS: tl.constexpr):
    """Count this program done; the last one has seen every program pass its last wait, so it zeroes the
    barrier for the next launch."""
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == PROGRAMS - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")


@_jit
def _stack_kernel(
    table_ptr, x_ptr, h_ptr, qkv_ptr, attn_ptr, x1_ptr, act_ptr, cos_ptr, sin_ptr, pos_ptr,
    part_ptr, attn_part_ptr, attn_stat_ptr, count_ptr, bar_ptr,
    rows, read_len, keys_per_split, eps, scale, layer_begin, layer_end,
    stride_cos, stride_sin, stride_pos, stride_slot, stride_head, stride_len,
    HIDDEN: tl.constexpr, Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, FFN: tl.constexpr, KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    KV_SPLITS: tl.constexpr, LIMIT_TO_POS: tl.constexpr,
    QKV_N: tl.constexpr, QKV_K: tl.constexpr, QKV_SPLITS: tl.constexpr, QKV_BLOCKS: tl.constexpr,
    O_N: tl.constexpr, O_K: tl.constexpr, O_SPLITS: tl.constexpr, O_BLOCKS: tl.constexpr,
    GU_N: tl.constexpr, GU_K: tl.constexpr, GU_SPLITS: tl.constexpr, GU_BLOCKS: tl.constexpr,
    DN_N: tl.constexpr, DN_K: tl.constexpr, DN_SPLITS: tl.constexpr, DN_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, PHASE: tl.constexpr, PROGRAMS: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Layers [layer_begin, layer_end) of a stack on x [rows, HIDDEN]; PHASE < 0: every phase, with grid
    barriers; PHASE = p: only phase p, no barriers (the interpreter's launch per phase).

    Layer l reads x (l = 0) or h[(l - 1) % 2] and writes h[l % 2]; QKV_N etc. are the products' tiles
    (BLOCK_N, BLOCK_K, K splits, K blocks per split). The barrier counter bar_ptr[0] counts arrivals,
    bar_ptr[1] the programs done; the last one done zeroes both for the next launch. bar_ptr[2]: a wait timed
    out (`_grid_wait`).
    """
    BARRIERS: tl.constexpr = PHASE < 0
    if PDL:
        gdc_launch_dependents()  # every program is resident by the time all have run this: no deadlock
        gdc_wait()
    pid = tl.program_id(0)
    wp = tl.pointer_type(x_ptr.dtype.element_ty)
    passed = 0  # barriers every program has arrived at so far
    layer = layer_begin
    while layer < layer_end:
        addr = table_ptr + layer * 10
        w_qkv, w_o = tl.load(addr + 0).to(wp), tl.load(addr + 1).to(wp)
        w_gate_up, w_down = tl.load(addr + 2).to(wp), tl.load(addr + 3).to(wp)
        in_norm, post_norm = tl.load(addr + 4).to(wp), tl.load(addr + 5).to(wp)
        q_norm, k_norm = tl.load(addr + 6).to(wp), tl.load(addr + 7).to(wp)
        cache_k, cache_v = tl.load(addr + 8).to(wp), tl.load(addr + 9).to(wp)
        src = h_ptr + ((layer + 1) % 2) * BLOCK_M * HIDDEN
        if layer == 0:
            src = x_ptr
        dst = h_ptr + (layer % 2) * BLOCK_M * HIDDEN
        if PHASE < 0 or PHASE == 0:  # qkv = RMSNorm(x) · W_qkvᵀ
            _gemv_phase(
                pid, src, in_norm, w_qkv, src, qkv_ptr, part_ptr, count_ptr, bar_ptr, passed * PROGRAMS, rows, eps,
                HIDDEN, 0, Q_SIZE + 2 * KV_SIZE, Q_SIZE + 2 * KV_SIZE, HIDDEN, True, False, False,
                QKV_SPLITS, QKV_BLOCKS, BLOCK_M, QKV_N, QKV_K, DOT_F32, PRECISION, PROGRAMS, BARRIERS,
            )
            passed += 1
        if PHASE < 0 or PHASE == 1:  # attention, K/V cache write
            if BARRIERS:
                _grid_wait(bar_ptr, passed * PROGRAMS)
            heads = rows * KV_HEADS
            item = pid
            while item < heads * KV_SPLITS:
                _attention_item(
                    item % heads, item // heads, qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_norm, k_norm, cache_k, cache_v,
                    attn_ptr, attn_part_ptr, attn_stat_ptr, count_ptr, read_len, keys_per_split, eps, scale,
                    Q_SIZE + 2 * KV_SIZE, stride_cos, stride_sin, stride_pos, stride_slot, stride_head, stride_len, Q_SIZE,
                    Q_SIZE, KV_SIZE, KV_HEADS, GROUP, Q_ROWS, HEAD_DIM, BLOCK_KEYS, KV_SPLITS, LIMIT_TO_POS, DOT_F32,
                    PRECISION,
                )
                item += PROGRAMS
            if BARRIERS:
                _grid_arrive(bar_ptr)
            passed += 1
        if PHASE < 0 or PHASE == 2:  # x1 = x + attn · W_oᵀ
            _gemv_phase(
                pid, attn_ptr, in_norm, w_o, src, x1_ptr, part_ptr, count_ptr, bar_ptr, passed * PROGRAMS, rows, eps,
                Q_SIZE, HIDDEN, HIDDEN, HIDDEN, Q_SIZE, False, False, True,
                O_SPLITS, O_BLOCKS, BLOCK_M, O_N, O_K, DOT_F32, PRECISION, PROGRAMS, BARRIERS,
            )
            passed += 1
        if PHASE < 0 or PHASE == 3:  # act = SiLU(gate) · up of RMSNorm(x1)
            _gemv_phase(
                pid, x1_ptr, post_norm, w_gate_up, x1_ptr, act_ptr, part_ptr, count_ptr, bar_ptr, passed * PROGRAMS, rows,
                eps, HIDDEN, 0, FFN, FFN, HIDDEN, True, True, False,
                GU_SPLITS, GU_BLOCKS, BLOCK_M, GU_N, GU_K, DOT_F32, PRECISION, PROGRAMS, BARRIERS,
            )
            passed += 1
        if PHASE < 0 or PHASE == 4:  # out = x1 + act · W_downᵀ
            _gemv_phase(
                pid, act_ptr, post_norm, w_down, x1_ptr, dst, part_ptr, count_ptr, bar_ptr, passed * PROGRAMS, rows, eps,
                FFN, HIDDEN, HIDDEN, HIDDEN, FFN, False, False, True,
                DN_SPLITS, DN_BLOCKS, BLOCK_M, DN_N, DN_K, DOT_F32, PRECISION, PROGRAMS, BARRIERS,
            )
            passed += 1
        layer += 1
    if BARRIERS:
        _grid_rearm(bar_ptr, PROGRAMS)


@dataclass(frozen=True)
class PhaseTiles:
    """How one product of the stack is cut: BLOCK_N outputs by BLOCK_K inputs per tile, K in `splits`."""

    block_n: int
    block_k: int
    splits: int
    split_blocks: int

    def constants(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_N": self.block_n, f"{prefix}_K": self.block_k, f"{prefix}_SPLITS": self.splits,
                f"{prefix}_BLOCKS": self.split_blocks}


def phase_tiles(n_out: int, k_dim: int, gated: bool, programs: int, dtype: torch.dtype) -> PhaseTiles:
    """The cut whose busiest program streams the fewest weight bytes, counting a cost per round of tiles and
    per K-split reduction: the phase lasts as long as its busiest program."""
    max_k = kernels.FP32_BLOCK_K if dtype == torch.float32 else 256
    block_k = max(16, min(max_k, triton.next_power_of_2(k_dim)))
    k_blocks = kernels._cdiv(k_dim, block_k)
    best: tuple[tuple[int, int], PhaseTiles] | None = None
    for block_n in (16, 32, 64):
        for want in (1, 2, 3, 4, 6, 8):
            per_split = kernels._cdiv(k_blocks, want)
            splits = kernels._cdiv(k_blocks, per_split)
            items = kernels._cdiv(n_out, block_n) * splits
            item_bytes = block_n * per_split * block_k * (2 if gated else 1) * dtype.itemsize
            cost = kernels._cdiv(items, programs) * (item_bytes + _ROUND_COST) + (splits > 1) * _SPLIT_COST
            key = (cost, items)
            if best is None or key < best[0]:
                best = key, PhaseTiles(block_n, block_k, splits, per_split)
    assert best is not None
    return best[1]


class DecodeStack:
    """A stack of decoder layers with their KV caches, set up for `_stack_kernel`: the table of the layers'
    addresses, the scratch buffers of one step and the products' tiles.

    Holds the layers and caches (the table points into them). Not for concurrent use: one scratch set.
    """

    def __init__(
        self,
        layers: Sequence[FusedDecoderLayer],
        caches_k: Sequence[torch.Tensor],
        caches_v: Sequence[torch.Tensor],
        *,
        programs_per_sm: int = 1,
        num_warps: int = 8,
    ) -> None:
        first = layers[0]
        self.layers, self.caches_k, self.caches_v = list(layers), list(caches_k), list(caches_v)
        shapes = {(lay.head_dim, lay.q_size, lay.kv_size, lay.ffn, lay.eps, lay.scaling, lay.w_qkv.shape) for lay in layers}
        strides = {(c.shape, c.stride(), c.dtype) for c in (*caches_k, *caches_v)}
        if len(shapes) != 1 or len(strides) != 1 or len(caches_k) != len(layers) or len(caches_v) != len(layers):
            raise ValueError("a stack needs layers of one shape and K/V caches of one layout, one pair per layer")
        self.device, self.dtype = first.w_qkv.device, first.w_qkv.dtype
        self.hidden = first.w_qkv.shape[1]
        self.num_warps = num_warps
        dev, dt = self.device, self.dtype
        rows_table = [[getattr(lay, name).data_ptr() for name in _TABLE_FIELDS[:8]] + [k.data_ptr(), v.data_ptr()]
                      for lay, k, v in zip(layers, caches_k, caches_v, strict=True)]
        self.table = torch.tensor(rows_table, dtype=torch.int64, device=dev)
        # one program per SM; the interpreter pays per program, so it deals the same items to a few
        self.programs = programs_per_sm * kernels._sm_count(dev) if dev.type == "cuda" else _INTERPRETER_PROGRAMS
        self._resident: set[tuple] = set()  # launch configurations checked by `_check_resident`
        qkv_n = first.q_size + 2 * first.kv_size
        products = {  # (outputs, inputs, gated) of the four products
            "QKV": (qkv_n, self.hidden, False), "O": (self.hidden, first.q_size, False),
            "GU": (first.ffn, self.hidden, True), "DN": (self.hidden, first.ffn, False),
        }
        self.tiles = {name: phase_tiles(*shape, self.programs, dt) for name, shape in products.items()}
        self.h = torch.zeros(2, MAX_ROWS, self.hidden, device=dev, dtype=dt)
        self.qkv = torch.zeros(MAX_ROWS, qkv_n, device=dev, dtype=dt)
        self.attn = torch.zeros(MAX_ROWS, first.q_size, device=dev, dtype=dt)
        self.x1 = torch.zeros(MAX_ROWS, self.hidden, device=dev, dtype=dt)
        self.act = torch.zeros(MAX_ROWS, first.ffn, device=dev, dtype=dt)
        partials = max(self.tiles[name].splits * (1 + gated) * n * MAX_ROWS for name, (n, _, gated) in products.items())
        self.partials = torch.zeros(partials, device=dev, dtype=torch.float32)
        kv_heads, group = first.kv_size // first.head_dim, first.q_size // first.kv_size
        self.attn_partials = torch.zeros(MAX_ROWS * kv_heads, kernels.MAX_KV_SPLITS, group, first.head_dim, device=dev)
        self.attn_stats = torch.zeros(MAX_ROWS * kv_heads, kernels.MAX_KV_SPLITS, 2, group, device=dev)
        self.barrier = torch.zeros(3, device=dev, dtype=torch.int32)  # arrivals, programs done, timed out

    def barrier_timed_out(self) -> bool:
        """Whether a grid barrier ever gave up waiting (a program never came: its results are wrong). Syncs."""
        return bool(self.barrier[2].item())

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_pos: torch.Tensor, read_len: int, *, masked: bool
    ) -> torch.Tensor:
        """Every layer on one token per row, as `kernels.decode_layer` layer after layer would (with t = 1).

        x [b, hidden] contiguous, b <= MAX_ROWS; cos/sin [b, head_dim] and write_pos [b] (int64) with any row
        stride. Returns a [b, hidden] view of this stack's scratch, valid until its next call.
        """
        b = x.shape[0]
        first = self.layers[0]
        if not 1 <= b <= MAX_ROWS or x.shape[1] != self.hidden or not x.is_contiguous() or x.dtype != self.dtype:
            raise ValueError(f"x must be contiguous [1..{MAX_ROWS}, {self.hidden}] {self.dtype}, got {tuple(x.shape)} {x.dtype}")
        if write_pos.dtype != torch.int64 or write_pos.shape != (b,) or not 1 <= read_len <= self.caches_k[0].shape[2]:
            raise ValueError("write_pos must be int64 [b] and read_len within the cache")
        d = first.head_dim
        kv_heads, group = first.kv_size // d, first.q_size // first.kv_size
        kv_splits, per_split = kernels._kv_splits(b * kv_heads, read_len, x.device)
        cache = self.caches_k[0]

        constants = dict(
            HIDDEN=self.hidden, Q_SIZE=first.q_size, KV_SIZE=first.kv_size, FFN=first.ffn, KV_HEADS=kv_heads,
            GROUP=group, Q_ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_KEYS=kernels.BLOCK_KEYS,
            KV_SPLITS=kv_splits, LIMIT_TO_POS=masked, BLOCK_M=MAX_ROWS, PROGRAMS=self.programs,
            DOT_F32=_interpreting(), PRECISION=kernels._precision(self.dtype), num_warps=self.num_warps,
            **{k: v for prefix, t in self.tiles.items() for k, v in t.constants(prefix).items()},
        )

        def launch(layer_begin: int, layer_end: int, warmup: bool = False, **launch_constants: object) -> object:
            """Launch, or with `warmup` only compile, layers [layer_begin, layer_end)."""
            args = (
                self.table, x, self.h, self.qkv, self.attn, self.x1, self.act, cos, sin, write_pos,
                self.partials, self.attn_partials, self.attn_stats, kernels._counters(x.device), self.barrier,
                b, read_len, per_split, first.eps, first.scaling, layer_begin, layer_end,
                cos.stride(0), sin.stride(0), write_pos.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
            )
            if warmup:
                return _stack_kernel.warmup(*args, grid=(self.programs,), **constants, **launch_constants)
            return _stack_kernel[(self.programs,)](*args, **constants, **launch_constants)

        if _interpreting():
            for layer in range(len(self.layers)):
                for phase in range(_PHASES):
                    launch(layer, layer + 1, PHASE=phase, PDL=False)
        else:
            key = tuple(sorted(constants.items()))
            if key not in self._resident:
                self._check_resident(launch(0, len(self.layers), PHASE=-1, warmup=True, **kernels._pdl(x.device)))
                self._resident.add(key)
            launch(0, len(self.layers), PHASE=-1, **kernels._pdl(x.device))
        return self.h[(len(self.layers) - 1) % 2, :b]

    def _check_resident(self, kernel: object) -> None:
        """Refuse a grid whose programs could not all be resident at once: its barriers would never be met."""
        kernel._init_handles()  # type: ignore[attr-defined]
        props = torch.cuda.get_device_properties(self.device)
        regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256  # type: ignore[attr-defined]  # allocated per warp in 256s
        per_sm = min(
            getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * self.num_warps),
            props.shared_memory_per_multiprocessor // (kernel.metadata.shared + 1024),  # type: ignore[attr-defined]
            props.max_threads_per_multi_processor // (32 * self.num_warps),
        )
        if self.programs > per_sm * props.multi_processor_count:
            raise ValueError(
                f"{self.programs} programs of {self.num_warps} warps cannot all be resident: {per_sm} per SM fit "
                f"({kernel.n_regs} registers, {kernel.metadata.shared} B shared memory each)"  # type: ignore[attr-defined]
            )
