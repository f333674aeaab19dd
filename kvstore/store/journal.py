"""Session and namespace rows, written to nvme.

Sessions change under the store's lock; their rows reach LMDB through the
write-through thread's task list, so a put never waits on a disk commit for
them. A row changed again before its write ran is written once, as it is last:
a conversation put faster than the disk commits holds one task, not one per
put. A namespace's row is written at once, on the caller's thread, when the
store first meets the namespace (rare: once per model and tenant), so that it
is on disk before any of its blocks. Without nvme there is nothing to write and
every call is a no-op.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.keys import Namespace
from kvstore.store.sessions import SessionState
from kvstore.store.writer import WriteThrough
from kvstore.tiers.nvme import NvmeTier

log = logging.getLogger("kvstore.store")

# Session rows whose write failed that are kept to write again. Sessions come and go by the
# thousand while a disk fails; past this the oldest are given up, and once the disk is back every
# session is written again from memory instead (namespace rows are few, bounded by the wire's
# MAX_NAMESPACES, and always kept).
MAX_FAILED_SESSION_ROWS = 4096

_Key = tuple[str, str]
_REWRITE: _Key = ("sessions", "*")  # the task that writes every session row again


@dataclass
class RowDrop:
    """A session row's delete queued on the writer thread: ``settled`` once it ran (``error``: why it
    failed; it is kept and run again) or a later row of the session replaced it before it ran."""

    settled: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class Journal:
    """Writes session and namespace rows through ``writer`` into ``nvme`` (both None: no nvme).

    A row whose write fails (a full or failing disk) is kept, the latest per name, and written
    again by ``retry`` (the store's flush does, and answers not durable while any is left). At
    most MAX_FAILED_SESSION_ROWS session rows are kept: past it the oldest are given up (counted
    in ``given_up``) and ``retry`` writes every session ``sessions()`` returns instead. A run of
    failures is logged once, when it starts, and once when a write succeeds again."""

    def __init__(
        self,
        writer: WriteThrough | None,
        nvme: NvmeTier | None,
        sessions: Callable[[], list[SessionState]] | None = None,
    ) -> None:
        """``sessions()``: every session as it is now (called by ``retry``, without the store's lock
        held: it takes it)."""
        self._writer = writer if nvme is not None else None
        self._nvme = nvme
        self._sessions = sessions
        self._lock = threading.Lock()
        self._failed: dict[_Key, Callable[[], None]] = {}  # namespace rows
        self._failed_sessions: OrderedDict[_Key, Callable[[], None]] = OrderedDict()  # oldest first
        # rows whose task is queued and not started: the latest write of each (True: a retry's)
        self._waiting: dict[_Key, tuple[Callable[[], None], bool]] = {}
        self._drops: dict[_Key, RowDrop] = {}  # session rows' deletes queued and not yet run
        self._rewrite_all = False  # session rows were given up: write every session again
        self._failing = 0  # writes failed since the last one that succeeded
        self._warned_given_up = False  # in this run of failures
        self.given_up = 0  # session rows dropped from the retry set

    def session(self, s: SessionState) -> None:
        """Persist ``s`` (replacing the session's row)."""
        nvme = self._nvme
        if nvme is not None:
            d = s.to_dict()
            self._run(("session", s.name), lambda: nvme.put_session(s.name, d))

    def forget_session(self, name: str) -> RowDrop | None:
        """Delete the session's row (on the writer thread). Returns its RowDrop, settled once the
        delete has run (a failed one says why, and is kept and run again, as any row's write) or a
        later row of the session replaced it before it ran (the session made again); None without
        nvme."""
        nvme = self._nvme
        if nvme is None or self._writer is None:
            return None
        row = RowDrop()
        key = ("session", name)

        def drop() -> None:
            with self._lock:
                self._drops.pop(key, None)
            try:
                nvme.drop_session(name)
            except Exception as e:
                row.error = str(e) or type(e).__name__
                raise
            finally:
                row.settled.set()

        with self._lock:
            earlier = self._drops.pop(key, None)
        if earlier is not None:
            earlier.settled.set()  # this delete replaces it
        self._run(key, drop)
        with self._lock:
            if not row.settled.is_set():
                self._drops[key] = row
        return row

    def namespace(self, ns: Namespace) -> None:
        """Persist a namespace's row now, on the caller's thread (once per namespace a store meets),
        before any block of it can reach the disk: queued behind other rows, it could land after the
        first blocks, and a kill between the two would leave blocks whose owner (model, tenant) no
        filter matches. A write that fails is kept and written again, as any row's."""
        nvme = self._nvme
        if nvme is None or self._writer is None:
            return
        d = ns.to_dict()
        key: _Key = ("namespace", ns.id)

        def write() -> None:
            nvme.put_namespace(ns.id, d)

        try:
            write()
        except Exception as err:  # a full or failing disk
            self._failed_write(key, write, err)
            return
        self._written(key)

    @property
    def pending(self) -> int:
        """Rows whose last write failed, not yet written (1 more while every session is to be
        written again)."""
        with self._lock:
            return len(self._failed) + len(self._failed_sessions) + self._rewrite_all

    def retry(self) -> None:
        """Queue again every row whose write failed (on the writer thread, in their order); after
        session rows were given up, one task that makes the session table on disk what it is in
        memory instead (_rewrite_sessions)."""
        with self._lock:
            rewrite, self._rewrite_all = self._rewrite_all, False
            if rewrite and self._sessions is not None:
                self._failed[_REWRITE] = self._rewrite_sessions  # kept until it succeeds
            failed = list(self._failed.items())
            kept = list(self._failed_sessions.items())
        for key, write in failed:
            self._run(key, write, again=True)
        for key, write in kept:
            self._run(key, write, again=True)

    def _rewrite_sessions(self) -> None:
        """(Writer thread.) Every session row on disk as the session is in memory now, and no row of
        a session that is not: the rows given up are covered, dropped sessions' rows included. The
        sessions are read when this runs, so a change made meanwhile is in it, or queued after it."""
        nvme, sessions = self._nvme, self._sessions
        assert nvme is not None and sessions is not None
        now = {s.name: s for s in sessions()}
        for name in [name for name, _ in nvme.iter_sessions() if name not in now]:
            nvme.drop_session(name)
        for s in now.values():
            nvme.put_session(s.name, s.to_dict())
        with self._lock:  # the rows kept to retry are older than what was just written
            self._failed_sessions.clear()

    def _run(self, key: _Key, write: Callable[[], None], *, again: bool = False) -> None:
        writer = self._writer
        if writer is None:
            return
        with self._lock:
            queued = key in self._waiting
            if queued and again:
                return  # the row waiting is later than the one kept to retry
            self._waiting[key] = (write, again)
            replaced = self._drops.pop(key, None) if queued else None
        if replaced is not None:  # a later row of the session: the delete queued will not run
            replaced.settled.set()
        if queued:
            return  # the task queued for this row writes it as it is now

        def task() -> None:
            with self._lock:
                write, again = self._waiting.pop(key)
                if again and self._kept(key) is not write:
                    return  # a later row of the same name was written (or failed) meanwhile
            try:
                write()
            except Exception as err:  # a full or failing disk: kept, written again by retry
                self._failed_write(key, write, err)
                return
            self._written(key)

        writer.run_soon(task)

    def _written(self, key: _Key) -> None:
        with self._lock:
            # this row, or a later one, is on disk: none is pending
            self._failed.pop(key, None)
            self._failed_sessions.pop(key, None)
            failed, self._failing, self._warned_given_up = self._failing, 0, False
        if failed:
            log.info("nvme: session and namespace rows are written again (%d writes had failed)", failed)

    def _kept(self, key: _Key) -> Callable[[], None] | None:
        """(Journal lock held.) The write kept for ``key``, if its last write failed."""
        return self._failed_sessions.get(key) if key[0] == "session" else self._failed.get(key)

    def _failed_write(self, key: _Key, write: Callable[[], None], err: Exception) -> None:
        given_up, warn_given_up = 0, False
        with self._lock:
            self._failing += 1
            first = self._failing == 1
            if key[0] != "session":
                self._failed[key] = write
            else:
                self._failed_sessions.pop(key, None)  # to the end: the newest
                self._failed_sessions[key] = write
                while len(self._failed_sessions) > MAX_FAILED_SESSION_ROWS:
                    self._failed_sessions.popitem(last=False)
                    given_up += 1
                if given_up:
                    self.given_up += given_up
                    self._rewrite_all = self._sessions is not None
                    warn_given_up, self._warned_given_up = not self._warned_given_up, True
        if first:  # once per run of failures, not per row: a failing disk fails them all
            log.warning(
                "nvme: a %s row could not be written (%s); rows are kept and written again by the next "
                "flush (flush answers not durable until then); further failures are not logged until "
                "a write succeeds",
                key[0],
                err,
            )
        if warn_given_up:
            log.warning(
                "nvme: more than %d session rows failed to write; the oldest are given up, and every "
                "session is written again once the disk takes writes",
                MAX_FAILED_SESSION_ROWS,
            )
