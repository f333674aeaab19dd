"""Rebuilding the index from LMDB on start: records -> tree -> index, orphans dropped.

::

    nvme.iter_index_columns()  ->  Entry per record (times, tags and namespace ids shared)
    a block whose record fails its checks is dropped from nvme (frame and entry: fails closed)
    link each to its parent by key; a block whose parent is absent is an orphan:
    it and its descendants are dropped from nvme (they could never match again)
    insert the rest in last-access order (the LRU and TTL order)

Token ids stay on disk; only what the index needs is kept (see index.py). A disk reopened with
a smaller capacity than it was written under is then trimmed to it (``trim_disk``); the sessions it
records are resumed by resume.py.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import FrameError
from kvstore.keys import Namespace
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.namespaces import NamespaceTable
from kvstore.tiers.nvme import NvmeTier

if TYPE_CHECKING:
    from kvstore.store.movement import Mover
    from kvstore.store.parts import StoreParts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreReport:
    blocks: int
    orphans: int
    namespaces: int
    damaged: int = 0  # blocks whose record failed its checks (dropped, like their descendants)


def restore(
    index: BlockIndex,
    nvme: NvmeTier,
    tier: int,
    namespaces: NamespaceTable,
    *,
    slot: float | None = None,
    now: float | None = None,
) -> RestoreReport:
    """Fill an empty ``index`` from ``nvme`` (held in ``tier``), and ``namespaces`` with their roots.

    ``slot``: how far the records' access times may lag (writeback.access_slot); each is taken as
    the end of its slot, but not past ``now``.

    numpy does per column what a loop would do per record: parents found by
    a sorted search over the keys, orphans' subtrees marked by pointer
    doubling, the access order by argsort. Python is left to make one Entry
    per block and link it.
    """
    # A million new objects would start the cyclic GC hundreds of times, each pass longer than the
    # last; nothing made here is garbage, so it stays off until the index is built.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _, d in nvme.iter_namespaces():
            try:
                namespaces.add(Namespace.from_dict(d))
            except (KeyError, TypeError, ValueError):
                continue  # a namespace row this build cannot read; its blocks keep the id only
        damaged: list[bytes] = []

        def on_damaged(key: bytes, err: FrameError) -> None:
            log.warning("nvme record of block %s is damaged (%s): the block is dropped", key.hex()[:16], err)
            damaged.append(key)

        report = _restore(index, nvme, tier, namespaces, on_damaged, slot, now)
        if damaged:  # its descendants went as orphans; the block itself goes too, frame and entry
            nvme.drop_many(damaged)
        return replace(report, damaged=len(damaged))
    finally:
        if was_enabled:
            gc.enable()


def trim_disk(parts: StoreParts, mover: Mover, nvme: NvmeTier) -> None:
    """(At start, after ``restore``.) A disk reopened with a smaller ``capacity`` than it was written
    under gives up its least recently used blocks until it fits, as a write would make room."""
    if not nvme.over_capacity():
        return
    index = parts.index
    before, t, tried = len(index), parts.tiers.last, set[bytes]()
    with parts.lock:
        while nvme.over_capacity():
            e = mover.victims.victim(t, tried)
            if e is None:
                break
            tried.add(e.key)
            mover.evict_from(t, e)
    u = nvme.usage()
    log.warning(
        "nvme: %d blocks given up at start, least recently used first: the store holds %d bytes, "
        "its capacity is %d",
        before - len(index),
        u.used_bytes,
        u.capacity_bytes,
    )


def _restore(
    index: BlockIndex,
    nvme: NvmeTier,
    tier: int,
    namespaces: NamespaceTable,
    on_damaged: Callable[[bytes, FrameError], None],
    slot: float | None,
    now: float | None,
) -> RestoreReport:
    keys: list[bytes] = []
    nss: list[str] = []
    sessions: list[tuple[str, ...]] = []
    arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for cols in nvme.iter_index_columns(on_damaged=on_damaged):
        keys += cols.keys
        nss += cols.namespaces
        sessions += cols.sessions
        arrays.append((cols.parents, cols.positions, cols.created, cols.last_access))
    n = len(keys)
    if not n:
        return RestoreReport(blocks=0, orphans=0, namespaces=len(namespaces))
    parents, position, created, accessed = (np.concatenate([a[i] for a in arrays]) for i in range(4))
    del arrays
    if slot is not None:  # the last access was at most the end of the slot the record names
        ends = (np.floor(accessed / slot) + 1) * slot
        if now is not None:
            ends = np.minimum(ends, np.full_like(ends, now))
        accessed = np.maximum(accessed, ends)
    # row of each block's parent; -1 for block 0 (its parent is the namespace root) and for orphans
    prow = _rows_of(keys, parents)
    first = position == 0
    prow[first] = -1
    for i in np.flatnonzero(first).tolist():
        namespaces.note_root(nss[i], parents[i].tobytes())
    del parents
    dropped = _orphaned(prow, ~first & (prow < 0))
    if dropped.any():  # they could never match again: gone from nvme too
        nvme.drop_many([keys[i] for i in np.flatnonzero(dropped).tolist()])
    # one Entry per block, in key order (sequential reads of the columns), then linked
    times: dict[float, float] = {}
    made = list(
        map(
            Entry,
            keys,
            repeat(None, n),
            nss,
            sessions,
            _shared(created, times),
            _shared(accessed, times),
            repeat(None, n),
            repeat(1 << tier, n),
        )
    )
    del times
    del nss, sessions
    lookup = made + [None]  # row -1: no parent
    for e, p in zip(made, map(lookup.__getitem__, prow.tolist()), strict=True):
        if p is not None:
            e.parent = p
            c = p.children  # p._add_child(e), inlined: a million calls
            if c is None:
                p.children = e
            elif isinstance(c, list):
                c.append(e)
            else:
                p.children = [c, e]
    del lookup
    kept = np.flatnonzero(~dropped)
    rows = kept[np.argsort(accessed[kept], kind="stable")].tolist()  # access order; ties keep key order
    index.insert_restored(list(map(made.__getitem__, rows)), tier, keys=list(map(keys.__getitem__, rows)))
    return RestoreReport(blocks=len(rows), orphans=int(dropped.sum()), namespaces=len(namespaces))


def _rows_of(keys: list[bytes], wanted: np.ndarray) -> np.ndarray:
    """The row in ``keys`` of each of ``wanted`` (32-byte void array), -1 where absent.

    A binary search on the first 8 bytes (as a big-endian integer) then a check of all 32; keys
    sharing their first 8 bytes (about one pair in 10^7 among a million) are looked up exactly.
    """
    n = len(keys)
    kb = b"".join(keys)
    if len(kb) != 32 * n:  # not all 32 bytes: no shortcut
        exact = {k: i for i, k in enumerate(keys)}
        return np.array([exact.get(w.tobytes(), -1) for w in wanted], dtype=np.int64)
    K = np.frombuffer(kb, dtype=">u8").reshape(n, 4)
    W = np.ascontiguousarray(wanted).view(">u8").reshape(len(wanted), 4)
    lead = K[:, 0]
    srt = None
    if n > 1 and not bool(np.all(lead[1:] >= lead[:-1])):  # LMDB hands keys sorted; others may not
        srt = np.argsort(lead, kind="stable")
        lead = lead[srt]
    needles = W[:, 0]
    by = np.argsort(needles)  # sorted needles: each search starts from the last one (cache friendly)
    j = np.empty(len(needles), dtype=np.int64)
    j[by] = np.searchsorted(lead, needles[by])
    j = np.minimum(j, np.int64(n - 1))
    rows = j if srt is None else srt[j]
    hit: np.ndarray = np.asarray(np.all(K[rows] == W, axis=1), dtype=bool)
    out = np.where(hit, rows, np.int64(-1)).astype(np.int64)
    tie = ~hit & (lead[j] == W[:, 0])
    if tie.any():
        exact = {k: i for i, k in enumerate(keys)}
        for i in np.flatnonzero(tie).tolist():
            out[i] = exact.get(wanted[i].tobytes(), -1)
    return out


def _orphaned(prow: np.ndarray, orphans: np.ndarray) -> np.ndarray:
    """Rows that are orphans or descend from one, or whose parents never reach a row without one
    (records whose parents name each other: a cycle no lookup from a root reaches, and which a
    walk of the subtree, as evict and expiry make, would never leave). ``prow``: each row's parent
    row, -1 for none.

    Pointer doubling: after step k each row has looked at its ancestors up to 2^k - 1 away and
    points at the one 2^k away, so a chain of depth d takes log2(d) steps of numpy work; a row
    still pointing somewhere after 64 steps (2^64 blocks deep cannot exist) is on or below a cycle.
    """
    marked = orphans.copy()
    up = prow.copy()
    for _ in range(64):
        live = np.flatnonzero(up >= 0)
        if not live.size:
            break
        marked[live] |= marked[up[live]]
        up[live] = up[up[live]]
    marked |= up >= 0
    return marked


def _shared(values: np.ndarray, pool: dict[float, float]) -> list[float]:
    """``values`` as Python floats, one object per distinct value (blocks of one operation share a
    time: the index keeps one float for all of them)."""
    uniq, inverse = np.unique(values, return_inverse=True)
    objs = [pool.setdefault(v, v) for v in uniq.tolist()]
    return list(map(objs.__getitem__, inverse.tolist()))
