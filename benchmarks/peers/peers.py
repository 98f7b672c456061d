#!/usr/bin/env python3
"""Side-by-side peer measurements: the official ``qwen-tts`` package and ``faster-qwen3-tts``.

One system per process, because the two need different transformers versions and both install a
package named ``qwen_tts`` (official ``qwen-tts`` on transformers 4.57.3; ``qwen-tts-hf`` on 5.16.1
under faster-qwen3-tts). Put the right stack first on PYTHONPATH (see ``benchmarks/fetch_wheels.sh``):

    PYTHONPATH=/tmp/official python3 -m benchmarks.peers.peers --system official --checkpoint DIR ...
    PYTHONPATH=/tmp/faster   python3 -m benchmarks.peers.peers --system faster --chunk-size 8 --checkpoint DIR ...

What is measured, per run (after ``--warmup`` untimed runs; median and p95 over ``--runs``):
  * first audio: submit -> first PCM samples in the caller's hands (for the official package, which
    cannot stream, this is the whole wall time);
  * wall time, audio seconds, real-time factor (audio s / wall s);
  * generation ms per frame: the token-generation loop only (no prefill, no codec decoding);
  * peak GPU memory (``torch.cuda.max_memory_allocated``), reset before each run.

Both engines stop at EOS, so for fixed-length runs the script uses a copy of the checkpoint whose
``talker.codec_head.weight`` EOS row (codec token 2150) is zero: under top-k 50 sampling a zero
logit never enters the top 50 (random weights), so every run makes exactly ``--frames`` frames, and
the script checks that it did. The voice-clone prompt (ICL mode) is built once, before timing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1920  # 12.5 Hz codec at 24 kHz
EOS_WEIGHT_KEY = "talker.codec_head.weight"
DEFAULT_EOS_ID = 2150
DEFAULT_TEXT = (
    "The quick brown fox jumps over the lazy dog, while a small band plays in the town square "
    "and everyone stops for a moment to listen, smile and clap."
)
DEFAULT_REF_TEXT = "This is a short reference recording, made for the voice clone."
_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_STARTED = time.perf_counter()


def log(message: str) -> None:
    """Print a progress line with the seconds since start."""
    print(f"[peers +{time.perf_counter() - _STARTED:7.1f}s] {message}", flush=True)


# --- Checkpoint with the EOS row zeroed ---------------------------------------------------------------


@dataclass(frozen=True)
class RowLocation:
    """Where one row of a safetensors tensor lies on disk."""

    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Return (start of the data section, header) of a safetensors file."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    return 8 + length, header


def tensor_file(folder: Path, key: str) -> Path:
    """The safetensors file of ``folder`` that holds ``key`` (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        if key not in weight_map:
            raise KeyError(f"{key} not in {index}")
        return folder / weight_map[key]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    return single


def eos_row_location(folder: Path, eos_id: int) -> RowLocation:
    """Locate the EOS row of the talker's codec head in the checkpoint ``folder``."""
    path = tensor_file(folder, EOS_WEIGHT_KEY)
    data_start, header = read_safetensors_header(path)
    if EOS_WEIGHT_KEY not in header:
        raise KeyError(f"{EOS_WEIGHT_KEY} not in {path}")
    entry = header[EOS_WEIGHT_KEY]
    shape = tuple(entry["shape"])
    if entry["dtype"] not in _SAFETENSORS_ITEMSIZE:
        raise ValueError(f"unsupported dtype {entry['dtype']} for {EOS_WEIGHT_KEY}")
    if len(shape) != 2 or not 0 <= eos_id < shape[0]:
        raise ValueError(f"{EOS_WEIGHT_KEY} has shape {shape}; EOS id {eos_id} is not a row of it")
    row_bytes = shape[1] * _SAFETENSORS_ITEMSIZE[entry["dtype"]]
    offset = data_start + entry["data_offsets"][0] + eos_id * row_bytes
    return RowLocation(path, offset, row_bytes, entry["dtype"], shape)


def row_is_zero(location: RowLocation) -> bool:
    """Whether every byte of the row is zero (+0.0 in every float format)."""
    with location.file.open("rb") as file:
        file.seek(location.offset)
        return not any(file.read(location.nbytes))


def checkpoint_eos_id(folder: Path) -> int:
    """``talker_config.codec_eos_token_id`` from ``config.json`` (2150 in every released model)."""
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("talker_config", {}).get("codec_eos_token_id", DEFAULT_EOS_ID))


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # follows symlinks (hub snapshots): links the real blob
    except OSError:
        shutil.copy2(source, target)


