"""Registered (cloned) voices: encoded once, kept in memory for requests, and persisted on disk across restarts.

Layout: `<voices_dir>/<voice_id>/meta.json` and `<voices_dir>/<voice_id>/prompt.safetensors` (`Engine.save_voice`).
A voice folder appears and disappears by one rename, so a crash never leaves a half-written voice behind.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..engine.types import VoicePrompt
from .protocol import ApiError

logger = logging.getLogger(__name__)

_META = "meta.json"
_PROMPT = "prompt.safetensors"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class VoiceRecord:
    """What the API shows about a registered voice (the prompt tensors stay server-side)."""

    voice_id: str
    name: str
    ref_text: str | None
    x_vector_only: bool
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class VoiceRegistry:
    """Voices by id and by (case-insensitive) name. Mutations run on the event loop; disk and model work in threads."""

    def __init__(self, root: Path, *, max_voices: int) -> None:
        self.root = root
        self.max_voices = max_voices
        self._voices: dict[str, tuple[VoiceRecord, VoicePrompt]] = {}
        self._lock = asyncio.Lock()

    async def load(self, load_prompt: Callable[[Path], VoicePrompt]) -> None:
        """Read every stored voice; an unreadable folder is logged and skipped, never fatal."""
        found = await asyncio.to_thread(self._scan, load_prompt)
        self._voices = {record.voice_id: (record, prompt) for record, prompt in found}

    def _scan(self, load_prompt: Callable[[Path], VoicePrompt]) -> list[tuple[VoiceRecord, VoicePrompt]]:
        self.root.mkdir(parents=True, exist_ok=True)
        found = []
        for folder in sorted(self.root.iterdir()):
            if folder.name.startswith(".") or not folder.is_dir():
                continue  # leftovers of an interrupted write or delete
            try:
                found.append((_load_record(folder), load_prompt(folder / _PROMPT)))
            except Exception:
                logger.exception("skipping unreadable voice folder %s", folder)
        return found

    def resolve(self, key: str) -> tuple[VoiceRecord, VoicePrompt] | None:
        if key in self._voices:
            return self._voices[key]
        lowered = key.lower()
        for record, prompt in self._voices.values():
            if record.name.lower() == lowered:
                return record, prompt
        return None

    def records(self) -> list[VoiceRecord]:
        return sorted((record for record, _ in self._voices.values()), key=lambda r: r.created_at)

    async def register(
        self,
        create: Callable[[], VoicePrompt],
        save_prompt: Callable[[VoicePrompt, Path], None],
        *,
        name: str | None,
        ref_text: str | None,
        x_vector_only: bool,
    ) -> tuple[VoiceRecord, bool]:
        """Encode and store a voice; returns (record, created). The same reference twice gives the same voice."""
        prompt = await asyncio.to_thread(create)
        if not _SAFE_ID.match(prompt.voice_id):
            raise ApiError("engine_error", f"engine returned an unusable voice id {prompt.voice_id!r}")
        async with self._lock:
            existing = self._voices.get(prompt.voice_id)
            if existing is not None:
                return existing[0], False
            name = name or prompt.voice_id
            clash = self.resolve(name)
            if clash is not None:
                raise ApiError("conflict", f"voice name {name!r} is already taken by {clash[0].voice_id}", param="name")
            if len(self._voices) >= self.max_voices:
                raise ApiError("conflict", f"voice limit reached ({self.max_voices}); delete a voice first")
            record = VoiceRecord(
                voice_id=prompt.voice_id,
                name=name,
                ref_text=ref_text,
                x_vector_only=x_vector_only,
                created_at=time.time(),
            )
            record = await asyncio.to_thread(self._write, record, prompt, save_prompt)
            self._voices[record.voice_id] = (record, prompt)
            return record, True

    def _write(
        self, record: VoiceRecord, prompt: VoicePrompt, save_prompt: Callable[[VoicePrompt, Path], None]
    ) -> VoiceRecord:
        """Store a voice by one rename; returns the record on disk. Several API workers share the folder and
        register the default voice at the same start: a voice id is its reference's hash, so a folder of that
        id that another process wrote meanwhile holds the same voice, and is kept (with its record)."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".tmp-{uuid.uuid4().hex}"
        staging.mkdir()
        final = self.root / record.voice_id
        try:
            save_prompt(prompt, staging / _PROMPT)
            (staging / _META).write_text(json.dumps(record.to_json(), indent=2), "utf-8")
            try:
                os.replace(staging, final)
                return record
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            stored = _read_record(final)
            if stored is not None:
                shutil.rmtree(staging, ignore_errors=True)
                return stored
            self._remove(record.voice_id)  # a folder that failed to load at startup: replace it
            os.replace(staging, final)
            return record
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    async def delete(self, key: str) -> VoiceRecord | None:
        async with self._lock:
            found = self.resolve(key)
            if found is None:
                return None
            record = found[0]
            await asyncio.to_thread(self._remove, record.voice_id)
            del self._voices[record.voice_id]
            return record

    def _remove(self, voice_id: str) -> None:
        folder = self.root / voice_id
        if folder.exists():
            trash = self.root / f".trash-{uuid.uuid4().hex}"
            os.replace(folder, trash)
            shutil.rmtree(trash, ignore_errors=True)


def _load_record(folder: Path) -> VoiceRecord:
    """The record of a stored voice folder (OSError, ValueError or TypeError if it has no readable one)."""
    return VoiceRecord(**json.loads((folder / _META).read_text("utf-8")))


def _read_record(folder: Path) -> VoiceRecord | None:
    """The record of a stored voice folder, or None if it has no readable one."""
    try:
        return _load_record(folder)
    except (OSError, ValueError, TypeError):
        return None
