"""Import the official ``qwen_tts`` package where torchaudio is missing or broken.

``import qwen_tts`` eagerly imports the 25 Hz speech tokenizer, whose ``speech_vq.py`` does
``import torchaudio.compliance.kaldi``. No released checkpoint uses that tokenizer, but the import
alone fails on CPU-only torch: the PyPI torchaudio wheel links CUDA libraries (and its pin pulls a
CUDA torch), so it is deliberately not installed. Where torchaudio does not import, a small
stand-in is registered so the import succeeds; calling its ``fbank`` (only the 25 Hz tokenizer
would) raises a clear error. A working torchaudio is always left alone.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from types import ModuleType
from typing import NoReturn


def import_qwen_tts() -> ModuleType:
    """Import and return the official ``qwen_tts`` package, registering the torchaudio stand-in if needed."""
    try:
        import torchaudio  # noqa: F401
    except Exception:  # ImportError, or OSError from a CUDA-linked wheel on CPU-only torch
        _register_torchaudio_stand_in()
    return importlib.import_module("qwen_tts")


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
    modules = {}
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
