"""Operator operations that change the store: evict and prefetch (what only reads: reports.py).

::

    evict(filter)            select (AND of criteria) -> plan -> (dry run: report | act)
      no tier:               drop each selected block and its descendants from every tier
      tier = T:              each selected block held in T goes down one tier (from the last: dropped)
      tier = cluster:        the cluster's copies of the selected blocks are deleted (local ones stay)
      session = S:           also S's own blocks and record in the cluster (cluster.py)
    prefetch(session, to)    copy the session's chain up into tier ``to`` (reads outside the lock);
                             start_block/max_blocks: one slice of the chain, for chunked progress

Pinned blocks are never evicted, not even on request; they are left out.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import replace

import torch

from kvstore.results import (
    EvictFilter,
    EvictResult,
    InvalidFilter,
    InvalidRequest,
    PrefetchResult,
)
from kvstore.store.cluster_admin import ClusterAdmin
from kvstore.store.datapath import DataPath
from kvstore.store.index import TIER_MASK, Entry
from kvstore.store.journal import Journal, RowDrop
from kvstore.store.movement import NO_FRAMES, Frames, Mover
from kvstore.store.parts import StoreParts
from kvstore.store.writeback import WriteBack
from kvstore.tiers.base import TierIOError

# seconds an evict waits in all for what it dropped to be off the disk too: a block being written as
# it was dropped (one block's commit), the session's row (behind at most one block's write); well
# under a client's time-out (5 s by default), which would take an evict done for one not done
OFF_DISK_WAIT = 2.0


class AdminOps:
    """Evict and prefetch over one store's parts. Every method takes ``lock`` itself."""

    def __init__(
        self,
        parts: StoreParts,
        mover: Mover,
        data: DataPath,
        journal: Journal,
        *,
        lease: float,
        writeback: WriteBack | None = None,
        cluster: ClusterAdmin | None = None,
    ) -> None:
        self._lock, self._clock, self._tiers, self._index = parts.lock, parts.clock, parts.tiers, parts.index
        self._pins, self._sessions, self._namespaces = parts.pins, parts.sessions, parts.namespaces
        self._mover = mover
        self._data = data
        self._journal = journal
        self._writeback = writeback
        self._lease = lease
        self._cluster = cluster
        self._parts = parts

    def evict(self, flt: EvictFilter, *, dry_run: bool = False) -> EvictResult:
        """Drop (or, with ``flt.tier``, move down) the blocks ``flt`` selects, descendants included.

        With ``dry_run`` nothing changes and the result lists what would go
        and the bytes it would free per tier. ``flt.session`` selects the
        blocks that session stored, and drops only those no other session
        builds on (a shared system prompt stays). Raises InvalidFilter
        (nothing changed) for a filter without criteria, with an unknown tier, a namespace that is
        not a namespace id, or an ``older_than`` that is not a finite number of seconds >= 0.
        """
        if not flt.selects_anything():
            raise InvalidFilter(
                "the filter selects nothing; give session, older_than, tier, namespace, "
                "model or tenant, or all=True to evict everything"
            )
        flt = _checked(flt)
        names = (*self._tiers.names, *(("cluster",) if self._cluster is not None else ()))
        if flt.tier is not None and flt.tier not in names:
            off = " (the cluster tier is off: [cluster] enabled = false)" if flt.tier == "cluster" else ""
            raise InvalidFilter(f"unknown tier {flt.tier!r}{off}; tiers are {', '.join(names)}")
        # whose conversation the session is: as this host knows it, else as the filter says (a tenant's
        # own evict names its tenant); a tenant criterion naming that tenant narrows nothing
        owner = self._session_owner(flt.session) or flt.tenant
        rest = replace(flt, session=None, tenant=None if flt.tenant == owner else flt.tenant)
        if flt.tier == "cluster":
            assert self._cluster is not None
            with self._lock:
                now = self._clock()
                chosen = [e for e in self._index.entries() if self._selected(e, flt, None, now)]
                if flt.session is None:  # what follows a chosen block goes too: none of it could be found
                    chosen = _with_descendants(chosen)
                chosen_keys = [e.key for e in chosen]
            only_session = flt.session is not None and not replace(rest, tier=None).selects_anything()
            return self._cluster.evict(
                chosen_keys,
                flt.session,
                dry_run=dry_run,
                continued=self._continued,
                tenant=owner,
                within=None if only_session else set(chosen_keys),
            )
        t = None if flt.tier is None else self._tiers.names.index(flt.tier)
        whole = flt.session is not None and not rest.selects_anything()
        with self._lock:
            now = self._clock()
            chosen = [e for e in self._index.entries() if self._selected(e, flt, t, now)]
            freed = dict.fromkeys(self._tiers.names, 0)
            keys: list[bytes] = []
            moved = 0
            seen: set[bytes] = set()
            plan: list[tuple[Entry, bool, bool]] = []  # (block, whole subtree goes, moves down)
            session = flt.session

            def keeps(d: Entry) -> bool:  # a block that keeps its ancestors: read now, or another session's
                return self._mover.pinned(d) or (session is not None and self._shared(d, session))

            kept: dict[bytes, bool] = {}
            for e in chosen:
                if e.key in seen or self._mover.pinned(e):
                    continue
                drops_all = t is None or (t == len(self._tiers) - 1 and e.tiers & TIER_MASK == 1 << t)
                if drops_all:
                    if self._index.any_below(e, keeps, kept):
                        continue  # pinned below, or another session's conversation goes on below it
                    for d in self._index.subtree(e):
                        if d.key not in seen:
                            seen.add(d.key)
                            keys.append(d.key)
                            for dt in d.tier_list():
                                freed[self._tiers.names[dt]] += self._tiers[dt].nbytes(d.key)
                    plan.append((e, True, False))
                else:
                    assert t is not None
                    seen.add(e.key)
                    keys.append(e.key)
                    freed[self._tiers.names[t]] += self._tiers[t].nbytes(e.key)
                    # what Mover.evict_from does: no copy above it and none in the next tier, it moves down
                    bit = 1 << t
                    down = t < self._tiers.last and not e.tiers & (bit - 1) and not e.tiers & (bit << 1)
                    moved += down
                    plan.append((e, False, down))
            displaced = 0
            row: RowDrop | None = None  # the evicted session's row deleted from the disk
            dropped: list[bytes] = []  # the blocks that left the store
            if not dry_run:
                stayed: set[bytes] = set()
                before = len(self._index)
                for e, drops_all, down in plan:
                    if self._index.get(e.key) is not e:
                        continue
                    if drops_all:
                        self._mover.drop_block(e)
                        continue
                    assert t is not None
                    nbytes = self._tiers[t].nbytes(e.key)
                    if not self._mover.evict_from(
                        t, e, for_room=False
                    ):  # it stays (nowhere to go: the disk refuses it)
                        stayed.add(e.key)
                        freed[self._tiers.names[t]] -= nbytes
                        moved -= down
                    elif down and self._index.get(e.key) is not e:
                        moved -= 1  # no tier below had room for it: it went, not down
                keys = [k for k in keys if k not in stayed]
                # blocks that left the store and were not chosen: room made below for the moved ones
                displaced = max(0, before - len(self._index) - sum(1 for k in keys if k not in self._index))
                # the conversation goes with its blocks: all of them (the session the only criterion),
                # or the last of those it tagged; evict --session S --older-than D keeps its younger part
                if (
                    flt.session is not None
                    and t is None
                    and (whole or not any(flt.session in e.sessions for e in self._index.entries()))
                    and self._sessions.remove(flt.session)
                ):
                    row = self._journal.forget_session(flt.session)
                dropped = [k for k in keys if k not in self._index]
        result = EvictResult(
            blocks=len(keys),
            bytes_freed={k: v for k, v in freed.items() if v},
            moved=moved,
            keys=keys,
            dry_run=dry_run,
            displaced=displaced,
            not_done="" if dry_run else self._off_disk(dropped, row, synced=bool(keys) and t != 0),
        )
        if flt.session is not None and t is None and self._cluster is not None:
            try:  # the whole conversation, or its cluster copies among the blocks chosen here
                remote = self._cluster.evict(
                    list(keys),  # this host's blocks of it (the cluster's record may not name them)
                    flt.session,
                    dry_run=dry_run,
                    continued=self._continued,
                    tenant=owner,
                    within=None if whole else set(keys),
                )
            except InvalidRequest as e:  # the cluster is down: this host's part stands, and says so
                away = f"{e}; evict --session again once it is back"
                return replace(result, not_done="; ".join(x for x in (result.not_done, away) if x))
            gone = list(dict.fromkeys([*keys, *remote.keys]))  # a block evicted here and there counts once
            result = EvictResult(
                blocks=len(gone),
                bytes_freed={**result.bytes_freed, **remote.bytes_freed},
                moved=moved,
                keys=gone,
                dry_run=dry_run,
                not_done="; ".join(x for x in (result.not_done, remote.not_done) if x),
                displaced=displaced,
            )
        return result

    def _off_disk(self, keys: list[bytes], row: RowDrop | None, *, synced: bool) -> str:
        """Wait (lock not held) until what an evict dropped is off the disk too, as a kill would find
        it: blocks the writer was writing as they were dropped (it deletes them again once written)
        and the session's row (deleted on the writer's thread). What is not, said: a kill before it
        is would bring it back at the next start. Then, with ``synced`` (blocks left a tier below hbm)
        or a row deleted, the deletes are synced to the disk: a durability but ``safe`` does not sync
        each commit, and with no commit after them a power loss would roll them back."""
        deadline = time.monotonic() + OFF_DISK_WAIT
        left = self._writeback.settle(keys, OFF_DISK_WAIT) if self._writeback is not None and keys else []
        parts = []
        if left:
            parts.append(
                f"{len(left)} evicted block(s) are still on disk (a write under way, or a delete the disk "
                "refused, retried each second); until they are gone a daemon killed brings them back"
            )
        if row is not None:
            if not row.settled.wait(max(0.0, deadline - time.monotonic())):
                parts.append(
                    "the session's row is not deleted from disk yet; a daemon killed before it is keeps it"
                )
            elif row.error is not None:
                parts.append(
                    f"the session's row could not be deleted from disk ({row.error}; tried again at each "
                    "flush): a daemon killed before it is keeps it"
                )
        if self._tiers.nvme is not None and (synced or row is not None):
            try:
                self._tiers.nvme.sync()
            except TierIOError as e:
                parts.append(
                    f"the deletes could not be synced to disk ({e}): a power loss may bring them back"
                )
        return "; ".join(parts)

    def prefetch(
        self, session: str, to: str = "ram", *, start_block: int = 0, max_blocks: int | None = None
    ) -> PrefetchResult:
        """Copy the blocks of ``session`` held below tier ``to`` up into it (making room there).

        Only blocks ``start_block .. start_block+max_blocks-1`` of the session's
        chain (root first, the positions ``session()`` shows) are visited; the
        defaults visit the whole chain. The result's ``blocks`` is the chain's
        length and ``remaining`` how many blocks after the slice a next call
        (``start_block + visited``) can still bring up: 0 at the end of the
        chain, and 0 after a block that could not be read (nothing after it
        can be used). KeyError when the session is unknown; InvalidRequest for
        an unknown tier or a negative start_block/max_blocks.
        """
        if to not in self._tiers.names:
            raise InvalidRequest(f"unknown tier {to!r}; tiers are {', '.join(self._tiers.names)}")
        for name, v in (("start_block", start_block), ("max_blocks", max_blocks)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise InvalidRequest(f"prefetch {name} must be a non-negative integer, got {v!r}")
        target = self._tiers.names.index(to)
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                raise KeyError(f"unknown session {session!r}")
            tail = self._index.get(s.tail) if s.tail is not None else None
            whole = self._index.chain(tail) if tail is not None else []
            end = len(whole) if max_blocks is None else min(len(whole), start_block + max_blocks)
            chain = whole[start_block:end]
            handle = self._pins.pin([e.key for e in chain], self._lease)
        moved = present = failed = moved_bytes = 0
        broken = False
        try:
            for e in chain:
                with self._lock:
                    gone = self._index.get(e.key) is not e
                    up = not gone and e.highest() <= target
                if up:
                    present += 1
                    continue
                ns = self._namespaces.get(e.ns)
                layout = None if ns is None else ns.layout
                got = None if gone else self._data.read(e, torch.device("cpu"), layout=layout)
                if got is None:
                    failed += 1
                    broken = True
                    break  # the chain is broken here: nothing after it can be used
                block, t = got
                frame = self._data.encode_for(target, block) if t > target else None  # before the lock
                ready: Frames = {e.key: (target, frame)} if frame is not None else NO_FRAMES
                with self._lock:
                    if t <= target:
                        present += 1
                    elif self._mover.promote(e, block, target, t, ready):
                        moved += 1
                        moved_bytes += self._tiers[target].nbytes(e.key)
                    else:
                        failed += 1
        finally:
            with self._lock:
                self._pins.release(handle)
        return PrefetchResult(
            session=session,
            to=to,
            moved=moved,
            present=present,
            failed=failed,
            start_block=start_block,
            blocks=len(whole),
            remaining=0 if broken else max(0, len(whole) - max(end, start_block)),
            bytes_moved=moved_bytes,
        )

    # -- internals (lock held) ----------------------------------------------------------
    def _selected(self, e: Entry, flt: EvictFilter, t: int | None, now: float) -> bool:
        if t is not None and not e.tiers & (1 << t):
            return False
        if flt.session is not None and e.sessions != (flt.session,):
            return False
        if flt.older_than is not None and e.last_access > now - flt.older_than:
            return False
        if flt.namespace is not None and e.ns != flt.namespace:
            return False
        if flt.model is not None or flt.tenant is not None:
            ns = self._namespaces.get(e.ns)
            if ns is None or flt.model not in (None, ns.model) or flt.tenant not in (None, ns.tenant):
                return False
        return True

    def _shared(self, e: Entry, session: str) -> bool:
        """(Lock held.) Whether ``e`` belongs to more than ``session``: stored by another session (or
        none), or the end of another session's prefix."""
        return e.sessions != (session,) or bool(self._sessions.ending_at(e.key) - {session})

    def _continued(self, keys: list[bytes], session: str) -> set[bytes]:
        """Those of ``keys`` this host knows something other than ``session`` builds on (the rule evict
        --session keeps locally, for the cluster's copies): a block of theirs, or one another session
        ends at, in the block's subtree. Takes the lock."""
        memo: dict[bytes, bool] = {}
        with self._lock:
            entries = [e for e in map(self._index.get, keys) if e is not None]
            return {
                e.key for e in entries if self._index.any_below(e, lambda d: self._shared(d, session), memo)
            }

    def _session_owner(self, session: str | None) -> str | None:
        """The tenant whose conversation ``session`` is here; None when this host does not know it."""
        if session is None:
            return None
        with self._lock:
            ns = self._parts.session_namespace(session)
        return None if ns is None else ns.tenant


def _with_descendants(entries: list[Entry]) -> list[Entry]:
    """``entries`` and every block below them, each once (one walk, however many of them are chosen)."""
    seen: set[bytes] = set()
    out: list[Entry] = []
    for e in entries:
        stack = [e]
        while stack:
            d = stack.pop()
            if d.key in seen:
                continue
            seen.add(d.key)
            out.append(d)
            stack.extend(d.child_list())
    return out


def _checked(flt: EvictFilter) -> EvictFilter:
    """``flt`` with its namespace id in lower case; InvalidFilter for criteria that could only
    select by accident (a NaN age selects every block, a mistyped namespace id none)."""
    age = flt.older_than
    if age is not None and (
        isinstance(age, bool) or not isinstance(age, (int, float)) or not math.isfinite(age) or age < 0
    ):
        raise InvalidFilter(f"older_than must be a finite number of seconds >= 0, got {age!r}")
    ns = flt.namespace
    if ns is not None:
        if not isinstance(ns, str) or not re.fullmatch(r"[0-9a-fA-F]{16}", ns):
            raise InvalidFilter(
                f"namespace {ns!r} is not a namespace id: 16 hex digits, as stats and inspect show them"
            )
        flt = replace(flt, namespace=ns.lower())
    return flt
