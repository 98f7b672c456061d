"""CUDA graphs of the whole frame step, one per (batch bucket, KV-length bucket).

`ModelRunner.frame_step` has fixed shapes for a given (b, kv_len) and never synchronises with the host, so
a frame — 15 predictor steps, one talker step and all 16 samplings — replays as a single graph launch.
Rows above the live batch inside a bucket are inactive: they compute but change nothing.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable

import torch

from .runner import ModelRunner

logger = logging.getLogger(__name__)


def power_of_two_buckets(limit: int, start: int = 1) -> list[int]:
    buckets = []
    n = start
    while n < limit:
        buckets.append(n)
        n *= 2
    buckets.append(limit)
    return buckets


class GraphedFrameStep:
    """Captures and replays `frame_step` graphs; call `capture()` (e.g. from `Engine.warmup`) before serving."""

    def __init__(self, runner: ModelRunner, batch_buckets: Iterable[int], kv_buckets: Iterable[int]) -> None:
        self.runner = runner
        self.batch_buckets = sorted(set(batch_buckets))
        self.kv_buckets = sorted(set(kv_buckets))
        if self.batch_buckets[-1] > runner.max_slots or self.kv_buckets[-1] > runner.max_seq_len:
            raise ValueError("buckets exceed the runner's slots or sequence length")
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def bucket(self, b: int, kv_len: int) -> tuple[int, int]:
        bi = bisect.bisect_left(self.batch_buckets, b)
        ki = bisect.bisect_left(self.kv_buckets, kv_len)
        if bi == len(self.batch_buckets) or ki == len(self.kv_buckets):
            raise ValueError(f"no graph bucket for batch {b}, kv length {kv_len}")
        return self.batch_buckets[bi], self.kv_buckets[ki]

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> float:
        """Capture every bucket with all rows inactive (so the capture changes no slot). Returns seconds."""
        started = time.perf_counter()
        runner = self.runner
        saved_active = runner.active.clone()
        runner.active.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        keys = [(b, k) for b in self.batch_buckets for k in self.kv_buckets]
        try:
            from tqdm import tqdm

            iterator = tqdm(keys, desc="capturing CUDA graphs", disable=not progress)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            iterator = keys
        for b, kv in iterator:
            with torch.cuda.stream(side):  # eager first run of each shape: allocator, library kernel choice
                runner.frame_step(b, kv)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                runner.frame_step(b, kv)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[(b, kv)] = graph
        torch.cuda.synchronize()
        runner.active.copy_(saved_active)
        seconds = time.perf_counter() - started
        logger.info("captured %d frame graphs in %.1f s", len(keys), seconds)
        return seconds

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def __call__(self, b: int, kv_len: int) -> None:
        self._graphs[self.bucket(b, kv_len)].replay()
