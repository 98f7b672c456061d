"""Host-to-device copies that never stall the step loop.

CUDA copies from pageable host memory synchronise the stream first, which would make the engine thread
wait for the frame in flight; staging through pinned memory keeps the copy asynchronous. PyTorch's pinned
allocator holds a staging block until its copy has run, so callers may drop the host data at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(data: Sequence[float] | np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` as a tensor of `dtype` on `device`, copied asynchronously when `device` is a GPU."""
    host = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
