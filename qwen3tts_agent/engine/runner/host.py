"""Host-to-device copies that never stall the step loop.

CUDA copies from pageable host memory synchronise the stream first, which would make the engine thread
wait for the frame in flight; staging through pinned memory keeps the copy asynchronous. PyTorch's pinned
allocator holds a staging block until its copy has run, so callers may drop the host data at once.

Each upload costs the core's thread far more than its bytes (a pinned block from PyTorch's caching host
allocator, an event, the copy's launch; docs/performance.md has the profile), so the small arrays one operation
needs go up together (`upload_together`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch

HostData: TypeAlias = Sequence[float] | np.ndarray | torch.Tensor

# Each array's bytes start at a multiple of this in `upload_together`'s buffer: every dtype can view its own, and
# a kernel is handed a pointer as aligned as a fresh tensor's (Triton specialises its kernels on 16-byte alignment).
_ALIGN = 16


def upload(data: HostData, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`data` as a tensor of `dtype` on `device`, copied asynchronously when `device` is a GPU."""
    host = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_together(parts: Sequence[tuple[HostData, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Each `(data, dtype)` of `parts` as a tensor on `device`, all in one `upload`: their bytes packed into one
    host buffer, each at an aligned offset, and each result a view of its bytes in the device's copy."""
    hosts = [torch.as_tensor(data, dtype=dtype).contiguous() for data, dtype in parts]
    spans, size = [], 0
    for host in hosts:
        start = -(-size // _ALIGN) * _ALIGN
        size = start + host.numel() * host.element_size()
        spans.append(slice(start, size))
    packed = torch.empty(size, dtype=torch.uint8)
    for host, span in zip(hosts, spans, strict=True):
        packed[span] = host.reshape(-1).view(torch.uint8)
    copied = upload(packed, torch.uint8, device)
    return [copied[span].view(host.dtype).view(host.shape) for host, span in zip(hosts, spans, strict=True)]
