"""Where qwen3tts-agent keeps what it builds once and reuses, and the bytecode cache of its start-up.

Every cache lives under one root, `$QWEN3TTS_AGENT_CACHE` (default `~/.cache/qwen3tts-agent`): the
synthetic checkpoints, the CPU backend's converted weights, and the Python bytecode below.

Bytecode: a Python package installed without compiled bytecode, in an interpreter that may not write it
beside the sources (`PYTHONDONTWRITEBYTECODE=1`, common in container images), is compiled from source at
every start. For torch, transformers and the official `qwen_tts` that is most of a start's imports (the
H200 image's figures: docs/gpu.md). `use_bytecode_cache()` then points Python's `sys.pycache_prefix` at a
folder of this cache, where the first start writes the bytecode and later starts read it; the installed
packages are left untouched. `serve`, `prepare`, `say`, the engine core and the API workers call it first
thing. Where the packages carry their bytecode, it does nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ROOT_ENV = "QWEN3TTS_AGENT_CACHE"
# a folder for the bytecode cache, or "0" / "off" to leave Python's own choice alone
BYTECODE_CACHE_ENV = "QWEN3TTS_AGENT_BYTECODE_CACHE"
# the package whose bytecode says whether the installed packages carry theirs (the largest import)
BYTECODE_PROBE = "torch"


def cache_root() -> Path:
    """`$QWEN3TTS_AGENT_CACHE`, or `~/.cache/qwen3tts-agent`."""
    root = os.environ.get(CACHE_ROOT_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "qwen3tts-agent"


def bytecode_cache_dir() -> Path | None:
    """The bytecode cache's folder (None: turned off by `$QWEN3TTS_AGENT_BYTECODE_CACHE`)."""
    setting = os.environ.get(BYTECODE_CACHE_ENV, "")
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    return Path(setting).expanduser() if setting else cache_root() / "bytecode"


def _has_bytecode(module: str) -> bool:
    """Whether the installed `module` has compiled bytecode beside its source (True if it cannot be found)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return True
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True
    return Path(importlib.util.cache_from_source(spec.origin)).is_file()


def use_bytecode_cache(probe: str = BYTECODE_PROBE) -> Path | None:
    """Read and write compiled bytecode in this cache when the installed packages carry none (judged by
    `probe`'s) and Python has no bytecode folder of its own; the folder used, or None if nothing changed.

    The setting is also exported (`PYTHONPYCACHEPREFIX`) to the processes started from this one; each of
    them calls this again to write there, since they inherit `PYTHONDONTWRITEBYTECODE` too."""
    folder = bytecode_cache_dir()
    if folder is None:
        return None
    if sys.pycache_prefix is not None and Path(sys.pycache_prefix) != folder:
        return None  # the user chose a bytecode folder
    if sys.pycache_prefix is None:
        if _has_bytecode(probe):
            return None
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("cannot create the bytecode cache %s (%s): imports compile from source", folder, exc)
            return None
        sys.pycache_prefix = str(folder)
        os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
        logger.info("compiled Python bytecode is cached in %s (the installed packages carry none; "
                    "%s=0 turns this off)", folder, BYTECODE_CACHE_ENV)
    sys.dont_write_bytecode = False
    return folder