def fixed_length_checkpoint(
    source: Path, work_dir: Path, *, force_copy: bool = False
) -> tuple[Path, dict[str, Any]]:
    """Return a checkpoint folder whose EOS row of ``talker.codec_head.weight`` is zero, and a report.

    If ``source`` already has a zero EOS row (synthetic checkpoints do) it is used as it is, unless
    ``force_copy``. Otherwise a copy is made under ``work_dir`` (every file hard-linked where possible,
    except the safetensors file holding the codec head, which is copied and patched in place) and
    reused on later calls.
    """
    source = source.resolve()
    eos_id = checkpoint_eos_id(source)
    location = eos_row_location(source, eos_id)
    report: dict[str, Any] = {
        "source": str(source),
        "eos_id": eos_id,
        "codec_head_shape": list(location.shape),
        "codec_head_dtype": location.dtype,
    }
    if row_is_zero(location) and not force_copy:
        log(f"EOS row {eos_id} of {EOS_WEIGHT_KEY} is already zero in {source}: using it as it is")
        return source, {**report, "copied": False, "eos_row_was_zero": True}

    stat = location.file.stat()
    fingerprint = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{eos_id}".encode()).hexdigest()[
        :12
    ]
    target = work_dir / f"{source.name}-eos-zeroed-{fingerprint}"
    report.update(copied=True, eos_row_was_zero=row_is_zero(location), path=str(target))
    if (target / ".eos-zeroed.json").is_file():
        log(f"reusing the EOS-zeroed copy {target}")
        return target, report

    log(f"copying {source} -> {target} with the EOS row {eos_id} of {EOS_WEIGHT_KEY} zeroed")
    work_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=work_dir))
    staging.chmod(0o755)
    try:
        relative_tensor_file = location.file.relative_to(source)
        for path in sorted(source.rglob("*")):
            relative = path.relative_to(source)
            if path.is_dir():
                (staging / relative).mkdir(parents=True, exist_ok=True)
            elif relative == relative_tensor_file:
                shutil.copyfile(path, staging / relative)  # a real copy: this one is modified
            else:
                _link_or_copy(path, staging / relative)
        patched = RowLocation(
            staging / relative_tensor_file, location.offset, location.nbytes, location.dtype, location.shape
        )
        with patched.file.open("r+b") as file:
            file.seek(patched.offset)
            file.write(bytes(patched.nbytes))
        if not row_is_zero(patched):
            raise RuntimeError(f"failed to zero the EOS row in {patched.file}")
        (staging / ".eos-zeroed.json").write_text(json.dumps(report, indent=2) + "\n")
        try:
            staging.rename(target)
        except OSError:
            if not (target / ".eos-zeroed.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, report


# --- Imports and inputs ------------------------------------------------------------------------------


def import_qwen_tts() -> ModuleType:
    """Import ``qwen_tts`` (official or qwen-tts-hf), with our torchaudio stand-in where torchaudio is broken.

    ``qwen3tts_agent/models/compat.py`` is loaded by path: importing the ``qwen3tts_agent`` package
    would pull in the whole engine, which the faster-qwen3-tts environment cannot import.
    """
    try:
        import torchaudio  # noqa: F401
    except Exception:
        compat_path = ROOT / "qwen3tts_agent" / "models" / "compat.py"
        spec = importlib.util.spec_from_file_location("_qwen3tts_agent_compat", compat_path)
        if spec is None or spec.loader is None:
            raise ImportError(f"torchaudio does not import and {compat_path} is missing") from None
        compat = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compat)
        log("torchaudio does not import here: using the stand-in from qwen3tts_agent/models/compat.py")
        return compat.import_qwen_tts()
    return importlib.import_module("qwen_tts")


