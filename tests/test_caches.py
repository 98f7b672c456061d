"""The bytecode cache (`caches.use_bytecode_cache`): used only where the installed packages carry no
bytecode, written on a first start and read on the next, never beside the sources, and left alone when
the user chose a bytecode folder or turned it off. Each case runs in a fresh interpreter, as a start does."""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = "probe_pkg"
SCRIPT = f"""
import json, sys
from qwen3tts_agent.caches import use_bytecode_cache
folder = use_bytecode_cache(probe={PROBE!r})
import {PROBE}.mod
print(json.dumps({{"folder": folder and str(folder), "prefix": sys.pycache_prefix, "writes": not sys.dont_write_bytecode,
                  "cached": {PROBE}.mod.__cached__}}))
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    package = tmp_path / "src" / PROBE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("VALUE = 1\n")
    return tmp_path


def start(root: Path, **env: str) -> dict[str, object]:
    repo = Path(__file__).resolve().parents[1]
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "QWEN3TTS_AGENT_BYTECODE_CACHE")}
    merged = {**base, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{root / 'src'}{os.pathsep}{repo}",
              "QWEN3TTS_AGENT_BYTECODE_CACHE": str(root / "bytecode"), **env}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=merged, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_start_writes_the_bytecode_into_the_cache_and_the_next_reads_it(probe: Path) -> None:
    first = start(probe)
    cache = probe / "bytecode"
    assert first["folder"] == str(cache) and first["prefix"] == str(cache) and first["writes"]
    cached = Path(str(first["cached"]))
    assert cached.is_relative_to(cache) and cached.is_file()
    assert not (probe / "src" / PROBE / "__pycache__").exists()  # nothing written beside the sources
    stamp = cached.stat().st_mtime_ns
    second = start(probe)
    assert second["cached"] == first["cached"] and cached.stat().st_mtime_ns == stamp  # read, not rewritten


def test_a_child_process_inherits_the_cache_and_writes_there_too(probe: Path) -> None:
    cache = probe / "bytecode"
    cache.mkdir()
    child = start(probe, PYTHONPYCACHEPREFIX=str(cache))
    assert child["folder"] == str(cache) and child["writes"]
    assert Path(str(child["cached"])).is_file()


def test_installed_bytecode_leaves_python_alone(probe: Path) -> None:
    assert compileall.compile_dir(str(probe / "src"), quiet=1)
    result = start(probe)
    assert result["folder"] is None and result["prefix"] is None and not result["writes"]
    assert not (probe / "bytecode").exists()


@pytest.mark.parametrize("setting", ["0", "off"])
def test_the_cache_can_be_turned_off(probe: Path, setting: str) -> None:
    result = start(probe, QWEN3TTS_AGENT_BYTECODE_CACHE=setting)
    assert result["folder"] is None and result["prefix"] is None and not result["writes"]


def test_a_bytecode_folder_the_user_chose_is_kept(probe: Path) -> None:
    chosen = probe / "mine"
    result = start(probe, PYTHONPYCACHEPREFIX=str(chosen))
    assert result["folder"] is None and result["prefix"] == str(chosen) and not result["writes"]
