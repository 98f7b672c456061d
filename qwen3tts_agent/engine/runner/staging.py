"""The staging cache (`StagingCache`): one-token prompt pieces run as the talker's Triton decode step.

A prompt whose voice head came from the prefix store (`ModelRunner.copy_prefix`) has a text-dependent part of
one token for CustomVoice, x-vector clones and VoiceDesign. The prompt path would pad it into a batched
forward on the PyTorch layers; the decode step runs it in a few kernels a layer, but it reads and writes the
cache rows 0..b-1 of the batch, not the slots of the pieces. So each piece's slot positions are copied into a
staging row, the step runs over the staging rows, and the one position each row wrote goes back to its slot.
The staging cache is the runner's (`ModelRunner.staging`); it exists only where the talker runs as the
kernels and a prefix store is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ...kernels import common as kernel_common
from ...kernels import decode_layer
from .host import upload
from .layers import FusedDecoderLayer
from .prompt import PrefillRow

# Rows of the staging cache: one-token pieces prefilled together (`StagingCache.prefill`)
STAGE_ROWS = 4


class StagedTalker(Protocol):
    """What the staging cache reads of the runner that owns it (`ModelRunner`): the talker's layers, final
    norm and RoPE tables, its slot cache, and how a prefill ends."""

    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    prefix_len: int
    kv_cache: torch.Tensor  # [2, layers, slots, kv_heads, positions, head_dim]
    layers: list[FusedDecoderLayer]
    cos: torch.Tensor
    sin: torch.Tensor
    norm: Any  # the official talker's final RMSNorm

    def finish_prefill(self, rows: Sequence[PrefillRow], last_hidden: torch.Tensor) -> None: ...


class StagingCache:
    """KV rows beside the runner's slot cache, in which one-token prompt pieces run as the decode step."""

    def __init__(self, runner: StagedTalker, max_rows: int = STAGE_ROWS) -> None:
        """Room for pieces behind any stored prefix (`runner.prefix_len` positions, then the piece's own)."""
        self.runner = runner
        self.max_rows = max_rows
        # the positions a row's token may sit at; column `length` is where padding rows write
        self.length = runner.prefix_len + 1
        # the slot cache's layout [2, layers, rows, kv_heads, positions, head_dim], with rows of its own
        pair, n_layers, _, kv_heads, _, head_dim = runner.kv_cache.shape
        shape = (pair, n_layers, max_rows, kv_heads, self.length + 1, head_dim)
        self.kv = torch.zeros(shape, device=runner.device, dtype=runner.dtype)
        # prompts run on a lane of their own beside the frame steps: their kernels count arrivals apart
        self._counters = kernel_common.new_counters(runner.device)

    def fits(self, rows: Sequence[PrefillRow]) -> bool:
        """Whether `prefill` takes these prompt pieces: one token each, within the staging cache."""
        return (
            0 < len(rows) <= self.max_rows
            and all(r.embeds.shape[0] == 1 and r.start < self.length for r in rows)
        )

    @torch.inference_mode()
    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        """`ModelRunner.prefill` for one-token pieces (the text-dependent part of a prompt whose head came
        from the prefix store) as the Triton decode step: eagerly; `cuda_graphs.GraphedStagedPrefill`
        replays it."""
        embeds, write_pos = self.inputs(rows, len(rows))
        kv_len = max(r.start for r in rows) + 1
        self.finish(rows, self.forward(embeds, write_pos, kv_len=kv_len))

    def inputs(self, rows: Sequence[PrefillRow], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy each row's cache positions [0, start) into staging row i and pad the pieces to `batch` rows:
        (embeds [batch, 1, hidden], write positions [batch, 1]). Padding rows write to the staging cache's
        last column."""
        if not self.fits(rows) or batch > self.max_rows:
            raise ValueError("these prompt pieces do not fit the staging cache")
        runner = self.runner
        write_pos = [r.start for r in rows] + [self.length] * (batch - len(rows))
        for i, r in enumerate(rows):
            if r.start:
                self.kv[:, :, i, :, : r.start].copy_(runner.kv_cache[:, :, r.slot, :, : r.start])
        embeds = torch.zeros(batch, 1, runner.hidden_size, device=runner.device, dtype=runner.dtype)
        embeds[: len(rows), 0] = torch.cat([r.embeds for r in rows])
        return embeds, upload(write_pos, torch.int64, runner.device).view(batch, 1)

    def forward(self, embeds: torch.Tensor, write_pos: torch.Tensor, *, kv_len: int) -> torch.Tensor:
        """The talker's layers as the Triton decode step over staging rows [0, b), each token attending its
        row's keys up to its own position; returns the last hidden states [b, hidden] after the final norm.
        Fixed shapes for a given (b, kv_len) and no host synchronisation, so it can be captured."""
        runner = self.runner
        b = embeds.shape[0]
        x = embeds
        with kernel_common.own_counters(self._counters):  # not the frame step's: they may run together
            x = decode_layer.decode_layers(
                runner.layers, self.kv[0, :, :b].unbind(0), self.kv[1, :, :b].unbind(0), x, runner.cos, runner.sin,
                write_pos, kv_len, masked=True,
            )
        return runner.norm(x[:, 0])

    def finish(self, rows: Sequence[PrefillRow], last_hidden: torch.Tensor) -> None:
        """Copy the position each staging row wrote back to its slot (the slot holds the ones before), then
        `ModelRunner.finish_prefill`."""
        runner = self.runner
        for i, r in enumerate(rows):
            runner.kv_cache[:, :, r.slot, :, r.start].copy_(self.kv[:, :, i, :, r.start])
        runner.finish_prefill(rows, last_hidden)
