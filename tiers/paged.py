"""What the hbm and ram tiers share: slots in a PagePool, guarded while they are read.

A tier keeps ``key -> Slot`` (its pages, its byte length and what
the tier needs to decode it). Reads take no lock while they copy: an entry
counts its readers, and ``drop`` (or a replacing ``put``) unpublishes the
entry at once but frees its pages only when the last reader is done, so a
read never sees pages reused under it and a dropped key is never found again.
``used_bytes`` is pages in use times the page size: what the entries really
occupy of the arena (the arena is the capacity; Python bookkeeping is not
counted).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore.layout import KVLayout
from kvstore.tiers.base import Tier, TierFull, TierUsage
from kvstore.tiers.pool import PagePool, PageSpan


@dataclass
class Slot:
    """One stored entry: its pages, its length in bytes, and tier-specific ``meta``."""

    span: PageSpan
    nbytes: int
    meta: Any
    readers: int = 0
    dropped: bool = field(default=False)


@dataclass(frozen=True)
class Place:
    """Where an entry's bytes are in the arena, for a reader in another process (kvstore.shm).

    ``extents``: (byte offset, length) runs in reading order, ``nbytes`` in all; ``pages`` and
    ``gens``: the pages and their generations when located (see pool.py)."""

    extents: list[tuple[int, int]]
    nbytes: int
    pages: np.ndarray
    gens: np.ndarray


class PagedTier(Tier):
    """Tier bookkeeping over a PagePool. Subclasses turn blocks into bytes and back."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._entries: dict[bytes, Slot] = {}
        self._lock = threading.Lock()

    @property
    def pool(self) -> PagePool:
        return self._pool

    @property
    def page_bytes(self) -> int:
        return self._pool.page_bytes

    def block_cost(self, layout: KVLayout) -> int:
        """A native block of ``layout`` rounded up to whole pages."""
        return -(-layout.block_nbytes // self.page_bytes) * self.page_bytes

    # -- storing ------------------------------------------------------------------------
    def _store(self, key: bytes, data: torch.Tensor, meta: Any) -> int:
        """Put the bytes of ``data`` (any shape and strides) under ``key``; returns bytes occupied.
        TierFull leaves all as it was.

        A replacement may use the old entry's room: then the old entry is
        unpublished before the new one is written (the key is briefly absent).
        """
        if not isinstance(key, bytes):
            raise TypeError(f"tier keys are bytes, got {type(key).__name__}")
        n = data.numel() * data.element_size()
        need = self._pool.pages_for(n)
        with self._lock:
            old = self._entries.get(key)
            # the old entry's pages are room only when no reader holds them (they are freed at once)
            room = self._pool.free_pages + (old.span.count if old is not None and not old.readers else 0)
            if need > room:
                raise TierFull(
                    f"{self.name} tier: an entry of {n} bytes needs {need} pages of "
                    f"{self.page_bytes}, {room} can be had (capacity {self._pool.capacity_bytes} bytes)"
                )
            if need > self._pool.free_pages and old is not None:
                self._unpublish(key)
            span = self._pool.alloc(n)
        try:
            self._pool.write_tensor(span, data)
        except BaseException:
            self._pool.free(span)
            raise
        with self._lock:
            if key in self._entries:
                self._unpublish(key)
            self._entries[key] = Slot(span=span, nbytes=n, meta=meta)
        return span.count * self.page_bytes

    def _unpublish(self, key: bytes) -> int:
        """Remove ``key`` (lock held); its pages are freed now or by its last reader. Returns bytes."""
        entry = self._entries.pop(key)
        entry.dropped = True
        if entry.readers == 0:
            self._pool.free(entry.span)
        return entry.span.count * self.page_bytes

    @contextmanager
    def _reading(self, key: bytes) -> Iterator[Slot]:
        """Hold ``key``'s entry (its pages stay allocated) for the duration. KeyError when absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            entry.readers += 1
        try:
            yield entry
        finally:
            with self._lock:
                entry.readers -= 1
                if entry.dropped and entry.readers == 0:
                    self._pool.free(entry.span)

    def locate(self, key: bytes) -> Place:
        """Where ``key``'s bytes are now. KeyError when absent. The caller keeps it from being dropped
        (a pin) for as long as it is read, and checks the generations afterwards."""
        return self.locate_many([key])[0]

    def locate_many(self, keys: Sequence[bytes]) -> list[Place]:
        """``locate`` of each of ``keys``, in order: one lock, and the generations of all their pages
        read at once (a prefix is tens of blocks). KeyError when one is absent (none is located)."""
        with self._lock:
            slots = [self._entries[k] for k in keys]
            pages = [s.span.array for s in slots]
            gens = self._pool.gens[np.concatenate(pages)] if pages else None
        # it is read from outside this pool: the batched writes that published the entries have landed
        # (flushed after the entries were found: a write published just before would be queued already)
        self._pool.flush()
        places: list[Place] = []
        at = 0
        for slot, p in zip(slots, pages, strict=True):
            assert gens is not None
            span, nbytes = slot.span, slot.nbytes
            if span.contiguous:
                runs = [(span.first * self.page_bytes, nbytes)]
            else:
                runs = extents(p, self.page_bytes, nbytes)
            places.append(Place(runs, nbytes, p, gens[at : at + len(p)]))
            at += len(p)
        return places

    # -- Tier -------------------------------------------------------------------------
    def drop(self, key: bytes) -> int:
        """Remove ``key``; return the bytes freed (0 if absent). A concurrent reader finishes first."""
        with self._lock:
            if key not in self._entries:
                return 0
            return self._unpublish(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            snapshot = list(self._entries)
        return iter(snapshot)

    def nbytes(self, key: bytes) -> int:
        with self._lock:
            return self._entries[key].span.count * self.page_bytes

    def usage(self) -> TierUsage:
        with self._lock:
            blocks = len(self._entries)
            used = self._pool.used_pages * self.page_bytes
        return TierUsage(
            name=self.name, blocks=blocks, used_bytes=used, capacity_bytes=self._pool.capacity_bytes
        )

    def close(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._unpublish(key)


def extents(pages: np.ndarray, page_bytes: int, nbytes: int) -> list[tuple[int, int]]:
    """The (offset, length) byte runs of ``nbytes`` bytes laid over ``pages`` in order."""
    runs: list[tuple[int, int]] = []
    left = nbytes
    start = 0
    n = len(pages)
    while start < n and left > 0:
        end = start + 1
        while end < n and pages[end] == pages[end - 1] + 1:
            end += 1
        length = min(left, (end - start) * page_bytes)
        runs.append((int(pages[start]) * page_bytes, length))
        left -= length
        start = end
    return runs