def distribution_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_environment(system: str) -> dict[str, Any]:
    """Import the system's packages, check their versions and return them (exits with a hint if wrong)."""
    import torch
    import transformers

    qwen_tts = import_qwen_tts()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "transformers": transformers.__version__,
        "qwen_tts_file": qwen_tts.__file__,
        "qwen_tts_version": getattr(qwen_tts, "__version__", None),
        "qwen-tts": distribution_version("qwen-tts"),
        "qwen-tts-hf": distribution_version("qwen-tts-hf"),
        "accelerate": distribution_version("accelerate"),
        "tokenizers": distribution_version("tokenizers"),
        "huggingface_hub": distribution_version("huggingface_hub"),
    }
    hint = "put the right wheel folder first on PYTHONPATH (see benchmarks/fetch_wheels.sh)"
    if system == "official":
        if not transformers.__version__.startswith("4.57."):
            raise SystemExit(
                f"official qwen-tts 0.1.1 needs transformers 4.57.3, found {transformers.__version__}: {hint}"
            )
        if info["qwen-tts"] is None or info["qwen_tts_version"] not in (None, info["qwen-tts"]):
            raise SystemExit(
                f"the imported qwen_tts ({qwen_tts.__file__}) is not the official qwen-tts: {hint}"
            )
    else:
        import faster_qwen3_tts

        info["faster-qwen3-tts"] = getattr(
            faster_qwen3_tts, "__version__", distribution_version("faster-qwen3-tts")
        )
        info["faster_qwen3_tts_file"] = faster_qwen3_tts.__file__
        if info["qwen-tts-hf"] is None or info["qwen_tts_version"] != info["qwen-tts-hf"]:
            raise SystemExit(
                f"faster-qwen3-tts needs qwen-tts-hf as qwen_tts, found {qwen_tts.__file__}: {hint}"
            )
        major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
        if not (5, 9) <= major_minor <= (5, 16):
            raise SystemExit(
                f"qwen-tts-hf works on transformers 5.9-5.16, found {transformers.__version__}: {hint}"
            )
    return info


def resolve_checkpoint(spec: str, system: str) -> Path:
    """A checkpoint folder, or a ``synthetic:`` spec built with our engine's builder (official stack only)."""
    if spec.strip().lower().startswith("synthetic:"):
        if system != "official":
            raise SystemExit(
                "synthetic checkpoints are built with the official qwen-tts stack: run the official "
                "system (or ensure_synthetic_checkpoint) first and pass the folder it prints"
            )
        from qwen3tts_agent.models.synthetic import ensure_synthetic_checkpoint

        log(f"building/locating {spec}")
        return ensure_synthetic_checkpoint(spec)
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder} is not a checkpoint folder (no config.json)")
    return folder


def reference_audio(path: str | None, work_dir: Path) -> Path:
    """The reference WAV; without one, a deterministic 3 s voice-like signal is written to ``work_dir``."""
    if path:
        return Path(path)
    import numpy as np
    import soundfile as sf

    target = work_dir / "reference-3s.wav"
    if not target.is_file():
        work_dir.mkdir(parents=True, exist_ok=True)
        t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
        pitch = 140 + 25 * np.sin(2 * np.pi * 0.7 * t)  # a gliding voice-like fundamental
        phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
        voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
        syllables = 0.5 + 0.5 * np.sin(2 * np.pi * 3.5 * t) ** 2
        noise = np.random.default_rng(0).standard_normal(t.size) * 0.02
        wave = 0.25 * voiced * syllables / np.abs(voiced).max() + noise
        sf.write(target, wave.astype(np.float32), SAMPLE_RATE)
        log(f"wrote a synthetic 3 s reference to {target}")
    return target


