"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory ``synthetic_dir(spec) -> folder`` of a synthetic checkpoint, built once per test session.

    Built under the pytest base temp dir rather than the user cache, so every session tests the
    current builder; a tiny checkpoint takes well under a second to build.
    """
    from qwen3tts_agent.models.synthetic import ensure_synthetic_checkpoint

    cache = tmp_path_factory.mktemp("synthetic-checkpoints")

    def build(spec: str) -> Path:
        return ensure_synthetic_checkpoint(spec, cache_dir=cache, progress=False)

    return build
