"""PCM encoding for the wire: engine chunks (24 kHz float32) to the format a client asked for."""

from __future__ import annotations

import struct

import numpy as np

BYTES_PER_SAMPLE = {"pcm_s16le": 2, "pcm_f32le": 4}


class PcmEncoder:
    """Encodes one utterance's chunks; the resampler keeps its state across chunks so joins stay click-free."""

    def __init__(self, encoding: str, sample_rate: int, source_rate: int) -> None:
        self.encoding = encoding
        self.sample_rate = sample_rate
        self._resampler = None
        if sample_rate != source_rate:
            import soxr  # a dependency of librosa, which the engine already needs

            self._resampler = soxr.ResampleStream(source_rate, sample_rate, 1, dtype="float32", quality="HQ")

    def encode(self, pcm: np.ndarray, *, last: bool) -> bytes:
        samples = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=last)
        if self.encoding == "pcm_f32le":
            return samples.astype("<f4").tobytes()
        # same rounding as AudioChunk.pcm16, so 24 kHz s16 output is bit-identical to the engine's
        return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def streaming_wav_header(sample_rate: int, *, channels: int = 1, bits: int = 16) -> bytes:
    """A WAV header for a body of unknown length: sizes set to 0xFFFFFFFF, as OpenAI's streamed WAV does."""
    unknown = 0xFFFFFFFF
    block_align = channels * bits // 8
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, bits)
        + b"data"
        + struct.pack("<I", unknown)
    )
