"""Model loading: the official qwen-tts package (import shim, loader) and synthetic checkpoints built offline."""

from .compat import import_qwen_tts
from .loading import load_official_model
from .synthetic import (
    SYNTHETIC_SPECS,
    default_synthetic_cache_dir,
    ensure_synthetic_checkpoint,
    is_synthetic_spec,
    parse_synthetic_spec,
    synthetic_configs,
)

__all__ = [
    "SYNTHETIC_SPECS",
    "default_synthetic_cache_dir",
    "ensure_synthetic_checkpoint",
    "import_qwen_tts",
    "is_synthetic_spec",
    "load_official_model",
    "parse_synthetic_spec",
    "synthetic_configs",
]
