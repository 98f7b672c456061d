"""Triton kernels that end a predictor step and a talker step: the sampling plus the frame's per-row state.

Between its decoder layers a frame needs, per row: sample a code, look up its embedding (the next predictor
input), sum the frame's 16 code embeddings, add the text track's next embedding, choose the talker's cache
write position, and record the new codebook-0 token in the slot's state. As PyTorch ops that is about a
hundred small kernels a frame, each paying its launch latency even inside a CUDA graph; here it is one launch
per sampling (16 a frame), each started early under programmatic dependent launch like the layer kernels
(`decode_layer.py`).

`engine.runner.ModelRunner` keeps the same state in PyTorch ops where these kernels do not run;
tests/kernels/test_frame_kernels.py checks that both leave the same state.
"""

from __future__ import annotations

import torch

from . import common
from .common import jit, round_to
from .decode_layer import late_qkv_trigger
from .sampling import sample_row, sampling_shapes

try:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # keeps the module importable without triton; common.available() reports False
    pass

# Warps per sampling program, chosen from whole graphed frames (benchmarks/engine/frame_timeline.py): the talker's
# sort of 4096 int64 keys and the predictor's of 2048 int32 keys run on one SM each, and more warps
# shorten them; alone, outside a frame, the warp count made little difference (benchmarks/kernels/bench_sampling.py).
TALKER_CODE0_WARPS = 16
PREDICTOR_CODE_WARPS = 8


def supports(dtype: torch.dtype) -> common.Support:
    """Any hidden width and vocabulary; a model dtype the kernels are tested in."""
    return common.dtype_support(dtype)


