"""Prompts on the device (`Prefills`): pieces of many prompts in one padded forward, and voice heads kept for reuse.

The core decides what to prefill and when (its scheduler). This builds a piece's embeddings (`PromptBuilder`),
runs a batch of pieces as the CUDA graph of its bucket (one-token pieces behind a stored head as the talker's
Triton decode step in a staging cache, `StagingCache.prefill`; eagerly where no graph fits), and keeps
each voice's just prefilled head, the part of a prompt that depends only on the voice, in the prefix store
(`engine/runner/prefixes.py`): a later stream of that voice copies the head's keys and values instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import InvalidTextError
from ..messages import PromptSpec
from .cuda_graphs import GraphedPrefill, GraphedStagedPrefill, power_of_two_buckets
from .prefixes import PrefixCache
from .prompt import PromptBuilder
from .runner import ModelRunner, PrefillRow

logger = logging.getLogger(__name__)

# Prompts prefilled together in one batched forward: a batch costs the running streams about one frame.
MAX_PREFILL_ROWS = 16
# Voice prefixes (prompt heads) whose keys and values the runner keeps, and their longest (in positions): a
# head is ~10 positions, more with an instruction; longer ones are prefilled with every request.
PREFIX_ENTRIES = 16
PREFIX_MAX_POSITIONS = 64


def prefix_store_options(*, prefix_cache: bool, backend: str, staged_prefill: bool) -> dict[str, Any]:
    """The runner's options for a prefix store: the PyTorch runner keeps voice heads (`copy_prefix`); the other
    runners prefill every prompt's head."""
    if not prefix_cache or backend != "torch":
        return {}
    return dict(prefix_entries=PREFIX_ENTRIES, prefix_len=PREFIX_MAX_POSITIONS, staged_prefill=staged_prefill)


class Prefills:
    """Prompt pieces on the device: their rows, their batched forward, and the store of voice heads."""

    def __init__(
        self, runner: ModelRunner, prompts: PromptBuilder, *, graphed: bool, max_streams: int, kv_buckets: Sequence[int]
    ) -> None:
        self.runner = runner
        self.prompts = prompts
        entries = runner.prefix_entries
        self.prefixes = PrefixCache(entries, runner.prefix_len) if entries else None
        self.graphs: GraphedPrefill | None = None
        self.staged_graphs: GraphedStagedPrefill | None = None
        if graphed:
            self.graphs = GraphedPrefill(
                runner,
                power_of_two_buckets(min(MAX_PREFILL_ROWS, max_streams)),
                [t for t in (32, 64, 128, 256) if t <= runner.max_seq_len] or [runner.max_seq_len],
                [k for k in kv_buckets if k <= 512] or list(kv_buckets[:1]),
                max_tokens=2048,
            )
            if runner.staging is not None:
                self.staged_graphs = GraphedStagedPrefill(runner.staging, (16, 32, 64))

    def capture(self, progress: bool) -> None:
        """Capture the prompt graphs (on the core's thread); without the staged ones if they fail to capture."""
        if self.graphs is not None:
            self.graphs.capture(progress=progress)
        if self.staged_graphs is not None:
            try:
                self.staged_graphs.capture(progress=progress)
            except Exception:  # noqa: BLE001 - an optimisation: without it the prompt graphs do the same work
                logger.exception("staged prefill graphs failed to capture; one-token prompt pieces use the prompt graphs")
                self.staged_graphs = None
                self.runner.staging = None

    def copy_head(self, spec: PromptSpec, slot: int) -> int | None:
        """Copy the voice's head into `slot` if the store has it; its length in positions, else None."""
        entry = self.prefixes.get(self.prompts.head_key(spec)) if self.prefixes is not None else None
        if entry is None:
            return None
        self.runner.copy_prefix(entry.index, slot, entry.length)
        return entry.length

    def row(
        self, spec: PromptSpec, slot: int, position: int, *, head: bool, body_ids: list[int] | None, closed: bool
    ) -> tuple[PrefillRow, list[int]]:
        """A prompt piece for `slot` at cache `position`: the voice's head (if `head`) and the body built from
        `body_ids` (if given); with the text-track tokens the body leaves for after its prefill.
        InvalidTextError for a closed empty text or a prompt longer than the cache."""
        body = None
        if body_ids is not None:
            if closed and not body_ids:
                raise InvalidTextError("text is empty")
            body = self.prompts.body(spec, body_ids, closed)
        parts = [p for p in (self.prompts.head(spec) if head else None, body.embeds if body else None) if p is not None]
        embeds = torch.cat(parts) if len(parts) > 1 else parts[0]
        needed = position + embeds.shape[0]
        if needed >= self.runner.max_seq_len:
            raise InvalidTextError(
                f"the prompt needs {needed} positions; this engine holds {self.runner.max_seq_len} "
                "(shorten the text or raise max_seq_len)"
            )
        return PrefillRow(slot, position, embeds, body is not None), body.trailing_ids if body is not None else []

    def run(self, rows: list[PrefillRow]) -> None:
        """Prefill `rows` together: their graph where one fits, else eagerly."""
        runner, staging, staged = self.runner, self.runner.staging, self.staged_graphs
        if staging is not None and staging.fits(rows):
            # one-token pieces (after a prefix from the store): the Triton decode step
            if staged is None or not staged.captured or not staged(rows):
                staging.prefill(rows)
        else:
            graphs = self.graphs
            if graphs is None or not graphs.captured or not graphs(rows):
                runner.prefill(rows)

    def keep_head(self, spec: PromptSpec, slot: int) -> None:
        """Keep the head just prefilled in `slot` in the prefix store, if its voice has no entry yet."""
        if self.prefixes is None:
            return
        entry = self.prefixes.claim(self.prompts.head_key(spec), self.prompts.head(spec).shape[0])
        if entry is not None:
            self.runner.store_prefix(slot, entry.index, entry.length)
