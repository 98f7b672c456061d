"""Reference voices: validated once, encoded once with the official encoders, cached and saved by content."""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import soundfile as sf
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from ...errors import InvalidReferenceAudioError, InvalidRequestError
from ..types import VoicePrompt

if TYPE_CHECKING:  # reading and saving voices needs no torch (the server's API workers do just that)
    from ...models.compat import OfficialModule

AudioInput = str | Path | bytes | tuple[np.ndarray, int]

MIN_REFERENCE_SECONDS = 1.0
MAX_REFERENCE_SECONDS = 60.0
_SILENCE_PEAK = 1e-3
_VOICE_FORMAT = "qwen3tts-agent-voice/1"
# Where a transcript may be cut: after a sentence's end (CJK full stops need no space after them), else
# after a clause's; closing quotes and brackets stay with what they close.
_CLOSERS = "\"'”’»)\\]"
_SENTENCE_ENDS = re.compile(f"[.!?…]+[{_CLOSERS}]*(?=\\s|$)|[。！？]+[{_CLOSERS}]*")
_CLAUSE_ENDS = re.compile(f"[,;:]+[{_CLOSERS}]*(?=\\s|$)|[，；：、]+")
# The audio cut is moved to the quietest 20 ms (the pause after the words) within this of the estimate.
TRIM_SEARCH_S = 0.35
_TRIM_WINDOW_S = 0.02


def read_reference_audio(audio: AudioInput) -> tuple[np.ndarray, int]:
    """Decode and check a reference recording; returns mono float32 at its own sample rate.

    Stereo is mixed down and other sample rates are kept (the official encoders resample), but audio that
    cannot describe a voice is refused with a reason the caller can show.
    """
    try:
        if isinstance(audio, tuple):
            wav, sr = np.asarray(audio[0], dtype=np.float32), int(audio[1])
        elif isinstance(audio, (bytes, bytearray)):
            wav, sr = sf.read(io.BytesIO(audio), dtype="float32", always_2d=False)
        elif isinstance(audio, (str, Path)):
            wav, sr = sf.read(str(audio), dtype="float32", always_2d=False)
        else:
            raise InvalidReferenceAudioError(f"unsupported reference audio type {type(audio).__name__}")
    except InvalidReferenceAudioError:
        raise
    except Exception as exc:  # soundfile raises several types for corrupt or unknown files
        raise InvalidReferenceAudioError(f"could not read reference audio: {exc}") from exc
    if wav.ndim == 2:
        wav = wav.mean(axis=1 if wav.shape[1] <= 8 else 0)
    if wav.ndim != 1:
        raise InvalidReferenceAudioError(f"reference audio must be mono or multi-channel 1-D frames, got shape {wav.shape}")
    if sr < 8000:
        raise InvalidReferenceAudioError(f"reference sample rate {sr} Hz is too low (need >= 8000 Hz)")
    if not np.all(np.isfinite(wav)):
        raise InvalidReferenceAudioError("reference audio contains NaN or infinite samples")
    seconds = len(wav) / sr
    if seconds < MIN_REFERENCE_SECONDS:
        raise InvalidReferenceAudioError(f"reference audio is {seconds:.2f} s; need at least {MIN_REFERENCE_SECONDS} s")
    if seconds > MAX_REFERENCE_SECONDS:
        raise InvalidReferenceAudioError(f"reference audio is {seconds:.1f} s; at most {MAX_REFERENCE_SECONDS} s")
    if float(np.abs(wav).max()) < _SILENCE_PEAK:
        raise InvalidReferenceAudioError("reference audio is silent")
    return np.ascontiguousarray(wav, dtype=np.float32), sr


def trim_reference(wav: np.ndarray, sr: int, ref_text: str, max_seconds: float) -> tuple[np.ndarray, str]:
    """Cut a reference recording and its transcript to whole sentences lasting at most `max_seconds`.

    An in-context clone's first frame waits until the new text covers the reference's span, about one text
    token per reference frame (12.5 a second) less the transcript's tokens; a shorter reference waits less.
    The cut must keep the transcript true to the audio, and nothing here can transcribe, so: the transcript
    is cut after a sentence (else a clause) whose end, estimated in proportion to the letters and digits
    before it, falls within `max_seconds`; the audio is cut at the quietest 20 ms within `TRIM_SEARCH_S` of
    that estimate (the pause after the sentence, when the speech rate is even). The most sentences that fit
    are kept; if not even the first sentence (or clause) fits, that one is kept, longer than asked, and a
    transcript without such boundaries is not cut. Returns the kept audio (the recording's start) and text.
    Where the proportion misleads (a long pause inside, a slow start), cut the recording yourself and pass
    the matching transcript to `create_voice`.
    """
    duration = len(wav) / sr
    if duration <= max_seconds:
        return wav, ref_text
    spoken = np.cumsum([ch.isalnum() for ch in ref_text])
    total = int(spoken[-1]) if len(spoken) else 0
    if total == 0:
        return wav, ref_text

    def ends(pattern: re.Pattern[str]) -> list[tuple[float, int]]:
        """(estimated seconds, character index) of each boundary, the text's own end excluded."""
        found = []
        for match in pattern.finditer(ref_text):
            end = match.end()
            if ref_text[end:].strip() and ref_text[:end].strip():
                found.append((duration * int(spoken[end - 1]) / total, end))
        return found

    sentences, clauses = ends(_SENTENCE_ENDS), ends(_CLAUSE_ENDS)
    fitting = [b for b in sentences if MIN_REFERENCE_SECONDS <= b[0] <= max_seconds]
    fitting = fitting or [b for b in clauses if MIN_REFERENCE_SECONDS <= b[0] <= max_seconds]
    if fitting:
        estimate, end = max(fitting)
    else:
        longer = [b for b in sentences + clauses if b[0] >= MIN_REFERENCE_SECONDS]
        if not longer:
            return wav, ref_text
        estimate, end = min(longer)
    cut = _quietest_point(wav, sr, estimate)
    return np.ascontiguousarray(wav[:cut]), ref_text[:end].strip()


