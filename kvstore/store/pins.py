"""Pins as leases: blocks being transferred cannot be evicted or demoted, but only for a while.

A pin is taken for a set of keys and a lease; it ends when released or when
the lease runs out, whichever comes first. So a client that dies in the
middle of a streaming get never leaks pinned memory: its pins simply lapse.

Not thread-safe: the store holds its lock around every call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

_PURGE_EVERY = 256  # pins taken between two sweeps of expired leases


@dataclass(frozen=True)
class PinHandle:
    """A lease on ``keys`` (the blocks that were present when pinned) until ``expires`` (clock time)."""

    id: int
    keys: tuple[bytes, ...]
    expires: float
    located: bool = False  # a client reads the blocks' pages in place (kvstore.shm): they must stay put


class PinTable:
    """Which keys are pinned, by which handles, until when."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._ids = itertools.count(1)
        self._by_key: dict[bytes, dict[int, float]] = {}
        self._handles: dict[int, PinHandle] = {}

    def pin(self, keys: Iterable[bytes], lease: float, *, located: bool = False) -> PinHandle:
        """Pin ``keys`` for ``lease`` seconds from now (``located``: for a client that reads their
        pages in place). Returns the handle to release them with."""
        if not lease > 0:
            raise ValueError(f"a pin lease must be positive seconds, got {lease!r}")
        handle = PinHandle(next(self._ids), tuple(keys), self._clock() + lease, located)
        if handle.id % _PURGE_EVERY == 0:  # leases of clients that died go even where nothing else purges
            self.purge()
        self._handles[handle.id] = handle
        for k in handle.keys:
            self._by_key.setdefault(k, {})[handle.id] = handle.expires
        return handle

    def release(self, handle: PinHandle) -> bool:
        """End a lease early. False when it was already released or had expired and was purged."""
        if self._handles.pop(handle.id, None) is None:
            return False
        for k in handle.keys:
            holders = self._by_key.get(k)
            if holders is not None:
                holders.pop(handle.id, None)
                if not holders:
                    del self._by_key[k]
        return True

    def renew(self, handle: PinHandle, lease: float) -> bool:
        """Hold ``handle``'s keys until ``lease`` seconds from now at least (a lease is never made
        shorter). False when it was released or has run out: its blocks may have moved since."""
        held = self._handles.get(handle.id)
        now = self._clock()
        if held is None or held.expires <= now:
            return False
        expires = max(held.expires, now + lease)
        self._handles[handle.id] = replace(held, expires=expires)
        for k in held.keys:
            holders = self._by_key.get(k)
            if holders is not None and handle.id in holders:
                holders[handle.id] = expires
        return True

    def is_pinned(self, key: bytes) -> bool:
        """Whether some unexpired lease holds ``key`` (expired leases found here are purged)."""
        holders = self._by_key.get(key)
        if not holders:
            return False
        now = self._clock()
        if any(exp > now for exp in holders.values()):
            return True
        for hid in list(holders):
            h = self._handles.get(hid)
            if h is not None:
                self.release(h)
        return False

    def is_located(self, key: bytes) -> bool:
        """Whether an unexpired lease of a client reading ``key``'s pages in place holds it."""
        holders = self._by_key.get(key)
        if not holders:
            return False
        now = self._clock()
        return any(
            exp > now and self._handles[hid].located for hid, exp in holders.items() if hid in self._handles
        )

    def purge(self) -> int:
        """Drop every expired lease; returns how many."""
        now = self._clock()
        expired = [h for h in self._handles.values() if h.expires <= now]
        for h in expired:
            self.release(h)
        return len(expired)

    def pinned_keys(self) -> int:
        """How many keys some unexpired lease holds."""
        now = self._clock()
        return sum(1 for holders in self._by_key.values() if any(exp > now for exp in holders.values()))