# --- Systems -----------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One timed utterance."""

    wall_s: float
    first_audio_s: float
    audio_s: float
    rtf: float
    frames: int
    audio_frames: int
    samples: int
    chunks: int
    prefill_ms: float | None
    gen_ms_per_frame: float | None
    peak_allocated_gib: float | None


class Timer:
    """Synchronising wall-clock helpers for one device."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        """Wait for queued GPU work."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        """Restart the peak-memory counter."""
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        """Peak allocated GPU memory since the last reset, in GiB."""
        return self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None


def torch_dtype(name: str, device: str) -> Any:
    """``--dtype`` as a torch dtype (auto: bfloat16 on CUDA, float32 on CPU)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def _finish(
    timer: Timer,
    started: float,
    first: float,
    samples: int,
    frames: int,
    chunks: int,
    prefill_ms: float | None,
    gen_ms_per_frame: float | None,
) -> RunResult:
    wall = time.perf_counter() - started
    audio_s = samples / SAMPLE_RATE
    return RunResult(
        wall_s=wall,
        first_audio_s=first,
        audio_s=audio_s,
        rtf=audio_s / wall if wall > 0 else math.inf,
        frames=frames,
        audio_frames=round(samples / SAMPLES_PER_FRAME),
        samples=samples,
        chunks=chunks,
        prefill_ms=prefill_ms,
        gen_ms_per_frame=gen_ms_per_frame,
        peak_allocated_gib=timer.peak_gib(),
    )


class OfficialSystem:
    """The official ``qwen-tts`` 0.1.1 package: whole-utterance generation, no streaming."""

    label = "official"

    def __init__(self, checkpoint: Path, device: str, dtype: str, attn: str) -> None:
        qwen_tts = import_qwen_tts()
        self.timer = Timer(device)
        kwargs: dict[str, Any] = {"device_map": device, "dtype": torch_dtype(dtype, device)}
        if attn != "default":
            kwargs["attn_implementation"] = attn
        self.tts = qwen_tts.Qwen3TTSModel.from_pretrained(str(checkpoint), **kwargs)
        self.prompt: list[Any] | None = None
        self._frames: list[int] = []
        self._talker_calls = 0
        self._prefill_start = self._prefill_end = self._generate_end = 0.0
        self._instrument()

    def _instrument(self) -> None:
        """Wrap ``model.generate`` (frame counts, generation time) and hook the talker (prefill time)."""
        model = self.tts.model
        original: Callable[..., Any] = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            self._talker_calls = 0
            out = original(*args, **kwargs)
            self.timer.sync()
            self._generate_end = time.perf_counter()
            self._frames = [int(codes.shape[0]) for codes in out[0]]
            return out

        model.generate = generate  # an instance attribute shadows the method

        def before(*_: Any) -> None:
            if self._talker_calls == 0:
                self._prefill_start = time.perf_counter()

        def after(*_: Any) -> None:
            self._talker_calls += 1
            if self._talker_calls == 1:
                self.timer.sync()
                self._prefill_end = time.perf_counter()

        model.talker.register_forward_pre_hook(before)
        model.talker.register_forward_hook(after)

    def prepare_prompt(self, ref_audio: Path, ref_text: str) -> None:
        """Build the ICL voice-clone prompt once."""
        self.prompt = self.tts.create_voice_clone_prompt(
            ref_audio=str(ref_audio), ref_text=ref_text, x_vector_only_mode=False
        )

    def run(self, text: str, language: str, frames: int) -> RunResult:
        """One utterance of exactly ``frames`` frames (max_new_tokens = frames + 1)."""
        self.timer.sync()
        self.timer.reset_peak()
        started = time.perf_counter()
        wavs, sr = self.tts.generate_voice_clone(
            text=text,
            language=language,
            voice_clone_prompt=self.prompt,
            max_new_tokens=frames + 1,
            non_streaming_mode=False,
        )
        first = time.perf_counter() - started  # returned as NumPy: the PCM is in our hands
        if sr != SAMPLE_RATE:
            raise RuntimeError(f"unexpected sample rate {sr}")
        made = self._frames[0]
        decode_s = self._generate_end - self._prefill_end
        return _finish(
            self.timer,
            started,
            first,
            int(wavs[0].shape[0]),
            made,
            1,
            (self._prefill_end - self._prefill_start) * 1e3,
            decode_s * 1e3 / max(made, 1),
        )


