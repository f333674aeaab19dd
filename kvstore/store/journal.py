"""Session and namespace rows, written to nvme on the writer thread (never on a caller's).

Sessions and namespaces change under the store's lock; their rows reach LMDB
in the order they changed, through the write-through thread's task list, so a
put never waits on a disk commit for them. Without nvme there is nothing to
write and every call is a no-op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvstore.keys import Namespace
from kvstore.store.sessions import SessionState
from kvstore.store.writer import WriteThrough
from kvstore.tiers.nvme import NvmeTier


class Journal:
    """Writes session and namespace rows through ``writer`` into ``nvme`` (both None: no nvme).

    A row whose write fails (a full or failing disk) is kept, the latest per name, and written
    again by ``retry`` (the store's flush does, and answers not durable while any is left)."""

    def __init__(self, writer: WriteThrough | None, nvme: NvmeTier | None) -> None:
        self._writer = writer if nvme is not None else None
        self._nvme = nvme
        self._lock = threading.Lock()
        self._failed: dict[tuple[str, str], Callable[[], None]] = {}

    def session(self, s: SessionState) -> None:
        """Persist ``s`` (replacing the session's row)."""
        nvme = self._nvme
        if nvme is not None:
            d = s.to_dict()
            self._run(("session", s.name), lambda: nvme.put_session(s.name, d))

    def forget_session(self, name: str) -> None:
        nvme = self._nvme
        if nvme is not None:

            def drop() -> None:
                nvme.drop_session(name)

            self._run(("session", name), drop)

    def namespace(self, ns: Namespace) -> None:
        nvme = self._nvme
        if nvme is not None:
            d = ns.to_dict()
            self._run(("namespace", ns.id), lambda: nvme.put_namespace(ns.id, d))

    @property
    def pending(self) -> int:
        """Rows whose last write failed, not yet written."""
        with self._lock:
            return len(self._failed)

    def retry(self) -> None:
        """Queue again every row whose write failed (on the writer thread, in their order)."""
        with self._lock:
            failed = list(self._failed.items())
        for key, write in failed:
            self._run(key, write, again=True)

    def _run(self, key: tuple[str, str], write: Callable[[], None], *, again: bool = False) -> None:
        writer = self._writer
        if writer is None:
            return

        def task() -> None:
            with self._lock:
                if again and self._failed.get(key) is not write:
                    return  # a later row of the same name was written (or failed) meanwhile
            try:
                write()
            except Exception:
                with self._lock:
                    self._failed[key] = write
                raise  # the writer logs it
            with self._lock:
                self._failed.pop(key, None)  # this row, or a later one, is on disk: none is pending

        writer.run_soon(task)
