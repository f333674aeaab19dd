"""Rebuilding the index from LMDB on start: records -> tree -> index, orphans dropped.

::

    nvme.iter_records()  ->  Entry per record (times, tags and namespace ids shared)
    link each to its parent by key; a block whose parent is absent is an orphan:
    it and its descendants are dropped from nvme (they could never match again)
    insert the rest in last-access order (the LRU and TTL order)

Token ids stay on disk; only what the index needs is kept (see index.py).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from kvstore.index import BlockIndex, Entry
from kvstore.keys import Namespace


@dataclass(frozen=True)
class RestoreReport:
    blocks: int
    orphans: int
    namespaces: int


def restore(index: BlockIndex, nvme: Any, tier: int, namespaces: dict[str, Namespace],
            roots: dict[str, bytes]) -> RestoreReport:
    """Fill an empty ``index`` from ``nvme`` (held in ``tier``); fills ``namespaces`` and ``roots`` too."""
    # A million new objects would start the cyclic GC hundreds of times, each pass longer than the
    # last; nothing made here is garbage, so it stays off until the index is built.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _restore(index, nvme, tier, namespaces, roots)
    finally:
        if was_enabled:
            gc.enable()


def _restore(index: BlockIndex, nvme: Any, tier: int, namespaces: dict[str, Namespace],
             roots: dict[str, bytes]) -> RestoreReport:
    for ns_id, d in nvme.iter_namespaces():
        try:
            ns = Namespace.from_dict(d)
        except ValueError:
            continue  # a namespace row this build cannot read; its blocks keep the id only
        namespaces[ns_id] = ns
        roots[ns_id] = ns.root()
    # iter_index (NvmeTier) skips the token ids and shares namespace ids and session tuples
    records = nvme.iter_index() if hasattr(nvme, "iter_index") else nvme.iter_records()
    bit = 1 << tier
    times: dict[float, float] = {}
    share_time = times.setdefault
    entries: dict[bytes, Entry] = {}
    for rec in records:
        e = Entry(rec.key, None, rec.namespace, rec.sessions, share_time(rec.created, rec.created),
                  share_time(rec.last_access, rec.last_access), None, bit)
        entries[rec.key] = e
        if rec.position:
            e.parent = rec.parent  # type: ignore[assignment]  # the parent's key until linked below
        elif rec.namespace not in roots:
            roots[rec.namespace] = rec.parent
    del times
    orphans: list[Entry] = []
    find = entries.get
    for e in entries.values():
        parent_key: Any = e.parent
        if parent_key is None:
            continue
        p = find(parent_key)
        if p is None:
            e.parent = None
            orphans.append(e)
        else:
            e.parent = p
            p._add_child(e)
    dropped = 0
    for o in orphans:
        stack = [o]
        while stack:
            e = stack.pop()
            stack.extend(e.child_list())
            if entries.pop(e.key, None) is not None:
                nvme.drop(e.key)
                dropped += 1
    order = sorted(entries.values(), key=attrgetter("last_access"))
    del entries
    index.insert_restored(order, tier)
    return RestoreReport(blocks=len(order), orphans=dropped, namespaces=len(namespaces))
