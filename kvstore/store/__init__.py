"""The store engine: an index over the tiers, blocks moving between them, the write-through to nvme.

::

    engine.py     Store: put / lookup / get / pin, composed of the parts below
    puts.py       a put: new blocks stored after their parent, chunk by chunk
    reads.py      lookup, get, and located reads for same-host clients
    index.py      which blocks exist, their prefix tree, tier bits and LRU order
    movement.py   making room: demotion, leaf-first dropping, promotion, corruption
    writer.py     the write-through thread and its bounded queue
    writeback.py  what that thread writes, flush, and the nvme records kept up to date
    expiry.py     TTL: blocks not accessed for ttl seconds leave, with their descendants
    restore.py    rebuilding the index from LMDB at start
    sessions.py   sessions and the prefix each last stored
    pins.py       pins as leases
    admin.py      evict and prefetch, for operators
    reports.py    sessions, usage, stats and the integrity check: reads only
    cluster.py    the shared tier below nvme: write-through to it, reads from it on a local miss
    cluster_admin.py  sessions other hosts stored, evict and prefetch on the cluster; [cluster] -> tier
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.store.engine import Store

__all__ = ["Store"]


def __getattr__(name: str) -> Any:
    # imported on first use: config reads Admission (writer.py) without loading the engine and torch
    if name == "Store":
        from kvstore.store.engine import Store

        return Store
    raise AttributeError(f"module 'kvstore.store' has no attribute {name!r}")
