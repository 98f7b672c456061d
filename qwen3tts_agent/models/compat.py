"""Import the official ``qwen_tts`` package where torchaudio is missing or broken.

``import qwen_tts`` eagerly imports the 25 Hz speech tokenizer, whose ``speech_vq.py`` does
``import torchaudio.compliance.kaldi``. No released checkpoint uses that tokenizer, but the import
alone fails on CPU-only torch: the PyPI torchaudio wheel links CUDA libraries (and its pin pulls a
CUDA torch), so it is deliberately not installed. Where torchaudio does not import, a small
stand-in is registered so the import succeeds; calling its ``fbank`` (only the 25 Hz tokenizer
would) raises a clear error. A working torchaudio is always left alone.

The same unused tokenizer makes the import noisy: the ``sox`` package it imports probes for the SoX
binary through a shell, which complains on stderr, and logs a warning when it is missing; and its
Whisper encoder prints a banner when flash-attn is missing. Neither concerns the 12 Hz models, so the
import silences exactly those two notices and passes anything else through.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import io
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any, NoReturn, TypeAlias

# The official modules are untyped: torch's `Module.__getattr__` types their submodules and config fields as
# `Tensor | Module`, which says nothing. Code that walks them (to take their weights, shapes and configs)
# takes them as `OfficialModule`; their meaning is checked by the parity tests, not by the type checker.
OfficialModule: TypeAlias = Any

# What the 25 Hz tokenizer's import says that concerns no 12 Hz model.
_SOX_MISSING_NOTICE = "SoX could not be found"
_FLASH_ATTN_BANNER = (
    "\n********\nWarning: flash-attn is not installed. Will only run the manual PyTorch version. "
    "Please install flash-attn for faster inference.\n********\n \n"
)


def import_qwen_tts() -> ModuleType:
    """Import and return the official ``qwen_tts`` package, registering the torchaudio stand-in if needed."""
    if "qwen_tts" in sys.modules:
        return sys.modules["qwen_tts"]
    try:
        import torchaudio  # noqa: F401
    except Exception:  # ImportError, or OSError from a CUDA-linked wheel on CPU-only torch
        _register_torchaudio_stand_in()
    _import_sox_quietly()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module = importlib.import_module("qwen_tts")
    sys.stdout.write(printed.getvalue().replace(_FLASH_ATTN_BANNER, ""))
    return module


def transformers_without_scikit_learn() -> None:
    """Make transformers take scikit-learn as not installed, for a process that never generates with it.

    transformers imports scikit-learn (and SciPy with it) at its generation code's import, when installed
    (librosa brings it), for one function of assisted generation: seconds of every engine-core start
    (docs/performance.md, "Start-up: a warm `serve` ready in 15 s"). It has no switch for that, as it has
    for TensorFlow; without scikit-learn it skips that one adaptation. The engine-core process, which runs
    nothing but the engine, calls this before its first import of transformers' models; with a transformers
    that keeps no such flag, nothing changes.
    """
    from transformers.utils import import_utils

    if hasattr(import_utils, "_sklearn_available"):
        import_utils._sklearn_available = False


class _DropSoxMissingNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_SOX_MISSING_NOTICE)


def _import_sox_quietly() -> None:
    """Import ``sox`` without its missing-binary notices (only the unused 25 Hz tokenizer calls SoX)."""
    if "sox" in sys.modules or shutil.which("sox") is not None:
        return
    # the filter outlives the import, where the package resets its logger's level
    logging.getLogger("sox").addFilter(_DropSoxMissingNotice())
    with _stderr_fd_silenced():
        importlib.import_module("sox")


@contextlib.contextmanager
def _stderr_fd_silenced() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null: the shell that ``sox`` starts writes there, not to sys.stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _fbank(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError(
        "torchaudio is not installed (its PyPI wheel breaks CPU-only torch), so "
        "torchaudio.compliance.kaldi.fbank is unavailable. Only Qwen3-TTS's 25 Hz speech tokenizer "
        "needs it, and no released model uses that tokenizer; install a torchaudio build matching "
        "your torch to use it."
    )


def _register_torchaudio_stand_in() -> None:
    # A failed import can leave half-initialised torchaudio modules behind; drop them first.
    for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
        del sys.modules[name]
    modules: dict[str, Any] = {}  # plain modules, given attributes below
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
        module = ModuleType(name)
        # A spec keeps importlib.util.find_spec() working; without dist metadata, libraries such
        # as transformers still report torchaudio as unavailable.
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        modules[name] = module
    modules["torchaudio"].compliance = modules["torchaudio.compliance"]
    modules["torchaudio.compliance"].kaldi = modules["torchaudio.compliance.kaldi"]
    modules["torchaudio.compliance.kaldi"].fbank = _fbank
    sys.modules.update(modules)
