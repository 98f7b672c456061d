"""Exact streaming decoder for the 12 Hz speech tokenizer: codes in, 24 kHz audio out, state kept per slot.

The official decoder (`Qwen3TTSTokenizerV2Decoder`) is causal end to end, so the audio of a prefix is the
prefix of the audio. The official `chunked_decode` re-decodes 25 frames of left context instead, which is
inexact: the transformer alone reaches 8 x 71 frames back. Here every piece of state the next frame needs is
carried per slot, so a chunk costs work proportional to its own frames:

- each causal conv keeps its last (kernel - 1) * dilation input samples; zeros after a reset are exactly the
  official left zero padding;
- each causal transposed conv keeps its last ceil(kernel / stride) - 1 input samples, the inputs whose
  overlap-add reaches into the next outputs (none for the kernel == stride upsamplers);
- each transformer layer keeps the rotated keys and values of its last sliding_window - 1 frames, and the
  slot keeps its frame count, because the official forward numbers frames 0..T-1 for RoPE.

Shapes depend only on the call's (slots, frames), never on a stream's history, and state moves through
index_select / index_copy_ on a slot tensor, so one call can be captured as a CUDA graph per bucket.

On a GPU the transformer runs as `codec_transformer.FusedCodecTransformer` (about ten launches a layer instead
of sixty; equal to the official layers to float rounding) on the same state, and the audio half's elementwise work
as one kernel after each convolution (`kernels.conv_epilogue`: the bias, the residual and the SnakeBeta
activation, written straight into the next convolution's input behind its history), the same roundings as the
modules' kernels.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import codec_layer, conv_epilogue
from ...kernels import common as kernel_common
from ...kernels import history as history_kernel
from ...models.compat import OfficialModule
from ..runner import upload
from .codebooks import CodebookTables
from .codec_transformer import FusedCodecTransformer


class SlotHistory:
    """The most recent input steps of one causal op, per slot, along time dimension `dim`.

    A convolution's history ([slots, channels, steps], time last) is continued by one Triton kernel where it
    runs (`kernels.history`), instead of a gather, a concatenation and a scatter."""

    def __init__(self, buffer: torch.Tensor, dim: int) -> None:
        self.buffer = buffer
        self.dim = dim
        self.size = buffer.shape[dim]
        self.fused = buffer.dim() == 3 and dim in (-1, 2) and bool(history_kernel.supports(buffer))  # on the kernel

    def extend(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Return the slots' history followed by `x`, and keep the newest `size` steps as the new history."""
        if self.size == 0:
            return x
        if self.fused:
            return history_kernel.extend_history(self.buffer, slots, x)
        full = torch.cat([self.buffer.index_select(0, slots), x], dim=self.dim)
        length = full.shape[self.dim]
        self.buffer.index_copy_(0, slots, full.narrow(self.dim, length - self.size, self.size))
        return full

    def room(self, batch: int, steps: int) -> torch.Tensor:
        """An uninitialised [B, C, size + steps] for `complete`, in the buffer's layout (channels contiguous where
        its are): the caller writes a chunk into its last steps."""
        return kernel_common.empty_bct(batch, self.buffer.shape[1], self.size + steps, like=self.buffer)

    def complete(self, slots: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """`extend` for a chunk already written into the last steps of `full` (from `room`): the history kernel
        writes the slots' histories before it and keeps the newest steps, without copying the chunk."""
        if self.size:
            history_kernel.complete_history(self.buffer, slots, full)
        return full


def rotate_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the official `apply_rotary_pos_emb` (rotate-half layout); x [B, H, T, D], cos/sin [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Convolutions dilated this much run as one undilated convolution over the dilation's interleaved phases
# (`phase_split_conv`): cuDNN runs some such shapes on a slow generic kernel (benchmarks/kernels/bench_codec_convs.py).
PHASE_SPLIT_MIN_DILATION = 9
# The same from this dilation on the channels-last path, where cuDNN ran the dilation-3 convolutions of some batch
# shapes on a direct kernel some fifty times slower than the time-contiguous form (docs/gpu.md, "Codec convolutions").
CHANNELS_LAST_PHASE_SPLIT_MIN_DILATION = 3


def phase_split_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """conv(x) for a stride-1, ungrouped conv with dilation d, as one undilated conv over d phases, time contiguous
    (a slice in time of a longer tensor).

    Output t = p + d·j reads inputs p + d·(j + k), so phase p of the input (every d-th sample from p) is an
    ordinary convolution's input: the phases go into the batch, and their outputs interleave back. The sums
    are the same; only their order inside the convolution kernel may differ.
    """
    d, k = conv.dilation[0], conv.kernel_size[0]
    batch, channels, length = x.shape
    out_len = length - (k - 1) * d
    steps = -(-out_len // d) + k - 1  # per phase, padded so that every phase has whole outputs
    phases = F.pad(x, (0, d * steps - length)).view(batch, channels, steps, d)
    phases = phases.permute(0, 3, 1, 2).reshape(batch * d, channels, steps)
    y = F.conv1d(phases, conv.weight, conv.bias)  # [batch * d, out, steps - k + 1]
    y = y.view(batch, d, y.shape[1], -1).permute(0, 2, 3, 1).reshape(batch, y.shape[1], -1)
    return y[..., :out_len]


def channels_last_weight(conv: nn.Conv1d | nn.ConvTranspose1d) -> torch.Tensor:
    """`conv`'s weight as a 2-D convolution's over a height of one, channels contiguous (`channels_last_conv`)."""
    return conv.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)


def channels_last_conv(conv: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """conv(x) (padding 0, without the bias) on operands whose channels are contiguous: `x` [B, C, T] stored
    as [B, T, C], `weight` from `channels_last_weight`; the output likewise. cuDNN's tensor-core convolutions read
    and write this layout: handed time-contiguous tensors it transposes the input and the weights before every
    call and the output after it (docs/gpu.md, "Codec convolutions"). A 1-D convolution here is a 2-D one over a
    height of one, as PyTorch runs it, but given as such: `conv1d` makes its input time-contiguous first."""
    x4 = x.unsqueeze(2)
    if isinstance(conv, nn.ConvTranspose1d):
        y = F.conv_transpose2d(x4, weight, None, (1, conv.stride[0]), 0, 0, conv.groups, (1, conv.dilation[0]))
    else:
        y = F.conv2d(x4, weight, None, (1, conv.stride[0]), 0, (1, conv.dilation[0]), conv.groups)
    return y.squeeze(2)


def channels_last_phase_split_conv(conv: nn.Conv1d, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`phase_split_conv` without the bias on channels-contiguous operands (`channels_last_conv`), with no copy
    but the padding of time to whole phases (none where the outputs are a multiple of the dilation).

    Stored channels-last, `x` [B, C, T] is [B, T, C]; time padded to `steps` × d and read as [B, steps, d, C],
    it is a 2-D input [B, C, steps, d] in the channels-last layout whose width is the d phases. A (k, 1) kernel
    over it is the undilated convolution of every phase at once, and its output [B, out, steps - k + 1, d],
    channels-last too, is the outputs [B, T', out] already interleaved in time. (The form this replaces moved the
    phases into the batch and back: three copies of each operand.)"""
    d, k = conv.dilation[0], conv.kernel_size[0]
    batch, channels, length = x.shape
    out_len = length - (k - 1) * d
    steps = -(-out_len // d) + k - 1
    rows = x.transpose(1, 2)  # [B, T, C], a view of the channels-last storage
    if d * steps != length:
        rows = F.pad(rows, (0, 0, 0, d * steps - length))
    grid = rows.reshape(batch, steps, d, channels).permute(0, 3, 1, 2)  # [B, C, steps, d], channels-last strides
    # `weight` [out, C, 1, k] channels-last is stored as [out, k, C], as is its (k, 1) form
    y = F.conv2d(grid, weight.permute(0, 1, 3, 2))  # [B, out, steps - k + 1, d]
    y = y.permute(0, 2, 3, 1).reshape(batch, -1, y.shape[1])  # [B, T' rounded up to whole phases, out]
    return y[:, :out_len].transpose(1, 2)


class StreamingCodecDecoder:
    """Incremental `Qwen3TTSTokenizerV2Decoder` for many streams at once, equal to the full decode.

    Each stream owns a slot in `[0, max_streams)`. Call `reset(slot)` before a new stream, optionally
    `prime(slot, ref_codes)` for voice-clone reference codes, then `decode(slots, codes)` chunk by chunk.
    The concatenated chunks equal the official decoder's forward over all codes at once (to float rounding).
    State lives on the decoder's device and dtype (`device`, `dtype`); move the module before building this.
    Memory per slot: the transformer's keys and values over its sliding window and each conv's history
    (a few MB with the real shapes; `auto_max_streams` budgets for it).
    """

    def __init__(
        self, decoder: OfficialModule, max_streams: int, fused_transformer: bool | None = None,
        fused_audio: bool | None = None,
    ) -> None:
        """Allocate zeroed state for `max_streams` slots of the official decoder module `decoder`.

        `fused_transformer`: run the transformer on the `kernels.codec_layer` kernels (`FusedCodecTransformer`,
        equal to the official layers to float rounding); None: on a GPU where they take the transformer (not
        under Triton's interpreter, whose engine tests would take minutes longer: its own tests ask for it);
        True: required (ValueError if the kernels do not run here or refuse it); False: the official layers.
        `fused_audio`: the same choice for the audio half's epilogue kernels (`kernels.conv_epilogue`).
        """
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self._decoder = decoder
        self.max_streams = max_streams
        weight = decoder.pre_conv.conv.weight
        self.device = weight.device
        self.dtype = weight.dtype
        config = decoder.config
        self.num_quantizers: int = config.num_quantizers
        self._codebooks = CodebookTables(decoder.quantizer)  # the quantizer's decode, its tables computed once
        if self._codebooks.num_quantizers != self.num_quantizers:
            raise ValueError(f"the quantizer has {self._codebooks.num_quantizers} codebooks, the config {self.num_quantizers}")
        self.samples_per_frame = int(decoder.total_upsample)
        self._window = int(config.sliding_window)

        self._convs: dict[nn.Module, SlotHistory] = {}
        for module in decoder.modules():
            conv = getattr(module, "conv", None)
            if isinstance(conv, (nn.Conv1d, nn.ConvTranspose1d)):
                self._convs[module] = SlotHistory(
                    self._zeros(conv.in_channels, self._conv_history(conv)), dim=-1
                )

        transformer = decoder.pre_transformer
        self._kv: list[tuple[SlotHistory, SlotHistory]] = []
        for layer in transformer.layers:
            attn = layer.self_attn
            shape = (attn.k_proj.out_features // attn.head_dim, self._window - 1, attn.head_dim)
            self._kv.append((SlotHistory(self._zeros(*shape), dim=2), SlotHistory(self._zeros(*shape), dim=2)))
        self._positions = torch.zeros(max_streams, dtype=torch.long, device=self.device)
        self._fused: FusedCodecTransformer | None = None
        support = (
            codec_layer.supports_transformer(transformer) if kernel_common.available(self.device)
            else kernel_common.unsupported(f"no Triton kernels on {self.device.type}")
        )
        if fused_transformer and not support:
            raise ValueError(f"the fused codec transformer does not run here: {support.reason}")
        if support and (fused_transformer or (fused_transformer is None and self.device.type == "cuda")):
            self._fused = FusedCodecTransformer(transformer, [(k.buffer, v.buffer) for k, v in self._kv])
        # "triton", or "pytorch (why not)", as `runner.kernel_paths` reports a stack
        off = support.reason or "fused transformer off"
        self.transformer_path = "triton" if self._fused is not None else f"pytorch ({off})"
        self.prime_frames = self._audio_lookback()
        self._phase_split = self._splittable(self._convs, PHASE_SPLIT_MIN_DILATION)
        # the audio half: its convolutions, each with the bias, residual and activation after it
        self._stages = conv_epilogue.decoder_stages(decoder.decoder)
        self._last_conv = decoder.decoder[-1]
        audio_support = self._audio_support()
        if fused_audio and not audio_support:
            raise ValueError(f"the conv epilogue kernels do not run here: {audio_support.reason}")
        self._epilogues: list[conv_epilogue.ConvEpilogue] = []
        # on the epilogues' path the audio-rate convolutions run channels-last: their weights so, and their inputs,
        # which the epilogues write into the histories' rooms
        self._channels_last: dict[nn.Module, torch.Tensor] = {}
        self._output: conv_epilogue.OutputConv | None = None
        if audio_support and (fused_audio or (fused_audio is None and self.device.type == "cuda")):
            self._epilogues = [conv_epilogue.ConvEpilogue(stage.conv.conv, stage.activation) for stage in self._stages]
            self._output = conv_epilogue.OutputConv(self._last_conv.conv)
            self._channels_last = {stage.conv: channels_last_weight(stage.conv.conv) for stage in self._stages}
            self._phase_split |= self._splittable(self._channels_last, CHANNELS_LAST_PHASE_SPLIT_MIN_DILATION)
            # the histories of the convolutions whose inputs the epilogues write, channels contiguous (the first
            # stage's input comes from the upsampler, time contiguous)
            for module in [*(stage.conv for stage in self._stages[1:]), self._last_conv]:
                history = self._convs[module].buffer
                self._convs[module] = SlotHistory(history.transpose(1, 2).contiguous().transpose(1, 2), dim=-1)
        self.audio_path = "triton" if self._epilogues else f"pytorch ({audio_support.reason or 'fused audio off'})"

    @staticmethod
    def _splittable(modules: Iterable[nn.Module], min_dilation: int) -> set[nn.Module]:
        """The conv wrappers among `modules` whose convolution `phase_split_conv` takes, dilated at least this much."""
        return {
            module for module in modules
            if isinstance(module.conv, nn.Conv1d) and module.conv.dilation[0] >= min_dilation
            and module.conv.stride[0] == 1 and module.conv.groups == 1
        }

    def _audio_support(self) -> kernel_common.Support:
        """Whether the epilogue kernels take the audio half here: Triton runs, every stage is one the kernel takes,
        and the history kernel continues every convolution's input after one."""
        if not kernel_common.available(self.device):
            return kernel_common.unsupported(f"no Triton kernels on {self.device.type}")
        if not (support := conv_epilogue.supports_decoder(self._decoder.decoder)):
            return support
        refused = [stage for stage in self._stages if self._convs[stage.next_conv].size and not self._convs[stage.next_conv].fused]
        if refused:
            return kernel_common.unsupported(f"a history the history kernel refuses ({refused[0].next_conv.conv})")
        return kernel_common.SUPPORTED

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(self.max_streams, *shape, device=self.device, dtype=self.dtype)

    @staticmethod
    def _conv_history(conv: nn.Conv1d | nn.ConvTranspose1d) -> int:
        """Input samples a chunk's outputs share with earlier inputs."""
        kernel, stride, dilation = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
        if conv.padding[0] != 0:
            raise ValueError(f"unsupported conv in the codec decoder: {conv}")
        if isinstance(conv, nn.ConvTranspose1d):
            if dilation != 1 or conv.output_padding[0] != 0:
                raise ValueError(f"unsupported transposed conv in the codec decoder: {conv}")
            return -(-kernel // stride) - 1
        if stride != 1:
            # The official causal conv pads strided convs on the right too; the decoder has none.
            raise ValueError(f"strided causal conv is not streamable here: {conv}")
        return (kernel - 1) * dilation

    def _audio_lookback(self) -> int:
        """Frames of transformer output that fully determine the conv states after them.

        `prime` runs the audio-rate convs (nearly all of the decoder's cost) over only this many final
        frames; older frames cannot reach any carried state. A transposed conv's input index is the output
        index floored by its stride, so it counts one input sample more than its history.
        """
        decoder = self._decoder
        rate, frames = 1, Fraction(0)
        for module in itertools.chain(decoder.upsample.modules(), decoder.decoder.modules()):
            if module not in self._convs:
                continue
            history = self._convs[module].size
            if isinstance(module.conv, nn.ConvTranspose1d):
                frames += Fraction(history + 1, rate)
                rate *= module.conv.stride[0]
            else:
                frames += Fraction(history, rate)
        return math.ceil(frames)

    def reset(self, slot: int) -> None:
        """Start a new stream in `slot` (as if no frame had been decoded there)."""
        self._check_slot(slot)
        torch._foreach_zero_([h.buffer[slot] for h in self._histories()])  # one launch, not one per buffer
        self._positions[slot].zero_()  # not `= 0`: a copy from a host scalar waits for the stream

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """A copy of the slot's whole state, e.g. right after priming it with a voice's reference codes."""
        self._check_slot(slot)
        return [h.buffer[slot].clone() for h in self._histories()] + [self._positions[slot].clone()]

    def restore(self, slot: int, state: list[torch.Tensor]) -> None:
        """Put a `snapshot` back into `slot` (any slot): the same as resetting and priming it again."""
        self._check_slot(slot)
        *buffers, position = state
        if len(buffers) != len(self._histories()):
            raise ValueError("not a snapshot of this decoder")
        torch._foreach_copy_([h.buffer[slot] for h in self._histories()], buffers)  # one launch, not one per buffer
        self._positions[slot].copy_(position)

    def _histories(self) -> list[SlotHistory]:
        return [*self._convs.values(), *itertools.chain.from_iterable(self._kv)]

    @torch.no_grad()
    def prime(self, slot: int, codes: torch.Tensor) -> None:
        """Feed reference codes [T, num_quantizers] into `slot` (normally right after `reset`), without audio.

        Afterwards decoding the generated codes gives the tail of the full decode of reference + generated
        codes, which is what the official voice-clone path decodes and then cuts. Only the last
        `prime_frames` frames go through the audio-rate convs, so a long reference costs little more
        than a short one.
        """
        self._check_slot(slot)
        if codes.dim() != 2:
            raise ValueError(f"codes must be [frames, {self.num_quantizers}], got {tuple(codes.shape)}")
        slots = upload([slot], torch.int64, self.device)
        latent = self._latent(slots, self._check_codes(codes[None]))
        self._audio(slots, latent[..., -self.prime_frames :])

    @torch.no_grad()
    def decode(self, slots: torch.Tensor | Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        """Decode the next codes [B, T, num_quantizers] of streams `slots` (B distinct slots) into audio.

        Returns [B, T * samples_per_frame] in the decoder's dtype, clamped to [-1, 1] like the official
        decoder. A slot tensor (int64, on the device) is trusted as is, so that no host sync is needed;
        a list is checked.
        """
        codes = self._check_codes(codes)
        if isinstance(slots, torch.Tensor):
            if slots.shape != (codes.shape[0],):
                raise ValueError(f"slots must have shape [{codes.shape[0]}], got {tuple(slots.shape)}")
            slot_tensor = slots.to(self.device, torch.long)
        else:
            if len(slots) != codes.shape[0] or len(set(slots)) != len(slots):
                raise ValueError(f"need {codes.shape[0]} distinct slots, got {list(slots)}")
            for slot in slots:
                self._check_slot(slot)
            slot_tensor = upload(list(slots), torch.int64, self.device)
        return self._audio(slot_tensor, self._latent(slot_tensor, codes)).squeeze(1)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_streams:
            raise ValueError(f"slot {slot} is outside [0, {self.max_streams})")

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 3 or codes.shape[1] < 1 or codes.shape[2] != self.num_quantizers:
            raise ValueError(
                f"codes must be [batch, frames >= 1, {self.num_quantizers}], got {tuple(codes.shape)}"
            )
        return codes.to(self.device, torch.long)

    def _latent(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, T, Q] -> transformer output [B, latent, T] (the frame-rate half of the decoder)."""
        decoder = self._decoder
        hidden = self._codebooks.decode(codes)
        hidden = self._conv(decoder.pre_conv, hidden, slots)
        return self._transformer(hidden.transpose(1, 2), slots).transpose(1, 2)

    def _audio(self, slots: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Transformer output [B, latent, T] -> waveform [B, 1, T * samples_per_frame]."""
        decoder = self._decoder
        for upsample, convnext in decoder.upsample:
            hidden = self._convnext(convnext, self._conv(upsample, hidden, slots), slots)
        if self._epilogues:
            return self._audio_on_epilogues(slots, hidden)
        residual = hidden  # replaced by the first upsampling's output before any stage adds it
        for stage in self._stages:  # the modules' own ops, as the official forward runs them
            total = self._conv(stage.conv, hidden, slots)
            if stage.adds_residual:
                total = total + residual
            if stage.keeps_sum:
                residual = total
            hidden = stage.activation(total)
        return self._conv(self._last_conv, hidden, slots).clamp(min=-1, max=1)

    def _audio_on_epilogues(self, slots: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`_audio`'s stages with each convolution's bias, residual and activation in its epilogue kernel, which
        writes the next convolution's input straight behind the room for that convolution's history."""
        full = self._convs[self._stages[0].conv].extend(slots, hidden)
        residual = hidden  # as in `_audio`
        for stage, epilogue in zip(self._stages, self._epilogues, strict=True):
            raw = self._chunk_out(stage.conv, self._channels_last_conv(stage.conv, full), full.shape[-1])
            history = self._convs[stage.next_conv]
            full = history.room(raw.shape[0], raw.shape[-1])
            total = epilogue(
                raw, full[..., history.size :], residual if stage.adds_residual else None, keep_sum=stage.keeps_sum,
            )
            if total is not None:
                residual = total
            history.complete(slots, full)
        assert self._output is not None  # built with the epilogues
        return self._output(full)

    def _conv(self, module: OfficialModule, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One official causal (transposed) conv wrapper, continued from the slots' input history."""
        conv = module.conv
        full = self._convs[module].extend(slots, x)
        y = phase_split_conv(conv, full).contiguous() if module in self._phase_split else conv(full)
        return self._chunk_out(module, y, full.shape[-1])

    def _channels_last_conv(self, module: OfficialModule, full: torch.Tensor) -> torch.Tensor:
        """The convolution of `full` (a history and a chunk) without its bias, channels contiguous."""
        conv, weight = module.conv, self._channels_last[module]
        if module in self._phase_split:
            return channels_last_phase_split_conv(conv, full, weight)
        return channels_last_conv(conv, full, weight)

    def _chunk_out(self, module: OfficialModule, y: torch.Tensor, length: int) -> torch.Tensor:
        """The outputs of a chunk's convolution `y` over `length` input steps (history and chunk) that are new:
        all of an ordinary convolution's; a transposed one's outputs of the history samples are already out, and
        those past the chunk wait for the next input."""
        conv = module.conv
        if not isinstance(conv, nn.ConvTranspose1d):
            return y
        stride, history = conv.stride[0], self._convs[module].size
        return y[..., history * stride : length * stride]

    def _convnext(self, block: OfficialModule, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        hidden = self._conv(block.dwconv, x, slots).transpose(1, 2)
        hidden = block.pwconv2(block.act(block.pwconv1(block.norm(hidden))))
        return x + (block.gamma * hidden).transpose(1, 2)

    def _transformer(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Sliding-window transformer over [B, T, latent], continuing each slot's keys, values and positions."""
        transformer = self._decoder.pre_transformer
        frames = x.shape[1]
        start = self._positions.index_select(0, slots)
        steps = torch.arange(frames, device=self.device)
        hidden = transformer.input_proj(x)
        cos, sin = transformer.rotary_emb(hidden, start[:, None] + steps)  # [B, T, head_dim]

        # Key j of [history (window - 1 frames), chunk] is frame start - (window - 1) + j. Query t sees the
        # window keys t..t + window - 1, minus those before the stream began (history not yet filled).
        keys = torch.arange(self._window - 1 + frames, device=self.device)
        offset = keys[None, :] - steps[:, None]
        band = (offset >= 0) & (offset < self._window)
        started = keys[None, :] >= (self._window - 1) - start[:, None]
        mask = (band[None] & started[:, None, :]).unsqueeze(1)

        if self._fused is not None:
            out = self._fused(hidden, cos, sin, mask, slots)
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            for layer, kv in zip(transformer.layers, self._kv, strict=True):
                attended = self._attend(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask, slots, kv)
                hidden = hidden + layer.self_attn_layer_scale(attended)
                hidden = hidden + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(hidden)))
            out = transformer.output_proj(transformer.norm(hidden))
        self._positions.index_copy_(0, slots, start + frames)
        return out

    @staticmethod
    def _attend(
        attn: OfficialModule,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        slots: torch.Tensor,
        kv: tuple[SlotHistory, SlotHistory],
    ) -> torch.Tensor:
        batch, frames, _ = x.shape
        shape = (batch, frames, -1, attn.head_dim)
        query = rotate_rope(attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2), cos, sin)
        key = rotate_rope(attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2), cos, sin)
        value = attn.v_proj(x).view(shape).transpose(1, 2)
        key = kv[0].extend(slots, key)
        value = kv[1].extend(slots, value)
        if attn.num_key_value_groups > 1:
            key = key.repeat_interleave(attn.num_key_value_groups, dim=1)
            value = value.repeat_interleave(attn.num_key_value_groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(batch, frames, -1))
