"""Session and namespace rows, written to nvme on the writer thread (never on a caller's).

Sessions and namespaces change under the store's lock; their rows reach LMDB
in the order they changed, through the write-through thread's task list, so a
put never waits on a disk commit for them. Without nvme there is nothing to
write and every call is a no-op.
"""

from __future__ import annotations

from kvstore.keys import Namespace
from kvstore.store.sessions import SessionState
from kvstore.store.writer import WriteThrough
from kvstore.tiers.nvme import NvmeTier


class Journal:
    """Writes session and namespace rows through ``writer`` into ``nvme`` (both None: no nvme)."""

    def __init__(self, writer: WriteThrough | None, nvme: NvmeTier | None) -> None:
        self._writer = writer if nvme is not None else None
        self._nvme = nvme

    def session(self, s: SessionState) -> None:
        """Persist ``s`` (replacing the session's row)."""
        writer, nvme = self._writer, self._nvme
        if writer is not None and nvme is not None:
            d = s.to_dict()
            writer.run_soon(lambda: nvme.put_session(s.name, d))

    def forget_session(self, name: str) -> None:
        writer, nvme = self._writer, self._nvme
        if writer is not None and nvme is not None:

            def drop() -> None:
                nvme.drop_session(name)

            writer.run_soon(drop)

    def namespace(self, ns: Namespace) -> None:
        writer, nvme = self._writer, self._nvme
        if writer is not None and nvme is not None:
            d = ns.to_dict()
            writer.run_soon(lambda: nvme.put_namespace(ns.id, d))
