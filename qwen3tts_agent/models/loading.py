"""Load a Qwen3-TTS model through the official ``qwen_tts`` path, from a synthetic spec, a folder or a hub id."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ModelLoadError
from ..progress import library_bars
from .compat import import_qwen_tts
from .synthetic import SYNTHETIC_SPECS, ensure_synthetic_checkpoint, is_synthetic_spec

if TYPE_CHECKING:
    from qwen_tts import Qwen3TTSModel

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_TIMEOUT_S = 5.0
_ALTERNATIVES = (
    f"Use a synthetic checkpoint built offline (--model synthetic:tiny, synthetic:0.6b, ...; all: "
    f"{', '.join(SYNTHETIC_SPECS)}) or a local folder in the official layout "
    "(config.json, model.safetensors, tokenizer files, speech_tokenizer/)."
)


def load_official_model(
    model: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> Qwen3TTSModel:
    """Load ``model`` with ``qwen_tts.Qwen3TTSModel.from_pretrained``, in eval mode on ``device``/``dtype``.

    Args:
        model: a synthetic spec (``synthetic:tiny``, ...), a local folder in the official layout, or a
            Hugging Face hub id (``Qwen/Qwen3-TTS-12Hz-0.6B-Base``). A hub id is used from the local
            Hugging Face cache when it is there; otherwise it is downloaded, which fails within seconds
            when the hub cannot be reached.
        device: where the talker and the speech tokenizer go (``device_map``, as the official README).
        dtype: their dtype (the official README uses ``torch.bfloat16`` on GPU).
        cache_dir: where synthetic checkpoints are cached (default: ``default_synthetic_cache_dir()``).
        progress: show the progress of building a big synthetic checkpoint, downloading and loading
            (bars on a terminal, log lines otherwise; see ``qwen3tts_agent.progress``).

    Raises:
        ModelLoadError: unknown spec, missing folder, unreachable hub, or a checkpoint that does not load.
    """
    qwen_tts = import_qwen_tts()
    with library_bars(progress):
        folder = _resolve(model, cache_dir=cache_dir, progress=progress)
        logger.info("Loading %s from %s on %s (%s)", model, folder, device, dtype)
        started = time.perf_counter()
        try:
            # The official wrapper forwards these kwargs to the speech tokenizer too, so both share device/dtype.
            wrapper = qwen_tts.Qwen3TTSModel.from_pretrained(str(folder), device_map=device, dtype=dtype)
        except Exception as error:  # the official loader raises many kinds; all mean "this did not load"
            raise ModelLoadError(f"Could not load {model!r} from {folder}: {error}") from error
    wrapper.model.eval()
    wrapper.model.speech_tokenizer.model.eval()
    logger.info("Loaded %s in %.1f s", model, time.perf_counter() - started)
    return wrapper


def _resolve(model: str, *, cache_dir: Path | None, progress: bool) -> Path:
    """The local folder holding ``model``: built, found on disk, or taken from the Hugging Face cache."""
    if is_synthetic_spec(model):
        return ensure_synthetic_checkpoint(model, cache_dir=cache_dir, progress=progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} is not a Qwen3-TTS checkpoint folder (it has no config.json). {_ALTERNATIVES}"
            )
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is a file, not a checkpoint folder. {_ALTERNATIVES}")
    if not _HUB_ID.match(model):
        raise ModelLoadError(f"Model folder {model!r} does not exist. {_ALTERNATIVES}")
    return _hub_snapshot(model)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(
            f"{repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set. {_ALTERNATIVES}"
        )
    try:
        # snapshot_download's own first request has no timeout and can hang for minutes on a dead network.
        HfApi().repo_info(repo_id, timeout=_HUB_TIMEOUT_S)
    except Exception as error:
        raise ModelLoadError(
            f"{repo_id!r} is not in the local Hugging Face cache and could not be looked up on the hub "
            f"({type(error).__name__}: {error}). {_ALTERNATIVES}"
        ) from error
    try:
        return Path(snapshot_download(repo_id))
    except Exception as error:
        raise ModelLoadError(
            f"Downloading {repo_id!r} failed ({type(error).__name__}: {error}). {_ALTERNATIVES}"
        ) from error
