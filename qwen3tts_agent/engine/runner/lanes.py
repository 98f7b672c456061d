"""The CUDA stream priorities of the engine's lanes of device work.

Work on the way to a new stream's first audio (its prompt, its first chunk's decode) goes first, the frame
steps next, the later chunks' decodes last. A priority only decides which stream's waiting thread blocks an
SM takes next; it never stops a running kernel. So a prompt or a first chunk, whose kernels are few and
small, overtakes the blocks of a step's products instead of queueing behind them, and the codec lane's
large decodes fill the SMs the steps leave idle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LanePriorities:
    """CUDA stream priorities (lower numbers run first) for the three kinds of device work."""

    urgent: int  # prompts and first chunks
    steps: int  # the batched frame steps
    background: int  # later chunks' decodes

    @classmethod
    def of_device(cls) -> LanePriorities:
        """Three levels where the device has them; with only two, the steps share the urgent level."""
        least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a staticmethod, typed as a method
        between = greatest + 1 if greatest + 1 < least else greatest
        return cls(urgent=greatest, steps=between, background=least)
