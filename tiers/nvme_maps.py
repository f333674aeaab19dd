"""The nvme tier's small maps beside the blocks: sessions, namespaces, and the access-time slot in
meta (``NvmeTier`` is made of this and nvme_records.py over one LMDB environment; see nvme.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import lmdb
import msgpack

from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.tiers.lmdb_env import Environment

log = logging.getLogger("kvstore.tiers.nvme")

_SLOT = b"access_slot"  # meta: the largest access-time slot a run used (see access_slot)


class NvmeMaps:
    """Sessions and namespaces as msgpack maps by name, within the tier's capacity."""

    if TYPE_CHECKING:
        _env: Environment
        _sessions: Any
        _namespaces: Any

        _read: Callable[..., Any]  # Environment.read
        _write: Callable[..., Any]  # Environment.write

        def _admit(self, txn: lmdb.Transaction, new_cost: int, old_cost: int) -> None: ...

        def _value_cost(self, vlen: int) -> int: ...

    def _put_map(self, db: Any, name: str, info: dict[str, Any], what: str) -> None:
        if not isinstance(name, str) or not name:
            raise KVStoreError(f"{what} name must be a non-empty string, got {name!r}")
        value = msgpack.packb(info, use_bin_type=True)
        key = name.encode()

        def txn_put(txn: lmdb.Transaction) -> None:
            self._admit(txn, self._value_cost(len(value)), self._cost_in(txn, db, key))
            txn.put(key, value, db=db)

        self._write(txn_put)

    def _cost_in(self, txn: lmdb.Transaction, db: Any, key: bytes) -> int:
        old = txn.get(key, db=db)
        return self._value_cost(len(old)) if old is not None else 0

    def _iter_map(self, db: Any, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every row of ``db`` that decodes as a map; a damaged one is logged, skipped and deleted
        once the rows are read: one bad row must not keep the store from opening."""
        items = self._read(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db).iternext()])
        damaged = []
        for key, value in items:
            name = key.decode(errors="replace")
            try:
                info = msgpack.unpackb(value, raw=False)
            except (ValueError, msgpack.UnpackException) as e:
                info = e
            if not isinstance(info, dict):
                log.warning("nvme: the %s row %r is damaged (%s); it is dropped", what, name, info)
                damaged.append(key)
                continue
            yield name, info
        if damaged:
            self._write(lambda txn: [txn.delete(k, db=db) for k in damaged], frees=True)

    def put_session(self, name: str, info: dict[str, Any]) -> None:
        """Store (or replace) a session's info (msgpack-able map). TierFull when out of room."""
        self._put_map(self._sessions, name, info, "session")

    def drop_session(self, name: str) -> bool:
        """Forget a session; whether it was there."""
        return self._write(lambda txn: bool(txn.delete(name.encode(), db=self._sessions)), frees=True)

    def iter_sessions(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, info) of every stored session (a snapshot)."""
        return self._iter_map(self._sessions, "session")

    def put_namespace(self, ns_id: str, ns: dict[str, Any]) -> None:
        """Store a namespace's description (``Namespace.to_dict()``) under its id."""
        self._put_map(self._namespaces, ns_id, ns, "namespace")

    def iter_namespaces(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(ns id, description) of every stored namespace (a snapshot)."""
        return self._iter_map(self._namespaces, "namespace")

    def access_slot(self, slot: float) -> float:
        """The access-time slot to restore this store's records with, now that ``slot`` is the one in
        force: the largest any run used (a record's access time lags its last read by up to the slot
        it was written under, and a run with a shorter TTL has a shorter one), kept as that from now
        on. Every slot is at most 10 minutes: that much is the most a block may outlive its TTL."""
        meta = self._env.dbs["meta"]
        stored = self._read(lambda txn: txn.get(_SLOT, db=meta))
        try:
            before = float(bytes(stored).decode()) if stored is not None else 0.0
        except (UnicodeDecodeError, ValueError):  # not ours to trust: the longest a slot is
            before = 600.0
        most = max(slot, before if math.isfinite(before) and before > 0 else 0.0)
        if most != before:
            self._write(lambda txn: txn.put(_SLOT, repr(most).encode(), db=meta))
        return most
