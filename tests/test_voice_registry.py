"""The server's voice registry on disk, shared by several API workers (`server/voices.py`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from qwen3tts_agent.engine.types import VoicePrompt
from qwen3tts_agent.server.voices import VoiceRegistry

PROMPT = VoicePrompt("v_0123456789abcdef", np.ones(8, dtype=np.float32), None, None, True)


def _save(prompt: VoicePrompt, path: Path) -> None:
    path.write_bytes(b"prompt")


def _load(path: Path) -> VoicePrompt:
    assert path.read_bytes() == b"prompt"
    return PROMPT


async def _register(registry: VoiceRegistry, name: str) -> tuple[str, bool]:
    record, created = await registry.register(lambda: PROMPT, _save, name=name, ref_text=None, x_vector_only=True)
    return record.name, created


def test_a_voice_another_worker_stored_meanwhile_is_kept(tmp_path: Path) -> None:
    """Two workers that both started before either stored the (default) voice register it: the second finds its
    folder taken by the same voice and takes that one, instead of failing its start."""

    async def run() -> None:
        first, second = VoiceRegistry(tmp_path, max_voices=4), VoiceRegistry(tmp_path, max_voices=4)
        await first.load(_load)
        await second.load(_load)
        assert await _register(first, "default") == ("default", True)
        assert await _register(second, "other") == ("default", True)  # the record on disk
        third = VoiceRegistry(tmp_path, max_voices=4)
        await third.load(_load)
        assert [r.name for r in third.records()] == ["default"]

    asyncio.run(run())
    assert sorted(p.name for p in tmp_path.iterdir()) == [PROMPT.voice_id]  # no staging folder left behind


def test_a_folder_left_unreadable_is_replaced(tmp_path: Path) -> None:
    (tmp_path / PROMPT.voice_id).mkdir()
    (tmp_path / PROMPT.voice_id / "prompt.safetensors").write_bytes(b"half a write")

    async def run() -> None:
        registry = VoiceRegistry(tmp_path, max_voices=4)
        await registry.load(_load)  # skips the unreadable folder (logged)
        assert registry.records() == []
        assert await _register(registry, "mine") == ("mine", True)
        again = VoiceRegistry(tmp_path, max_voices=4)
        await again.load(_load)
        assert [r.name for r in again.records()] == ["mine"]

    asyncio.run(run())
    assert sorted(p.name for p in tmp_path.iterdir()) == [PROMPT.voice_id]
