"""What every kernel module of the package shares: the Triton import guard, launch options, Triton helpers.

Nothing here is a kernel. The modules beside this one import these public names and nothing private of each
other, so each kernel family can be read, tested and replaced on its own.

Programmatic dependent launch (PDL, Hopper and later): a kernel may start while the one before it still
runs and load, before its wait (`gdc_wait`), whatever no kernel in flight writes. CUDA-graph capture keeps
the launches' dependency type, so a graphed frame overlaps its kernels the same way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # keeps the package importable on installs without triton; available() reports False
    triton = None

# Programmatic dependent launch: None = on where the GPU has it (compute capability 9.0 and up); False = off
# (an A/B switch for benchmarks: set it before the first launch, graphs captured earlier keep their launches).
PROGRAMMATIC_LAUNCH: bool | None = None
# One arrival counter per (row, kv head) of an attention launch or per GEMV output tile: far more than any
# layer needs (`counters`).
COUNTER_SLOTS = 1 << 16
# The SM count assumed off the GPU (the interpreter): an H200's, so that grids split as they would there.
INTERPRETED_SM_COUNT = 132
# The dtypes the kernels are tested in (fp32 exactly against the PyTorch layers, bf16 within rounding).
TESTED_DTYPES = (torch.float32, torch.bfloat16)

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OWN_COUNTERS = threading.local()  # `own_counters`: this thread's launches use these instead


def jit(fn: Callable) -> Any:
    """`triton.jit`, or the plain function where triton is missing (the module stays importable)."""
    return triton.jit(fn) if triton is not None else fn


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 when they were decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """True when the kernels can run on `device`: triton imports and the device is CUDA (or interpreted)."""
    return triton is not None and (torch.device(device).type == "cuda" or interpreting())


@dataclass(frozen=True)
class Support:
    """Whether a kernel family takes some shapes, and if not, why (a short phrase for logs and stats)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


def unsupported(reason: str) -> Support:
    return Support(False, reason)


def dtype_support(dtype: torch.dtype) -> Support:
    """The kernels are exercised in fp32 and bf16 only; other dtypes go to PyTorch."""
    if dtype in TESTED_DTYPES:
        return SUPPORTED
    return unsupported(f"dtype {str(dtype).removeprefix('torch.')} not supported")


def empty_bct(batch: int, channels: int, steps: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [batch, channels, steps] on `like`'s device, in its dtype and layout: channels contiguous
    in memory ([batch, steps, channels], as channels-last convolutions read and write) where `like`'s are, else
    time steps."""
    if channels > 1 and like.stride(1) == 1:
        return torch.empty(batch, steps, channels, device=like.device, dtype=like.dtype).transpose(1, 2)
    return torch.empty(batch, channels, steps, device=like.device, dtype=like.dtype)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; INTERPRETED_SM_COUNT off the GPU."""
    return _cuda_sm_count(device) if device.type == "cuda" else INTERPRETED_SM_COUNT


@functools.cache
def _cuda_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def device_name(device: torch.device) -> str:
    """The name torch reports for a CUDA device (e.g. "NVIDIA H200"); "" elsewhere. Keys the tuned tables."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def programmatic_launch(device: torch.device) -> bool:
    """Whether the kernels launch on `device` with programmatic dependent launch (see PROGRAMMATIC_LAUNCH)."""
    if device.type != "cuda" or interpreting() or PROGRAMMATIC_LAUNCH is False:
        return False
    return PROGRAMMATIC_LAUNCH or _capability(device) >= (9, 0)


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch options for programmatic dependent launch: the PDL constexpr, and the launch flag when on."""
    return {"PDL": True, "launch_pdl": True} if programmatic_launch(device) else {"PDL": False}


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 models (no TF32); ignored for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters (`arrived_last`), zeroed once; every launch leaves them zeroed.

    Allocated by the first (eager) launch on a device: launch each kernel once before capturing a graph, and
    do not run two launches that use them concurrently on different streams of one device.
    """
    own = getattr(_OWN_COUNTERS, "buffer", None)
    if own is not None:
        return own
    found = _COUNTERS.get(device)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("launch the kernels once outside CUDA-graph capture: they allocate their counters then")
        found = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return found


def new_counters(device: torch.device) -> torch.Tensor:
    """A set of arrival counters of its own, for `own_counters` (allocate it outside CUDA-graph capture)."""
    return torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)


@contextlib.contextmanager
def own_counters(buffer: torch.Tensor) -> Iterator[None]:
    """Launches made in this block, by this thread, use `buffer` (`new_counters`) as their arrival counters
    instead of the device's: kernels that run beside others, on another CUDA stream, need a set of their
    own. A graph captured in the block keeps using `buffer`."""
    previous = getattr(_OWN_COUNTERS, "buffer", None)
    _OWN_COUNTERS.buffer = buffer
    try:
        yield
    finally:
        _OWN_COUNTERS.buffer = previous


# ------------------------------------------------------------------------------------------ Triton helpers


@jit
def round_to(x, dtype: tl.constexpr):
    """x rounded to the model dtype, back in fp32: the PyTorch path stores its intermediates in that dtype."""
    return x.to(dtype).to(tl.float32)


# Float math as PyTorch's CUDA kernels compute it, where tl's own may lower to approximate instructions (tl.exp to
# ex2.approx): libdevice's when compiled (LIBDEVICE=not interpreting()); tl's, i.e. numpy's, when interpreted, where
# there is no libdevice.


@jit
def expf(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@jit
def logf(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@jit
def sinf(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.sin(x)
    return tl.sin(x)


@jit
def rsqrtf(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.rsqrt(x)
    return tl.math.rsqrt(x)


@jit
def dot(a, b, acc, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b. The interpreter multiplies bf16 as raw integers, so there both sides go to fp32 first."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@jit
def arrived_last(counter_ptr, arrivals: tl.constexpr):
    """Count this program in; True for the last of `arrivals`, which then sees every earlier program's stores.

    "Last to arrive" lets the final program of a split reduce the partial results without another launch;
    the counter it used is reset by that program, so every launch leaves the counters zeroed.
    """
    tl.debug_barrier()  # all of this program's partial stores happen before the release below
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1
