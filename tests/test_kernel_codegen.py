"""The Triton kernels compiled for an H100/H200 (sm_90) without a GPU: what their PTX must contain.

These check code generation, not results (tests/kernels/ checks results, interpreted and on a GPU): where
programmatic dependent launch puts its wait, and that the shapes the kernels take compile.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qwen3tts_agent.kernels import codebooks, common, conv_epilogue, decode_layer, gemv

ATTENTION_SIGNATURE = {
    **dict.fromkeys(("qkv_ptr", "cos_ptr", "sin_ptr"), "*bf16"), "pos_ptr": "*i64",
    **dict.fromkeys(("q_norm_ptr", "k_norm_ptr", "cache_k_ptr", "cache_v_ptr", "out_ptr"), "*bf16"),
    "part_ptr": "*fp32", "stat_ptr": "*fp32", "count_ptr": "*i32", "read_len": "i32", "keys_per_split": "i32",
    "eps": "fp32", "scale": "fp32",
    **dict.fromkeys(("stride_qkv", "stride_cos", "stride_sin", "stride_pos", "stride_slot", "stride_head",
                     "stride_len", "stride_out"), "i32"),
}


def _ptx(kernel: Any, signature: dict[str, str], constants: dict[str, Any], pdl: bool, divisible: tuple[str, ...] = ()) -> list[str]:
    """The kernel compiled for sm_90, as PTX lines; pointers and strides 16-byte aligned, and the integer arguments
    `divisible` multiples of 16 (as Triton specializes such arguments when it launches a kernel). `signature` lists
    the kernel's arguments in order up to its last runtime one; an argument given a value in `constants` there (as
    Triton specializes an integer 1 at launch) is marked "constexpr" in its place: attributes go by position."""
    assert not common.interpreting(), "this process compiles the kernels (tests/kernels runs interpreted)"
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
               if kind != "constexpr" and (kind.startswith("*") or name.startswith("stride") or name in divisible)}
    source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl}).asm["ptx"].splitlines()


def _first(lines: list[str], text: str) -> int:
    return next((i for i, line in enumerate(lines) if text in line), -1)


def _attention_constants(head_dim: int, group: int, kv_heads: int, **flags: Any) -> dict[str, Any]:
    return dict(
        Q_SIZE=group * kv_heads * head_dim, KV_SIZE=kv_heads * head_dim, KV_HEADS=kv_heads, GROUP=group,
        Q_ROWS=max(16, common.next_power_of_2(group)), HEAD_DIM=head_dim, HEAD_DIM_P=decode_layer.padded_head_dim(head_dim),
        BLOCK_KEYS=decode_layer.BLOCK_KEYS, SPLITS=1, LIMIT_TO_POS=False, DOT_F32=False, PRECISION="tf32", PDL=True,
        EARLY_KEYS=True, PREFETCH=True,
    ) | flags


@pytest.mark.parametrize("pdl,late", [(True, False), (False, False), (True, True)])
def test_programmatic_launch_prefetches_weights_then_waits(pdl: bool, late: bool) -> None:
    """With PDL on, the GEMV loads its weights, then waits for its inputs; it lets the next kernel start before
    that wait, or after it with LATE_TRIGGER."""
    pointers = dict.fromkeys(("x_ptr", "g_ptr", "w_ptr", "res_ptr", "out_ptr"), "*bf16")
    signature = {**pointers, "part_ptr": "*fp32", "count_ptr": "*i32", "rows": "i32", "eps": "fp32",
                 "stride_x": "i32", "stride_res": "i32", "stride_out": "i32"}
    constants = dict(N_OUT=1024, K_DIM=1024, NORM=True, GATED=False, RESIDUAL=False, BIAS=False, ROW_TILES=1, SPLITS=4,
                     SPLIT_BLOCKS=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT_F32=False, PRECISION="tf32", PDL=pdl,
                     LATE_TRIGGER=late)
    lines = _ptx(gemv._gemv_kernel, signature, constants, pdl)
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
    lines = _ptx(decode_layer._attention_kernel, ATTENTION_SIGNATURE, _attention_constants(128, 2, 8, PREFETCH=prefetch), True)
    wait = _first(lines, "griddepcontrol.wait")
    early = [i for i, line in enumerate(lines[:wait]) if "ld.global" in line]
    assert wait >= 0 and bool(early) == prefetch
    assert any("ld.global" in line for line in lines[wait:]), "q/k/v are loaded after the wait"


@pytest.mark.parametrize(("head_dim", "group", "splits"), [(24, 5, 1), (40, 3, 4), (256, 1, 2)])
def test_padded_and_wide_heads_compile(head_dim: int, group: int, splits: int) -> None:
    """Head widths off the powers of two (padded and masked) and the widest `supports` takes compile for the
    GPU, with the query rows of a group of 5 or 3 and with key splits."""
    assert decode_layer.supports(head_dim, group, 1, torch.bfloat16, max_rows=256)
    lines = _ptx(decode_layer._attention_kernel, ATTENTION_SIGNATURE, _attention_constants(head_dim, group, 1, SPLITS=splits), True)
    assert _first(lines, ".entry _attention_kernel") >= 0 and _first(lines, "griddepcontrol.wait") >= 0


def test_the_codebook_sum_loads_and_stores_16_bytes_at_a_time() -> None:
    """The codebook sum reads and writes rows of the width (a multiple of 16, as the released one is): one 16-byte
    vector access per eight bf16 values, not one per value."""
    signature = {"codes_ptr": "*i64", "tables_ptr": "*bf16", "out_ptr": "*bf16", "rows": "i32", "frames": "i32",
                 "stride_b": "i32", "stride_t": "i32", "stride_q": "i32", "first": "i32", "bins": "i32", "width": "i32"}
    constants = dict(COUNT=15, BLOCK_ROWS=codebooks.BLOCK_ROWS, BLOCK_WIDTH=codebooks.BLOCK_WIDTH)
    lines = _ptx(codebooks._codebook_sum_kernel, signature, constants, False, divisible=("width",))
    accesses = [line for line in lines if "ld.global" in line or "st.global" in line]
    assert not [line for line in accesses if ".b16" in line], "a bf16 value read or written alone"
    assert any("st.global.v4" in line for line in accesses) and any("ld.global.v4" in line for line in accesses)


@pytest.mark.parametrize("residual", [False, True], ids=["bias", "bias+residual"])
def test_the_conv_epilogue_loads_and_stores_16_bytes_at_a_time(residual: bool) -> None:
    """On the codec's channels-contiguous tensors (channel strides 1, as Triton specializes them at launch; widths
    and time strides multiples of 16, as in the released decoder, whose widths are 96 to 1536 channels, so that a
    chunk behind a history starts aligned too) the conv epilogue reads the convolution's output (and the residual)
    and writes the sum and the activation eight bf16 values at a time."""
    pointers = ("raw_ptr", "bias_ptr", "residual_ptr", "alpha_ptr", "inv_beta_ptr", "sum_ptr", "out_ptr")
    tensors = ("r", "e", "s", "o")
    signature = {**dict.fromkeys(pointers, "*bf16"), "channels": "i32", "length": "i32",
                 **{f"stride_{t}{axis}": "constexpr" if axis == "c" else "i32" for t in tensors for axis in "bct"}}
    constants = dict(BLOCK_T=conv_epilogue.BLOCK_T, BLOCK_C=conv_epilogue.BLOCK_C, RESIDUAL=residual, KEEP_SUM=True,
                     LIBDEVICE=True, **{f"stride_{t}c": 1 for t in tensors})
    lines = _ptx(conv_epilogue._epilogue_kernel, signature, constants, False, divisible=("channels",))
    wide_loads = [line for line in lines if "ld.global" in line and ".v4" in line]
    wide_stores = [line for line in lines if "st.global.v4" in line]
    assert len(wide_loads) >= (2 if residual else 1) and len(wide_stores) >= 2, "a bf16 row read or written a value at a time"


def test_the_output_conv_loads_its_input_16_bytes_at_a_time() -> None:
    """The decoder's last convolution reads its channels-contiguous input (channel stride 1, widths a multiple of 16)
    eight bf16 values at a time: the kernel is memory-bound, and the audio's widest tensor is its input."""
    signature = {**dict.fromkeys(("x_ptr", "weight_ptr", "bias_ptr", "out_ptr"), "*bf16"), "channels": "i32",
                 "length": "i32", "stride_xb": "i32", "stride_xc": "constexpr", "stride_xt": "i32"}
    constants = dict(stride_xc=1, TAPS=7, DILATION=1, BLOCK_T=conv_epilogue.OUTPUT_BLOCK_T,
                     BLOCK_C=conv_epilogue.OUTPUT_BLOCK_C, BIAS=True)
    lines = _ptx(conv_epilogue._output_conv_kernel, signature, constants, False, divisible=("channels",))
    assert [line for line in lines if "ld.global" in line and ".v4" in line], "the input read a value at a time"
