"""LRU cache of slot states after the system prompt, bounded in bytes.

Keys are `PreparedPersona.cache_key` (the engine puts the model identity, the voice and the
text prompt in it); values are the engine's `SlotSnapshot`s, whose `nbytes` is what they cost.
A hit lets the SessionManager `restore` a slot instead of running the prompt again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

from personaplex_voice.engine.base import SlotSnapshot


class PersonaCache:
    """Least-recently-used map from cache key to snapshot, holding at most `max_bytes`.

    `max_bytes=0` disables the cache (every `get` misses, `put` stores nothing). A snapshot larger
    than the whole budget is not stored. Thread-safe.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[Hashable, SlotSnapshot] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> SlotSnapshot | None:
        """The snapshot for `key` (now most recently used), or None; counts the hit or miss."""
        with self._lock:
            snapshot = self._entries.get(key)
            if snapshot is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return snapshot

    def put(self, key: Hashable, snapshot: SlotSnapshot) -> int:
        """Store `snapshot` under `key`, evicting least recently used entries to stay in budget.

        Returns how many entries were evicted. Storing an existing key replaces it.
        """
        size = int(snapshot.nbytes)
        with self._lock:
            if size > self.max_bytes:
                return 0
            self._drop(key)
            evicted = 0
            while self.nbytes + size > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                evicted += 1
            self._entries[key] = snapshot
            self._sizes[key] = size
            self.nbytes += size
            self.evictions += evicted
            return evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self.nbytes = 0

    def _drop(self, key: Hashable) -> None:
        if key in self._entries:
            del self._entries[key]
            self.nbytes -= self._sizes.pop(key)
