"""Codes to audio: the exact streaming codec decoder and the pipeline that runs it beside the frame steps.

`StreamingCodecDecoder` (`codec.py`, its transformer on the fused kernels in `codec_transformer.py`) keeps every
stream's decoder state per slot, so a chunk costs only its own frames; `GraphedCodecDecode` (`codec_graphs.py`)
replays it as CUDA graphs. `AudioPipeline` (`pipeline.py`) owns the codec slots and the two codec lanes (a
stream's first chunks; the rest, batched by the scheduler's `CodecQueue`), or on a CPU the codec's own thread.
Changes here are changes to decoding; which chunk is due is the scheduler's.
"""

from .codec import StreamingCodecDecoder
from .codec_graphs import GraphedCodecDecode
from .pipeline import AudioPipeline, cpu_thread_split

__all__ = ["AudioPipeline", "GraphedCodecDecode", "StreamingCodecDecoder", "cpu_thread_split"]
