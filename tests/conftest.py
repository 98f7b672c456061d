"""Shared pytest fixtures, and the rule that keeps tests/kernels in a process of its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

KERNEL_TESTS = Path(__file__).resolve().parent / "kernels"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave tests/kernels out of a run that does not name it: it runs in a process of its own (see
    tests/kernels/conftest.py), which tests/test_kernel_suite.py starts."""
    if collection_path != KERNEL_TESTS:
        return None
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == KERNEL_TESTS or KERNEL_TESTS in path.parents:
            return None
    return True


# Files to run first: the longest one that checks no timing (the kernels under Triton's interpreter, in a process of
# its own, ~4 minutes), so that under `make test`'s two workers, which take files in collection order, it runs beside
# the other files rather than alone at the end.
RUN_FIRST = ("test_kernel_suite.py",)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in RUN_FIRST)  # stable: the rest keep their order


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
