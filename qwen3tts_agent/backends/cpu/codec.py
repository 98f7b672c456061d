"""`CpuCodecDecoder`: the exact streaming codec decoder, with the convolutions the CPU runs slowly rewritten."""

from __future__ import annotations

from ...engine.codec import StreamingCodecDecoder


class CpuCodecDecoder(StreamingCodecDecoder):
    """`StreamingCodecDecoder` for the CPU backends."""