@jit
def _predictor_code_kernel(
    logits_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, n_sampled_ptr,
    code0_ptr, codes_ptr, table_ptr, step_input_ptr, first_embed_ptr, sum_ptr,
    talker_input_ptr, text_ptr, pad_ptr, step_idx_ptr, text_len_ptr, active_ptr, pos_ptr, write_pos_ptr,
    stride_logits, stride_codes, stride_first, stride_text, text_tokens, spare_pos, code, groups,
    H: tl.constexpr, HP: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    KEY32: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Row r: draw code `code` (1..15) of the frame, make its embedding the next predictor input and add it to
    the frame's fp32 embedding sum; FIRST also records codebook 0 and starts the sum from its embedding; LAST
    writes the talker's input (the rounded sum plus the text track's embedding at the slot's step, or the pad
    embedding past the text) and write position (the slot's position, or the spare column when inactive).
    PREFETCH (with PDL): the row's scalars are loaded before the wait for the logits (see `predictor_code`)."""
    if PDL and not PREFETCH:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    do_sample = tl.load(do_sample_ptr + row) != 0
    temperature, top_k, top_p = tl.load(temperature_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    counter = (tl.load(n_sampled_ptr + row) - 1) * groups + code
    if FIRST:
        code0 = tl.load(code0_ptr + row)
    if LAST:
        step = tl.load(step_idx_ptr + row)
        has_text = step < tl.load(text_len_ptr + row)
        write_pos = tl.where(tl.load(active_ptr + row) != 0, tl.load(pos_ptr + row), spare_pos)
    if PDL and PREFETCH:
        gdc_launch_dependents()
        gdc_wait()
    token = sample_row(
        logits_ptr + row * stride_logits, do_sample, temperature, top_k, top_p, seed, counter,
        logits_ptr, 1.0, logits_ptr, -1, False, V, VP, K, KP, False, False, False, KEY32, LIBDEVICE,
    )
    tl.store(codes_ptr + row * stride_codes + code, token)
    h = tl.arange(0, HP)
    h_ok = h < H
    embed = tl.load(table_ptr + token * H + h, mask=h_ok, other=0.0)
    tl.store(step_input_ptr + row * H + h, embed, mask=h_ok)
    if FIRST:
        tl.store(codes_ptr + row * stride_codes, code0)
        total = tl.load(first_embed_ptr + row * stride_first + h, mask=h_ok, other=0.0).to(tl.float32)
    else:
        total = tl.load(sum_ptr + row * H + h, mask=h_ok, other=0.0)
    total += embed.to(tl.float32)
    if LAST:
        if has_text:
            text = tl.load(text_ptr + row * stride_text + tl.minimum(step, text_tokens - 1) * H + h, mask=h_ok, other=0.0)
        else:
            text = tl.load(pad_ptr + h, mask=h_ok, other=0.0)
        dt = talker_input_ptr.dtype.element_ty
        tl.store(talker_input_ptr + row * H + h, (round_to(total, dt) + text.to(tl.float32)).to(dt), mask=h_ok)
        tl.store(write_pos_ptr + row, write_pos)
    else:
        tl.store(sum_ptr + row * H + h, total, mask=h_ok)


@jit
def _talker_code0_kernel(
    logits_ptr, slots_ptr, act_ptr, hidden_ptr, norm_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr,
    seed_ptr, n_sampled_ptr, forbid_eos_ptr, penalty_ptr, seen_ptr, suppress_ptr, code0_ptr, first_input_ptr,
    table_ptr, pos_ptr, step_idx_ptr, finished_ptr,
    stride_logits, stride_hidden, stride_seen, stride_first, stride_finished, eos_id, groups, eps,
    H: tl.constexpr, HP: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    NORM: tl.constexpr, FRAME: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Row i (slot slots[i]): draw the next codebook-0 token with the talker's processors; where act[i], record
    it (code0, seen, n_sampled) and write the slot's first predictor input: the talker's final hidden state
    (RMSNorm of `hidden` when NORM, rounded as the official module rounds) and the token's embedding. FRAME (a
    frame step, not a prompt's end) also advances position and text step and sets `finished` on EOS.
    PREFETCH (with PDL): the row's scalars are loaded before the wait for the logits (see `predictor_code`)."""
    if PDL and not PREFETCH:
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    n_sampled = tl.load(n_sampled_ptr + slot)
    do_sample = tl.load(do_sample_ptr + slot) != 0
    temperature, top_k, top_p = tl.load(temperature_ptr + slot), tl.load(top_k_ptr + slot), tl.load(top_p_ptr + slot)
    seed, penalty = tl.load(seed_ptr + slot), tl.load(penalty_ptr + slot)
    eos_blocked = (n_sampled < 2) | (tl.load(forbid_eos_ptr + slot) != 0)
    act = tl.load(act_ptr + i) != 0
    if PDL and PREFETCH:
        gdc_launch_dependents()
        gdc_wait()
    token = sample_row(
        logits_ptr + i * stride_logits, do_sample, temperature, top_k, top_p, seed, n_sampled * groups,
        seen_ptr + slot * stride_seen, penalty, suppress_ptr, eos_id, eos_blocked, V, VP, K, KP, True, True, True, False,
        LIBDEVICE,
    )
    if FRAME:
        tl.store(finished_ptr + slot * stride_finished, (act & (token == eos_id)).to(tl.int64))
    if act:
        tl.store(code0_ptr + slot, token)
        tl.store(seen_ptr + slot * stride_seen + token, 1)
        tl.store(n_sampled_ptr + slot, n_sampled + 1)
        if FRAME:
            tl.store(pos_ptr + slot, tl.load(pos_ptr + slot) + 1)
            tl.store(step_idx_ptr + slot, tl.load(step_idx_ptr + slot) + 1)
        h = tl.arange(0, HP)
        h_ok = h < H
        x = tl.load(hidden_ptr + i * stride_hidden + h, mask=h_ok, other=0.0)
        dt = x.dtype
        if NORM:  # the official RMSNorm: x * rsqrt(mean(x²) + eps) in fp32, to the model dtype, times the gains
            xf = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
            x = (tl.load(norm_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * round_to(xf * rstd, dt)).to(dt)
        first = first_input_ptr + slot * stride_first + h
        tl.store(first, x, mask=h_ok)
        tl.store(first + H, tl.load(table_ptr + token * H + h, mask=h_ok, other=0.0), mask=h_ok)


def predictor_code(
    logits: torch.Tensor,
    code: int,
    table: torch.Tensor,
    state: dict[str, torch.Tensor],
    cap: int,
    *,
    spare_pos: int,
) -> None:
    """Draw code `code` (1..num_groups-1) for rows [0, b) from logits [b, V] and update the frame state.

    `state` holds the runner's slot tensors ([max_slots, ...], rows = slots): the sampling parameters
    (sub_do_sample, sub_temperature, sub_top_k, sub_top_p, seed), n_sampled, code0, frame_codes, and the
    step buffers p_step_input [H], p_input [2, H], embed_sum (fp32 [H]), talker_input [H], text_embeds
    [T, H], pad_embed [H], step_idx, text_len, active, pos, write_pos.

    With few rows the scalars (sampling parameters, counters, positions) are loaded before the wait for
    the logits: they were set by the host or by kernels before this frame's last layer, and that layer's
    QKV product let the kernels after it start only once its own inputs were complete
    (`decode_layer.late_qkv_trigger`).
    """
    b, vocab = logits.shape
    groups, hidden = state["frame_codes"].shape[1], table.shape[1]
    if not 1 <= code < groups or logits.stride(1) != 1 or not table.is_contiguous():
        raise ValueError("code must be 1..num_groups-1, logits contiguous along the vocabulary, the table contiguous")
    text, p_input = state["text_embeds"], state["p_input"]
    _predictor_code_kernel[(b,)](
        logits, state["sub_do_sample"], state["sub_temperature"], state["sub_top_k"], state["sub_top_p"], state["seed"],
        state["n_sampled"], state["code0"], state["frame_codes"], table, state["p_step_input"], p_input[:, 1],
        state["embed_sum"], state["talker_input"], text, state["pad_embed"], state["step_idx"], state["text_len"],
        state["active"], state["pos"], state["write_pos"],
        logits.stride(0), state["frame_codes"].stride(0), p_input.stride(0), text.stride(0), text.shape[1], spare_pos,
        code, groups,
        H=hidden, HP=common.next_power_of_2(hidden), **sampling_shapes(vocab, cap, logits.dtype == torch.bfloat16),
        FIRST=code == 1, LAST=code == groups - 1, LIBDEVICE=not common.interpreting(), num_warps=PREDICTOR_CODE_WARPS,
        PREFETCH=late_qkv_trigger(b, 2 if code == 1 else 1), **common.pdl_options(logits.device),  # after the 2-token step
    )


def talker_code0(
    logits: torch.Tensor,
    slots: torch.Tensor,
    act: torch.Tensor,
    hidden: torch.Tensor,
    state: dict[str, torch.Tensor],
    cap: int,
    *,
    eos_id: int,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    frame: bool,
) -> None:
    """Draw the next codebook-0 token of `slots` (int64 [n]) from logits [n, V] and record it where `act`.

    hidden [n, H]: the talker's last hidden state, before its final norm when `norm` (gains [H]) is given.
    `state` as in `predictor_code`, plus do_sample, temperature, top_k, top_p, forbid_eos,
    repetition_penalty, seen, suppress, codec_embedding (the [V, H] table), finished (int64 [slots], strided).
    `frame`: a frame step (advances pos and step_idx, sets finished) rather than the end of a prompt.
    """
    n, vocab = logits.shape
    table = state["codec_embedding"]
    h = table.shape[1]
    if slots.shape != (n,) or act.shape != (n,) or hidden.shape != (n, h) or logits.stride(1) != 1 or hidden.stride(1) != 1:
        raise ValueError("logits [n, V], slots and act [n], hidden [n, H], contiguous along the last dimension")
    shapes = sampling_shapes(vocab, cap, bf16_logits=False)  # the repetition penalty makes fp32 scores
    del shapes["KEY32"]
    _talker_code0_kernel[(n,)](
        logits, slots, act, hidden, norm if norm is not None else hidden, state["do_sample"], state["temperature"],
        state["top_k"], state["top_p"], state["seed"], state["n_sampled"], state["forbid_eos"], state["repetition_penalty"],
        state["seen"], state["suppress"], state["code0"], state["p_input"], table, state["pos"], state["step_idx"],
        state["finished"],
        logits.stride(0), hidden.stride(0), state["seen"].stride(0), state["p_input"].stride(0), state["finished"].stride(0), eos_id,
        state["frame_codes"].shape[1], eps,
        H=h, HP=common.next_power_of_2(h), **shapes, NORM=norm is not None, FRAME=frame, LIBDEVICE=not common.interpreting(),
        num_warps=TALKER_CODE0_WARPS, PREFETCH=frame and late_qkv_trigger(n), **common.pdl_options(logits.device),
    )
