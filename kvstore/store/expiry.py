"""TTL expiry: blocks not accessed for ``ttl`` seconds leave the store, with their descendants.

The index keeps entries in access order: a tick walks the oldest, at most _EXPIRE_BATCH of them
(the lock is never held for long), and stops at the first fresh one. A block whose subtree was used
since (a put from a later block) takes the freshest access time of it and lives as they do; one an
expired block kept only for itself goes with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvstore.store.index import Entry
from kvstore.store.parts import StoreParts

_EXPIRE_BATCH = 10000  # blocks dropped per tick at most, so the lock is never held for long


class Expiry:
    """``expire`` drops what outlived ``ttl`` (infinite: nothing). ``pinned(e)``: blocks never dropped
    now; ``drop(e)``: drops a block and its descendants, returning them; ``record_changed(e, t)``: the
    block's access time moved to ``t`` (its nvme record follows)."""

    def __init__(
        self,
        parts: StoreParts,
        ttl: float,
        *,
        pinned: Callable[[Entry], bool],
        drop: Callable[[Entry], list[Entry]],
        record_changed: Callable[[Entry, float], None],
    ) -> None:
        self._lock, self._clock, self._index, self._counts = (
            parts.lock,
            parts.clock,
            parts.index,
            parts.counts,
        )
        self._ttl = ttl
        self._pinned, self._drop, self._record_changed = pinned, drop, record_changed

    def expire(self) -> int:
        """Drop blocks not accessed for ``ttl`` seconds, with their descendants. Returns blocks dropped."""
        if not math.isfinite(self._ttl):
            return 0
        dropped = 0
        with self._lock:
            cutoff = self._clock() - self._ttl
            old: list[Entry] = []
            for e in self._index.entries():  # least recently accessed first: stop at the first fresh one
                if e.last_access >= cutoff or len(old) >= _EXPIRE_BATCH:
                    break
                old.append(e)
            for e in old:
                if self._index.get(e.key) is not e:
                    continue
                sub = self._index.subtree(e)
                fresh = max(d.last_access for d in sub)
                if fresh >= cutoff:  # continued since (a put from a later block): it lives as they do,
                    self._record_changed(e, fresh)  # and goes with them (see below)
                    self._index.touch(e, fresh)
                elif not any(self._pinned(d) for d in sub):
                    parent = e.parent
                    dropped += len(self._drop(e))
                    dropped += self._expire_up(parent, cutoff)
            self._counts.expired += dropped
        return dropped

    def _expire_up(self, e: Entry | None, cutoff: float) -> int:
        """(Lock held.) The ancestors of a block just expired that were kept only for it (``expire``
        gave them its access time, which is past ``cutoff`` now): each goes once nothing under it is
        fresh or pinned. Returns blocks dropped."""
        dropped = 0
        while e is not None and self._index.get(e.key) is e and e.last_access < cutoff:
            sub = self._index.subtree(e)
            if any(d.last_access >= cutoff or self._pinned(d) for d in sub):
                break
            parent = e.parent
            dropped += len(self._drop(e))
            e = parent
        return dropped
