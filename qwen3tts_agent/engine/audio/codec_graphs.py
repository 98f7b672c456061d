"""CUDA graphs of the streaming codec decoder (`GraphedCodecDecode`), one per (batch bucket, chunk frames).

The audio pipeline (`pipeline.py`) keeps one family for each of its two codec lanes. They are captured like
the runner's frame and prompt graphs (`runner.cuda_graphs.GraphCapture`: a capture stream and memory pool of
the family's own), so codec graphs replayed beside frame graphs never share a cuBLAS workspace.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Iterable

import torch

from ...progress import track
from ..runner import GraphCapture, split_frames, upload
from .codec import StreamingCodecDecoder


class GraphedCodecDecode:
    """CUDA graphs of the streaming codec decoder, one per (batch bucket, chunk frames).

    The eager decoder launches a few hundred small kernels per call, whose host time (docs/performance.md)
    exceeds the decode's GPU time whatever the batch; a replay costs a launch. Padding rows use the codec's scratch slots from
    `scratch_start` on (above every live stream's slot), so a padded call never touches a live stream's state.
    Two instances with separate scratch slots may replay at the same time on different CUDA streams: each
    has its own static buffers and memory pool.
    """

    def __init__(
        self,
        codec: StreamingCodecDecoder,
        scratch_start: int,
        batch_buckets: Iterable[int],
        frame_sizes: Iterable[int],
        name: str = "codec",
    ) -> None:
        self.name = name  # the family's name in the log (the start-up benchmark reads it)
        self.batch_buckets = sorted(set(batch_buckets))
        largest = self.batch_buckets[-1]
        if codec.max_streams < scratch_start + largest:
            raise ValueError("the codec needs a scratch slot for every padding row")
        self.codec = codec
        self.frame_sizes = sorted(set(frame_sizes))
        self._slots = torch.arange(scratch_start, scratch_start + largest, device=codec.device)
        self._scratch = self._slots.clone()
        self._codes = torch.zeros(largest, self.frame_sizes[-1], codec.num_quantizers, dtype=torch.long, device=codec.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture = GraphCapture()

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        started = time.perf_counter()
        keys = [(b, t) for b in self.batch_buckets for t in self.frame_sizes]
        for b, t in track(keys, desc=f"capturing {self.name} graphs", enabled=progress):
            decode = functools.partial(self.codec.decode, self._slots[:b], self._codes[:b, :t])
            self._graphs[(b, t)] = self._capture.capture(decode)
        self._capture.finish(len(keys), self.name, started)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def can_decode(self, b: int, t: int) -> bool:
        return b <= self.batch_buckets[-1] and bool(split_frames(t, self.frame_sizes))

    def decode(self, slots: list[int] | torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Like `StreamingCodecDecoder.decode` for live slots: one replay per piece of `split_frames`.

        The streaming decoder gives the same audio however a chunk is cut, so a chunk of a length without a
        graph (the last one of a stream, say) is decoded in graphed pieces rather than eagerly. Returns a view
        of a static buffer when the chunk is one piece. `slots` may already be on the device (int64), as the
        pipeline uploads them with the codes.
        """
        b = codes.shape[0]
        bucket = self.batch_buckets[bisect.bisect_left(self.batch_buckets, b)]
        self._slots[:bucket].copy_(self._scratch[:bucket])
        self._slots[:b].copy_(slots if isinstance(slots, torch.Tensor) else upload(slots, torch.int64, self._slots.device))
        pieces, start = [], 0
        sizes = split_frames(codes.shape[1], self.frame_sizes)
        for t in sizes:
            graph, out = self._graphs[(bucket, t)]
            self._codes[:b, :t].copy_(codes[:, start : start + t])
            graph.replay()
            start += t
            pieces.append(out[:b] if len(sizes) == 1 else out[:b].clone())  # the next replay may reuse `out`
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def prime(self, slot: int, codes: torch.Tensor) -> None:
        """Feed reference codes [T, Q] through the slot's state, graphed where the sizes allow; drops the audio."""
        if split_frames(codes.shape[0], self.frame_sizes):
            self.decode([slot], codes.unsqueeze(0))
        else:
            self.codec.prime(slot, codes)
