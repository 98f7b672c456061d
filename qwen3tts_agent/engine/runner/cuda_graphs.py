"""CUDA graphs of the whole frame step, one per (batch bucket, KV-length bucket).

`ModelRunner.frame_step` has fixed shapes for a given (b, kv_len) and never synchronises with the host, so
a frame — 15 predictor steps, one talker step and all 16 samplings — replays as a single graph launch.
Rows above the live batch inside a bucket are inactive: they compute but change nothing.

Each family of graphs is captured on a stream of its own. cuBLAS keeps its workspace per (handle, stream) and
a graph bakes in the capture stream's workspace, so codec graphs replayed beside frame graphs must not
come from the same capture stream, or they would share a scratch buffer while running at the same time.

Graphs are captured with cuDNN's attention left out of `scaled_dot_product_attention`'s choice: it builds an
execution plan the first time it meets a shape, and with one shape per graph that set-up was most of the prompt
and codec graphs' capture time at every start (docs/gpu.md, "One engine thread"). FlashAttention and the
memory-efficient kernel, which torch picks otherwise, have no per-shape set-up.

Every graph is uploaded to the device as it is captured (`upload_graph`). CUDA otherwise uploads an instantiated
graph's work at its first launch, which for the larger graphs (many rows, long caches) is the first burst of
traffic: the first steps of that size would then take longer than every later one.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...progress import track
from .runner import ModelRunner, PrefillRow
from .staging import StagingCache

logger = logging.getLogger(__name__)

T = TypeVar("T")

# from this many rows up, the frame graphs' batch sizes also lie halfway between powers of two (frame_batch_buckets)
FINE_BUCKETS_FROM = 64
# Triton specialises an integer kernel argument on whether it divides by this (GraphedFrameStep.capture)
TRITON_DIVISIBILITY = 16
# what `scaled_dot_product_attention` may pick inside a captured graph (the module docstring says why)
CAPTURE_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def power_of_two_buckets(limit: int, start: int = 1) -> list[int]:
    buckets = []
    n = start
    while n < limit:
        buckets.append(n)
        n *= 2
    buckets.append(limit)
    return buckets


def frame_batch_buckets(limit: int) -> list[int]:
    """The frame graphs' batch sizes: powers of two, and above FINE_BUCKETS_FROM rows also the sizes halfway
    between them (96, 192, 384, ...). A step runs the smallest graph that holds its rows, and a large step's
    time grows with the graph's rows: without them a step of 137 rows runs the 256-row graph."""
    buckets = set(power_of_two_buckets(limit))
    n = FINE_BUCKETS_FROM
    while n * 3 // 2 < limit:
        buckets.add(n * 3 // 2)
        n *= 2
    return sorted(buckets)


def split_frames(t: int, sizes: Sequence[int]) -> list[int]:
    """Cut t frames into pieces of the given sizes, largest first; [] when that greedy cut leaves a remainder."""
    pieces = []
    for size in sorted(sizes, reverse=True):
        while t >= size:
            pieces.append(size)
            t -= size
    return pieces if t == 0 else []


def capture_beside(device: torch.device, first: Callable[[], None], beside: Callable[[], None]) -> None:
    """Run two sets of captures at once: `first` on this thread, `beside` on a helper thread.

    The codec graphs' capture time is mostly cuDNN choosing a plan for each convolution at each new shape,
    native work that leaves the interpreter lock free; the frame and prompt graphs' is mostly Python
    launching kernels. Side by side, the one hides most of the other (docs/performance.md, "Start-up: a
    warm `serve` ready in 15 s"). Each family has its own capture stream and memory pool and captures
    thread-locally (`GraphCapture`); the attention backends, a process-wide setting, are held for both. On
    a CPU (no graphs) the two run in turn.
    """
    if device.type != "cuda":
        first()
        beside()
        return

    def on_helper() -> None:
        with torch.cuda.device(device):
            beside()

    with sdpa_kernel(CAPTURE_ATTENTION_BACKENDS), ThreadPoolExecutor(1, thread_name_prefix="qwen3tts-capture") as helper:
        done = helper.submit(on_helper)
        first()  # should it raise, leaving the block still waits for the helper
        done.result()


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library (the one torch's runtime runs on), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def upload_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> bool:
    """Upload an instantiated graph's work to the device on `stream` now (`cuGraphUpload`), rather than at its
    first launch (module docstring). Whether it was uploaded: False where the driver or torch's handle to the
    executable graph is missing, or the driver refused (the graph then uploads at its first launch, as before)."""
    driver = _driver()
    exec_handle = getattr(graph, "raw_cuda_graph_exec", None)
    if driver is None or exec_handle is None:
        return False
    try:
        handle = exec_handle()
    except RuntimeError:  # not instantiated
        return False
    result = driver.cuGraphUpload(ctypes.c_void_p(handle), ctypes.c_void_p(stream.cuda_stream))
    if result != 0:
        logger.debug("cuGraphUpload returned CUDA error %d; the graph uploads at its first launch", result)
    return result == 0


class GraphCapture:
    """What every family of graphs here shares when capturing: a memory pool (from its first graph) and a
    capture stream of its own (its own cuBLAS workspace, see the module docstring).

    `capture(fn)` runs `fn` once eagerly on a side stream, so that what a first call sets up (a kernel's
    module loaded, a library's handle or per-shape plan) happens outside the capture, then captures it;
    `fn`'s result is the graph's static output. Only a family's first graph needs that eager run as a rule:
    the later ones launch the same operations at other shapes, and an eager run doubles the host's time
    per graph (a start's warm-up is mostly that host time). So by default (`eager=None`) only the first
    capture has one; `eager=False` captures at once, and where that capture fails (something set itself up
    inside it, which a capture forbids: it fails, it does not replay wrongly), runs `fn` eagerly and captures
    again. `eager_runs` counts the eager runs. Each graph is uploaded to the device once captured (`upload_graph`);
    `uploaded` counts them.
    """

    def __init__(self) -> None:
        self._pool: Any = None
        self._stream = torch.cuda.Stream()
        self._side: torch.cuda.Stream | None = None
        self.eager_runs = 0
        self.uploaded = 0
        self._upload_seconds = 0.0

    def capture(self, fn: Callable[[], T], eager: bool | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
        if eager is None:
            eager = self._pool is None  # the family's first graph
        with sdpa_kernel(CAPTURE_ATTENTION_BACKENDS):
            if not eager:
                try:
                    return self._capture(fn)
                except Exception as exc:  # noqa: BLE001 - retried below with the eager run
                    logger.debug("a capture without an eager run failed (%s); running it eagerly first", exc)
            self._run_eagerly(fn)
            return self._capture(fn)

    def finish(self, graphs: int, family: str, started: float) -> float:
        """Wait for the eager runs (which wrote the static buffers the graphs replay on) and the uploads, and log
        the family's capture (the start-up benchmark reads the line). Seconds since `started`. Not a device-wide
        synchronisation: another family may be capturing on another thread (`capture_beside`)."""
        if self._side is not None:
            self._side.synchronize()
        uploads_started = time.perf_counter()
        self._stream.synchronize()
        self._upload_seconds += time.perf_counter() - uploads_started
        seconds = time.perf_counter() - started
        logger.info("captured %d %s graphs in %.1f s (%d eager runs); %d uploaded to the device (%.2f s)",
                    graphs, family, seconds, self.eager_runs, self.uploaded, self._upload_seconds)
        return seconds

    def _run_eagerly(self, fn: Callable[[], object]) -> None:
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            fn()
        torch.cuda.current_stream().wait_stream(self._side)
        self.eager_runs += 1

    def _capture(self, fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        # `torch.cuda.graph` would also synchronise the device and empty the allocator's cache before each
        # capture: the eager run's device time then stands in the host's way, its memory is handed back to
        # the driver only to be taken again by the next one, and a device-wide synchronisation is not allowed
        # while another thread captures. Thread-local: only this thread's own calls may break its capture.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        if self._pool is None:
            self._pool = graph.pool()
        uploading = time.perf_counter()
        self.uploaded += upload_graph(graph, self._stream)
        self._upload_seconds += time.perf_counter() - uploading
        return graph, out


class GraphedFrameStep:
    """Captures and replays `frame_step` graphs; call `capture()` (e.g. from `Engine.warmup`) before serving."""

    def __init__(self, runner: ModelRunner, batch_buckets: Iterable[int], kv_buckets: Iterable[int]) -> None:
        self.runner = runner
        self.batch_buckets = sorted(set(batch_buckets))
        self.kv_buckets = sorted(set(kv_buckets))
        if self.batch_buckets[-1] > runner.max_slots or self.kv_buckets[-1] > runner.max_seq_len:
            raise ValueError("buckets exceed the runner's slots or sequence length")
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._capture = GraphCapture()

    def bucket(self, b: int, kv_len: int) -> tuple[int, int]:
        bi = bisect.bisect_left(self.batch_buckets, b)
        ki = bisect.bisect_left(self.kv_buckets, kv_len)
        if bi == len(self.batch_buckets) or ki == len(self.kv_buckets):
            raise ValueError(f"no graph bucket for batch {b}, kv length {kv_len}")
        return self.batch_buckets[bi], self.kv_buckets[ki]

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> float:
        """Capture every bucket with all rows inactive (so the capture changes no slot). Returns seconds.

        With both stacks on the Triton kernels, a frame step is Triton kernels only, and the host's time
        to launch them is most of a capture's: the eager run before each capture doubled it. That run is
        then kept only where a kernel variant may not have been launched yet: a kernel's first launch
        loads its module and allocates its counters, which a capture forbids (the capture would fail, not
        replay wrongly). Triton compiles a variant per constexpr value and per integer argument's
        divisibility by 16; the kv length is an argument, so a batch bucket's variants are launched by its
        first kv bucket, and again where the divisibility differs (a capture that fails without its eager
        run gets one all the same: `GraphCapture`). With a stack on the PyTorch layers every capture has
        its eager run.
        """
        started = time.perf_counter()
        runner = self.runner
        saved_active = runner.active.clone()
        runner.active.zero_()
        keys = [(b, k) for b in self.batch_buckets for k in self.kv_buckets]
        triton_only = runner.fused_talker and runner.fused_predictor
        launched: set[tuple[int, bool]] = set()
        for b, kv in track(keys, desc="capturing CUDA graphs", enabled=progress):
            variant = (b, kv % TRITON_DIVISIBILITY == 0)
            self._graphs[(b, kv)], _ = self._capture.capture(
                functools.partial(runner.frame_step, b, kv), eager=not triton_only or variant not in launched
            )
            launched.add(variant)
        seconds = self._capture.finish(len(keys), "frame", started)
        runner.active.copy_(saved_active)
        return seconds

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def __call__(self, b: int, kv_len: int) -> None:
        self._graphs[self.bucket(b, kv_len)].replay()


class GraphedPrefill:
    """CUDA graphs of the batched prompt forward, one per (rows, tokens, KV length) bucket.

    An eager prompt forward launches hundreds of kernels from Python (host time far above a frame's, plus
    one-off library set-up for each new prompt length; docs/performance.md); a replay is one launch, so
    admitting a batch of requests costs the running streams about one frame. Pieces beyond the largest bucket run eagerly.
    """

    def __init__(
        self,
        runner: ModelRunner,
        row_buckets: Iterable[int],
        length_buckets: Iterable[int],
        kv_buckets: Iterable[int],
        max_tokens: int,
    ) -> None:
        self.runner = runner
        self.keys = [
            (b, t, k)
            for b in sorted(set(row_buckets))
            for t in sorted(set(length_buckets))
            for k in sorted(set(kv_buckets))
            if t <= k <= runner.max_seq_len and b * t <= max_tokens
        ]
        if not self.keys:
            raise ValueError("no prefill bucket fits the runner")
        largest_b = max(b for b, _, _ in self.keys)
        tokens = max(b * t for b, t, _ in self.keys)
        hidden = runner.hidden_size
        dev = runner.device
        # flat buffers, so every bucket's inputs are contiguous views of their first elements
        self._embeds = torch.zeros(tokens * hidden, device=dev, dtype=runner.dtype)
        self._write_pos = torch.zeros(tokens, device=dev, dtype=torch.int64)
        self._slots = torch.zeros(largest_b, device=dev, dtype=torch.int64)
        self._last = torch.zeros(largest_b, device=dev, dtype=torch.int64)
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture = GraphCapture()

    def _inputs(self, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.runner.hidden_size
        return (
            self._embeds[: b * t * hidden].view(b, t, hidden),
            self._slots[:b],
            self._write_pos[: b * t].view(b, t),
            self._last[:b],
        )

    def bucket(self, b: int, t: int, kv_len: int) -> tuple[int, int, int] | None:
        fitting = [key for key in self.keys if key[0] >= b and key[1] >= t and key[2] >= kv_len]
        return min(fitting, key=lambda key: (key[0] * key[1], key[2]), default=None)

    def park(self) -> None:
        """Point every bucket's inputs at the spare cache column, each row's last token at its first: a replay
        then changes no slot and reads within every bucket (at capture, and where a benchmark replays the graphs
        alone, after a real prefill left a longer bucket's indices in the shared buffers)."""
        self._write_pos.fill_(self.runner.max_seq_len)
        self._last.zero_()

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture every bucket with all positions on the spare cache column (so no slot changes)."""
        started = time.perf_counter()
        self.park()
        for b, t, k in track(self.keys, desc="capturing prefill graphs", enabled=progress):
            forward = functools.partial(self.runner.prefill_forward, *self._inputs(b, t), kv_len=k)
            self._graphs[(b, t, k)] = self._capture.capture(forward)
        self._capture.finish(len(self.keys), "prefill", started)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def __call__(self, rows: list[PrefillRow]) -> bool:
        """Prefill `rows` by replaying a bucket's graph; False (nothing done) when no bucket fits."""
        length = max(r.embeds.shape[0] for r in rows)
        key = self.bucket(len(rows), length, max(r.start + r.embeds.shape[0] for r in rows))
        if key is None:
            return False
        b, t, k = key
        graph, out = self._graphs[key]
        for static, value in zip(self._inputs(b, t), self.runner.prefill_inputs(rows, b, t), strict=True):
            static.copy_(value)
        graph.replay()
        self.runner.finish_prefill(rows, out)
        return True


class GraphedStagedPrefill:
    """CUDA graphs of `StagingCache.forward`, one per (rows, KV length) bucket.

    A prompt whose voice prefix came from the prefix store has a one-token text-dependent part (CustomVoice,
    x-vector clones, VoiceDesign). The batched prompt graphs would pad it to their smallest length bucket and
    run it on the PyTorch layers; here it runs as the talker's Triton decode step, in the runner's staging
    cache, starting at the prefix's length.
    """

    def __init__(self, staging: StagingCache, kv_buckets: Iterable[int]) -> None:
        self.staging = staging
        self.row_buckets = power_of_two_buckets(staging.max_rows)
        self.kv_buckets = sorted({min(k, staging.length) for k in kv_buckets} | {staging.length})
        runner = staging.runner
        dev = runner.device
        self._embeds = torch.zeros(staging.max_rows, 1, runner.hidden_size, device=dev, dtype=runner.dtype)
        self._write_pos = torch.full((staging.max_rows, 1), staging.length, device=dev, dtype=torch.int64)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture = GraphCapture()

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture every bucket with every row on the staging cache's padding column (no slot changes)."""
        started = time.perf_counter()
        keys = [(b, k) for b in self.row_buckets for k in self.kv_buckets]
        for b, k in track(keys, desc="capturing staged prefill graphs", enabled=progress):
            forward = functools.partial(self.staging.forward, self._embeds[:b], self._write_pos[:b], kv_len=k)
            self._graphs[(b, k)] = self._capture.capture(forward)
        self._capture.finish(len(keys), "staged prefill", started)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def __call__(self, rows: list[PrefillRow]) -> bool:
        """Prefill one-token `rows` by replaying a bucket's graph; False (nothing done) when they do not fit."""
        staging = self.staging
        if not staging.fits(rows):
            return False
        b = self.row_buckets[bisect.bisect_left(self.row_buckets, len(rows))]
        kv = self.kv_buckets[bisect.bisect_left(self.kv_buckets, max(r.start for r in rows) + 1)]
        graph, out = self._graphs[(b, kv)]
        embeds, write_pos = staging.inputs(rows, b)
        self._embeds[:b].copy_(embeds)
        self._write_pos[:b].copy_(write_pos)
        graph.replay()
        staging.finish(rows, out)
        return True
