"""Converted weights, built once per checkpoint and weight format and cached beside the checkpoint.

A conversion is a folder of ONNX models (`talker.onnx`, `predictor.onnx`, and in the int8 and int4 formats one
per predictor output head) with their weights as external data. It lives in `<checkpoint>/.qwen3tts-cpu/`,
or under the user cache (`$QWEN3TTS_AGENT_CACHE/cpu`, default `~/.cache/qwen3tts-agent/cpu`) when the
checkpoint folder is read-only. The folder name carries the weight format, `FORMAT_VERSION` and a key of
the checkpoint's weight file (size and modification time), so a changed checkpoint is converted again.
A model with no checkpoint folder is converted into a temporary folder for this process only.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ... import caches
from ...models.compat import OfficialModule
from ...progress import Progress
from .graphs import QUANTIZED_BITS, WEIGHT_FORMATS, decoder_stack_graph, linear_graph, stack_shape

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump whenever the graphs or the quantization change
CACHE_DIR_NAME = ".qwen3tts-cpu"
_COMPLETE = "complete"


def conversion_folder(model: OfficialModule, weight_format: str, cache_root: Path | None = None) -> Path | None:
    """Where the conversion of `model`'s checkpoint in `weight_format` lives (None: no checkpoint folder)."""
    checkpoint = _checkpoint_folder(model)
    if checkpoint is None:
        return None
    weights = sorted(checkpoint.glob("*.safetensors")) or sorted(checkpoint.glob("*.bin"))
    stamp = ";".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    key = hashlib.sha1(f"{checkpoint.resolve()}|{stamp}".encode()).hexdigest()[:12]
    name = f"{weight_format}-v{FORMAT_VERSION}-{key}"
    if cache_root is not None:
        return Path(cache_root) / name
    beside = checkpoint / CACHE_DIR_NAME
    if (beside / name / _COMPLETE).is_file() or _writable(checkpoint):
        return beside / name
    return caches.cache_root() / "cpu" / name


def prepare(model: OfficialModule, weight_format: str, *, cache_root: Path | None = None, progress: bool = True) -> Path:
    """Return a folder holding `model`'s converted graphs, converting them first if they are not cached.

    `model` is the official `Qwen3TTSForConditionalGeneration`. The conversion is written to a temporary
    folder beside its final place and renamed into it, so a concurrent loader never sees half of one.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; known: {', '.join(WEIGHT_FORMATS)}")
    target = conversion_folder(model, weight_format, cache_root)
    if target is not None and (target / _COMPLETE).is_file():
        return target
    if target is None:
        target = Path(tempfile.mkdtemp(prefix=f"qwen3tts-cpu-{weight_format}-"))
        atexit.register(shutil.rmtree, target, True)
        _convert(model, weight_format, target, progress)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-building-", dir=target.parent))
    started = time.perf_counter()
    try:
        _convert(model, weight_format, staging, progress)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted the weights to %s in %.1f s: %s", weight_format, time.perf_counter() - started, target)
    return target


def _convert(model: OfficialModule, weight_format: str, folder: Path, progress: bool) -> None:
    import onnx

    talker = model.talker
    predictor = talker.code_predictor
    t_layers, p_layers = list(talker.model.layers), list(predictor.model.layers)
    heads = list(predictor.lm_head) if weight_format in QUANTIZED_BITS else []
    steps = len(t_layers) + len(p_layers) + len(heads)
    with Progress(f"converting weights ({weight_format})", total=steps, unit="layer", enabled=progress, logger=logger) as bar:
        graphs = {
            "talker": decoder_stack_graph(t_layers, stack_shape(t_layers, talker.config), weight_format, progress=bar),
            "predictor": decoder_stack_graph(
                p_layers, stack_shape(p_layers, predictor.config), weight_format,
                in_proj=predictor.small_to_mtp_projection, progress=bar,
            ),
        }
        for name, graph in graphs.items():
            onnx.save(graph, str(folder / f"{name}.onnx"), save_as_external_data=True, location=f"{name}.data")
        for i, head in enumerate(heads):
            onnx.save(linear_graph(head.weight, weight_format), str(folder / f"head_{i}.onnx"))
            bar.update(1)
    (folder / _COMPLETE).write_text(f"{weight_format} v{FORMAT_VERSION}\n")


def _checkpoint_folder(model: OfficialModule) -> Path | None:
    name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    path = Path(name).expanduser() if name else None
    return path if path is not None and (path / "config.json").is_file() else None


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)
