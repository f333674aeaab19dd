"""What the store's collaborators share, handed to each through its constructor.

::

    StoreParts ── lock, clock          one RLock guards everything below
               ├─ tiers                the tiers, top to bottom (tierset.py)
               ├─ index                blocks, tree, tier bits, LRU (index.py)
               ├─ pins, sessions, namespaces
               └─ counts               store-wide counters (counts.py)

The parts are built once by the Store; none of them is replaced afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.keys import Namespace
from kvstore.store.counts import StoreCounts
from kvstore.store.index import BlockIndex
from kvstore.store.namespaces import NamespaceTable
from kvstore.store.pins import PinTable
from kvstore.store.sessions import SessionTable
from kvstore.store.tierset import TierSet


@dataclass(frozen=True)
class StoreParts:
    """The shared state of one store. Every field but ``lock``, ``clock`` and ``tiers`` is changed
    only with ``lock`` held."""

    lock: threading.RLock
    clock: Callable[[], float]
    tiers: TierSet
    index: BlockIndex
    pins: PinTable
    sessions: SessionTable
    namespaces: NamespaceTable
    counts: StoreCounts

    def on_disk(self, key: bytes) -> bool:
        """(Lock held.) Whether block ``key`` has an nvme copy."""
        t = self.tiers.nvme_t
        e = self.index.get(key)
        return t is not None and e is not None and bool(e.tiers & (1 << t))

    def session_namespace(self, name: str) -> Namespace | None:
        """(Lock held.) The namespace of session ``name`` (its tenant's); None when the session is
        unknown here, or its namespace's description was lost."""
        s = self.sessions.get(name)
        return None if s is None else self.namespaces.get(s.namespace)