class FasterSystem:
    """faster-qwen3-tts (CUDA graphs): streaming with ``chunk_size`` frames per chunk, or 0 = non-streaming."""

    def __init__(
        self, checkpoint: Path, device: str, dtype: str, attn: str, chunk_size: int, max_seq_len: int
    ) -> None:
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise SystemExit(
                "faster-qwen3-tts needs a CUDA GPU: it captures CUDA graphs of the talker and predictor "
                f"(FasterQwen3TTS.from_pretrained refuses device {device!r}; cuda available: {torch.cuda.is_available()})"
            )
        import_qwen_tts()
        from faster_qwen3_tts import FasterQwen3TTS

        self.label = f"faster-chunk{chunk_size}" if chunk_size else "faster-nonstreaming"
        self.timer = Timer(device)
        self.chunk_size = chunk_size
        self.model = FasterQwen3TTS.from_pretrained(
            str(checkpoint),
            device=device,
            dtype=torch_dtype(dtype, device),
            attn_implementation="sdpa" if attn == "default" else attn,
            max_seq_len=max_seq_len,
        )
        self.prompt: list[Any] | None = None
        self.ref_text = ""
        self._timing: dict[str, Any] = {}
        self._instrument()

    def _instrument(self) -> None:
        """Record the timing dict of the non-streaming ``fast_generate`` (looked up at call time)."""
        import faster_qwen3_tts.generate as generate_module

        original = generate_module.fast_generate

        def fast_generate(*args: Any, **kwargs: Any) -> Any:
            codes, timing = original(*args, **kwargs)
            self._timing = dict(timing)
            return codes, timing

        generate_module.fast_generate = fast_generate

    def prepare_prompt(self, ref_audio: Path, ref_text: str) -> None:
        """Build the ICL voice-clone prompt once, with the same qwen_tts call as the official system."""
        self.ref_text = ref_text
        self.prompt = self.model.model.create_voice_clone_prompt(
            ref_audio=str(ref_audio), ref_text=ref_text, x_vector_only_mode=False
        )

    def run(self, text: str, language: str, frames: int) -> RunResult:
        """One utterance of exactly ``frames`` frames (faster-qwen3-tts: max_new_tokens = frames)."""
        common = dict(
            text=text,
            language=language,
            ref_text=self.ref_text,
            voice_clone_prompt=self.prompt,
            max_new_tokens=frames,
            non_streaming_mode=False,
        )
        self.timer.sync()
        self.timer.reset_peak()
        started = time.perf_counter()
        if self.chunk_size == 0:
            wavs, _ = self.model.generate_voice_clone(**common)
            first = time.perf_counter() - started
            t = self._timing
            made = int(t["steps"])
            return _finish(
                self.timer,
                started,
                first,
                int(wavs[0].shape[0]),
                made,
                1,
                float(t["prefill_ms"]),
                float(t["decode_s"]) * 1e3 / max(made, 1),
            )
        first = math.nan
        samples = chunks = made = 0
        prefill_ms = decode_ms = 0.0
        for audio, sr, timing in self.model.generate_voice_clone_streaming(
            chunk_size=self.chunk_size, **common
        ):
            if math.isnan(first) and len(audio) > 0:
                first = time.perf_counter() - started  # NumPy PCM in our hands
            if sr != SAMPLE_RATE:
                raise RuntimeError(f"unexpected sample rate {sr}")
            samples += len(audio)
            chunks += 1
            made = int(timing["total_steps_so_far"])
            prefill_ms += float(timing["prefill_ms"])
            decode_ms += float(timing["decode_ms"])
        return _finish(
            self.timer, started, first, samples, made, chunks, prefill_ms, decode_ms / max(made, 1)
        )