def _quietest_point(wav: np.ndarray, sr: int, seconds: float) -> int:
    """The sample at the centre of the quietest 20 ms window within TRIM_SEARCH_S of `seconds`, at least
    MIN_REFERENCE_SECONDS into the recording."""
    window = max(1, int(_TRIM_WINDOW_S * sr))
    low = max(int((seconds - TRIM_SEARCH_S) * sr), int(MIN_REFERENCE_SECONDS * sr) - window // 2)
    high = min(int((seconds + TRIM_SEARCH_S) * sr), len(wav) - window)
    if high <= low:
        return min(len(wav), max(int(seconds * sr), int(MIN_REFERENCE_SECONDS * sr)))
    energy = np.convolve(wav[low : high + window].astype(np.float64) ** 2, np.ones(window), mode="valid")
    hop = max(1, window // 2)
    best = low + int(np.argmin(energy[::hop])) * hop
    return best + window // 2


def voice_id_for(wav: np.ndarray, sr: int, ref_text: str | None, x_vector_only: bool) -> str:
    digest = hashlib.sha256()
    digest.update(wav.tobytes())
    digest.update(f"|{sr}|{int(x_vector_only)}|{ref_text or ''}".encode())
    return "v_" + digest.hexdigest()[:20]


def prepare_reference(
    ref_audio: AudioInput, ref_text: str | None, x_vector_only: bool, max_ref_seconds: float | None
) -> tuple[np.ndarray, int, str | None]:
    """Read and check a reference, and for an in-context clone cut it to `max_ref_seconds` (`trim_reference`).

    Returns what the official encoders get: the audio, its rate, and the transcript (None for x-vector
    clones, which have no transcript and no wait to shorten).
    """
    wav, sr = read_reference_audio(ref_audio)
    if x_vector_only:
        return wav, sr, None
    if not (ref_text and ref_text.strip()):
        raise InvalidRequestError("in-context cloning needs the reference transcript (ref_text); or set x_vector_only")
    if max_ref_seconds is not None:
        if not max_ref_seconds >= MIN_REFERENCE_SECONDS:
            raise InvalidRequestError(f"max_ref_seconds must be at least {MIN_REFERENCE_SECONDS}")
        wav, ref_text = trim_reference(wav, sr, ref_text, max_ref_seconds)
    return wav, sr, ref_text


class VoiceEncoder:
    """Turns references into `VoicePrompt`s through the official `create_voice_clone_prompt`, with a cache."""

    def __init__(self, official: OfficialModule) -> None:
        import torch  # an encoder runs where the model is

        self._inference_mode = torch.inference_mode
        self._official = official
        self._cache: dict[str, VoicePrompt] = {}
        self._lock = threading.Lock()

    def create(
        self, ref_audio: AudioInput, ref_text: str | None, *, x_vector_only: bool, max_ref_seconds: float | None = None
    ) -> VoicePrompt:
        wav, sr, ref_text = prepare_reference(ref_audio, ref_text, x_vector_only, max_ref_seconds)
        voice_id = voice_id_for(wav, sr, ref_text, x_vector_only)
        with self._lock:
            cached = self._cache.get(voice_id)
            if cached is not None:
                return cached
            with self._inference_mode():
                item = self._official.create_voice_clone_prompt(
                    ref_audio=(wav, sr), ref_text=ref_text, x_vector_only_mode=x_vector_only
                )[0]
            prompt = VoicePrompt(
                voice_id=voice_id,
                speaker_embedding=item.ref_spk_embedding.detach().float().cpu().numpy(),
                ref_codes=None if item.ref_code is None else item.ref_code.detach().long().cpu().numpy(),
                ref_text=ref_text,
                x_vector_only=x_vector_only,
            )
            self._cache[voice_id] = prompt
            return prompt


def save_voice(prompt: VoicePrompt, path: str | Path) -> None:
    """Write a voice prompt as safetensors (no pickle), so a server can reload registrations safely."""
    tensors = {"speaker_embedding": np.ascontiguousarray(prompt.speaker_embedding, dtype=np.float32)}
    if prompt.ref_codes is not None:
        tensors["ref_codes"] = np.ascontiguousarray(prompt.ref_codes, dtype=np.int64)
    meta = {"format": _VOICE_FORMAT, "voice_id": prompt.voice_id, "x_vector_only": prompt.x_vector_only}
    if prompt.ref_text is not None:
        meta["ref_text"] = prompt.ref_text
    save_file(tensors, str(path), metadata={"voice": json.dumps(meta)})


def load_voice(path: str | Path) -> VoicePrompt:
    try:
        with safe_open(str(path), framework="np") as handle:
            meta = json.loads((handle.metadata() or {})["voice"])
        tensors = load_file(str(path))
    except Exception as exc:
        raise InvalidRequestError(f"{path} is not a saved voice: {exc}") from exc
    if meta.get("format") != _VOICE_FORMAT:
        raise InvalidRequestError(f"{path} has unknown voice format {meta.get('format')!r}")
    return VoicePrompt(
        voice_id=meta["voice_id"],
        speaker_embedding=tensors["speaker_embedding"],
        ref_codes=tensors.get("ref_codes"),
        ref_text=meta.get("ref_text"),
        x_vector_only=bool(meta["x_vector_only"]),
    )
