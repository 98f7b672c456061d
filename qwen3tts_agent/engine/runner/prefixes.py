"""Which voice prefixes the runner's prefix store holds: host-side bookkeeping, no tensors.

A prompt's head (instruct, role, codec tags, speaker or x-vector: `PromptBuilder.head`) depends on the voice
and the language only, and attention is causal, so its keys and values are the same for every request of
that voice. The first request of a voice prefills its head as usual and the core keeps the result
(`ModelRunner.store_prefix`); later requests copy it into their slot (`ModelRunner.copy_prefix`) and prefill
only their text-dependent part. Entries are reused least recently used first. The runner's copies all run
on the prompt lane, in order, so an entry overwritten for a new voice is never read by a copy queued after
the overwrite for the old one, nor overwritten before a copy queued earlier has read it.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixEntry:
    """Where a voice's prefix lives in the store, and how many cache positions it holds."""

    index: int
    length: int


class PrefixCache:
    """Voice-prefix keys -> store entries, least recently used first out."""

    def __init__(self, entries: int, max_len: int) -> None:
        self.entries = entries
        self.max_len = max_len
        self._held: collections.OrderedDict[Hashable, PrefixEntry] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> PrefixEntry | None:
        """The entry holding `key`'s prefix (now most recently used), or None."""
        entry = self._held.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._held.move_to_end(key)
        return entry

    def claim(self, key: Hashable, length: int) -> PrefixEntry | None:
        """An entry to store `key`'s prefix of `length` positions in (the least recently used one once the
        store is full); None if the prefix is already held or too long for the store."""
        if key in self._held or not 0 < length <= self.max_len or self.entries < 1:
            return None
        if len(self._held) < self.entries:
            index = len(self._held)
        else:
            _, evicted = self._held.popitem(last=False)
            index = evicted.index
        entry = PrefixEntry(index, length)
        self._held[key] = entry
        return entry