# --- Main --------------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, float]:
    """Median, p95 (linear interpolation), min and max."""
    ordered = sorted(values)

    def percentile(q: float) -> float:
        position = (len(ordered) - 1) * q
        low, high = math.floor(position), math.ceil(position)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"median": percentile(0.5), "p95": percentile(0.95), "min": ordered[0], "max": ordered[-1]}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except empty ones."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(
        description="Measure one peer Qwen3-TTS system (official qwen-tts or faster-qwen3-tts) on fixed-length "
        "ICL voice-clone utterances. Run each system in its own process with its own PYTHONPATH.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--system", choices=("official", "faster"), required=True, help="which engine to measure"
    )
    parser.add_argument(
        "--checkpoint", help="Base checkpoint folder (official layout), or synthetic:SPEC (official only)"
    )
    parser.add_argument(
        "--ref-audio", help="reference WAV for the voice clone (default: a synthetic 3 s signal)"
    )
    parser.add_argument("--ref-text", default=DEFAULT_REF_TEXT, help="transcript of the reference audio")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="text to synthesise")
    parser.add_argument("--language", default="English", help="language passed to the engine")
    parser.add_argument("--frames", type=int, default=100, help="frames per utterance (80 ms each), fixed")
    parser.add_argument("--runs", type=int, default=5, help="timed runs")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed warm-up runs first (graph capture etc.)"
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=8,
        help="faster only: frames per streamed chunk (1 or 8 for the comparison); 0 = non-streaming",
    )
    parser.add_argument("--device", default="cuda", help="torch device (faster-qwen3-tts needs cuda)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="model dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--attn", default="sdpa", help="attn_implementation ('default' leaves the library's choice)"
    )
    parser.add_argument("--max-seq-len", type=int, default=2048, help="faster only: static KV cache length")
    parser.add_argument("--seed", type=int, default=1234, help="torch seed; run i uses seed + i")
    parser.add_argument(
        "--work-dir",
        default=os.path.join(tempfile.gettempdir(), "qwen3tts-peers"),
        help="where the EOS-zeroed checkpoint copy and the synthetic reference go",
    )
    parser.add_argument(
        "--force-copy",
        action="store_true",
        help="make the EOS-zeroed copy even if the checkpoint's EOS row is already zero",
    )
    parser.add_argument(
        "--out", help="result JSON (default: benchmarks/results/peers-<label>-<checkpoint>.json)"
    )
    parser.add_argument(
        "--check-imports",
        action="store_true",
        help="only import the system's packages, print their versions and exit",
    )
    args = parser.parse_args(argv)
    if not args.check_imports and not args.checkpoint:
        parser.error("--checkpoint is required (unless --check-imports)")
    if args.frames < 2 or args.runs < 1 or args.warmup < 0 or args.chunk_size < 0:
        parser.error("need --frames >= 2, --runs >= 1, --warmup >= 0, --chunk-size >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and write the JSON; exit status 1 if any run missed the frame count."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log(f"system {args.system}: checking packages")
    environment = check_environment(args.system)
    log("packages: " + ", ".join(f"{k}={v}" for k, v in environment.items() if not k.endswith("_file")))
    if args.check_imports:
        if args.system == "faster":
            from faster_qwen3_tts import FasterQwen3TTS

            log(f"FasterQwen3TTS importable from {sys.modules[FasterQwen3TTS.__module__].__file__}")
        return 0

    import torch

    work_dir = Path(args.work_dir)
    source = resolve_checkpoint(args.checkpoint, args.system)
    checkpoint, eos_report = fixed_length_checkpoint(source, work_dir, force_copy=args.force_copy)
    ref_audio = reference_audio(args.ref_audio, work_dir)

    log(f"loading {checkpoint} on {args.device}")
    timer = Timer(args.device)
    timer.reset_peak()
    started = time.perf_counter()
    system: OfficialSystem | FasterSystem
    if args.system == "official":
        system = OfficialSystem(checkpoint, args.device, args.dtype, args.attn)
    else:
        system = FasterSystem(
            checkpoint, args.device, args.dtype, args.attn, args.chunk_size, args.max_seq_len
        )
    timer.sync()
    load_s = time.perf_counter() - started
    log(f"loaded in {load_s:.1f} s; building the voice-clone prompt (ICL) from {ref_audio}")
    started = time.perf_counter()
    system.prepare_prompt(ref_audio, args.ref_text)
    timer.sync()
    prompt_s = time.perf_counter() - started
    load_peak_gib = timer.peak_gib()

    warmups: list[dict[str, Any]] = []
    for index in range(args.warmup):
        torch.manual_seed(args.seed - 1 - index)
        result = system.run(args.text, args.language, args.frames)
        warmups.append(asdict(result))
        log(f"warm-up {index + 1}/{args.warmup}: {result.wall_s:.2f} s, {result.frames} frames")

    runs: list[RunResult] = []
    for index in range(args.runs):
        torch.manual_seed(args.seed + index)
        result = system.run(args.text, args.language, args.frames)
        runs.append(result)
        ok = "ok" if result.frames == args.frames == result.audio_frames else "WRONG FRAME COUNT"
        peak = f"{result.peak_allocated_gib:.2f} GiB" if result.peak_allocated_gib is not None else "n/a"
        log(
            f"run {index + 1}/{args.runs}: first audio {result.first_audio_s * 1e3:.0f} ms, wall {result.wall_s:.2f} s, "
            f"RTF {result.rtf:.2f}, {result.gen_ms_per_frame:.1f} ms/frame, {result.frames} frames "
            f"({result.audio_s:.2f} s audio, {result.chunks} chunks) [{ok}], peak {peak}"
        )

    every = [asdict(r) for r in runs] + warmups
    frames_ok = all(r["frames"] == args.frames == r["audio_frames"] for r in every)
    metrics = (
        "first_audio_s",
        "wall_s",
        "audio_s",
        "rtf",
        "gen_ms_per_frame",
        "prefill_ms",
        "peak_allocated_gib",
    )
    summary = {
        name: summarize([float(getattr(r, name)) for r in runs])
        for name in metrics
        if all(getattr(r, name) is not None for r in runs)
    }
    label = system.label
    report = {
        "system": args.system,
        "label": label,
        "args": vars(args),
        "environment": environment,
        "checkpoint": {"requested": args.checkpoint, "used": str(checkpoint), **eos_report},
        "reference_audio": str(ref_audio),
        "frames_expected": args.frames,
        "frames_made": [r.frames for r in runs],
        "frames_ok": frames_ok,
        "load_s": load_s,
        "prompt_s": prompt_s,
        "peak_allocated_gib_load_and_prompt": load_peak_gib,
        "summary": summary,
        "warmup_runs": warmups,
        "runs": [asdict(r) for r in runs],
    }
    out = (
        Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"peers-{label}-{source.name}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    log(f"{label}: median (p95) over {args.runs} runs of {args.frames} frames")
    for name, stats in summary.items():
        log(f"  {name:20s} {stats['median']:10.3f} ({stats['p95']:.3f})")
    log(f"frame count {'OK' if frames_ok else 'WRONG'}: expected {args.frames}, made {report['frames_made']}")
    log(f"wrote {out}")
    return 0 if frames_ok else 1


if __name__ == "__main__":
    sys.exit(main())
