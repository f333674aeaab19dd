"""The nvme tier's reads of every record, in chunks, for the store's restart (``NvmeTier`` is made of
this and nvme_maps.py over one LMDB environment; see nvme.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lmdb

from kvstore.errors import FrameError
from kvstore.record import BlockRecord
from kvstore.tiers.nvme_format import EntryDecoder, IndexColumns, IndexEntry, frame_len

log = logging.getLogger("kvstore.tiers.nvme")

_CHUNK = 4096  # records read per transaction while iterating
_INDEX_CHUNK = 16384  # records read per transaction by iter_index_columns (~5 MB of entries)


class RecordReads:
    """Every record of the records db: whole (``iter_records``), what the index needs
    (``iter_index``), or as columns (``iter_index_columns``); damaged ones handed aside."""

    if TYPE_CHECKING:
        path: Path
        _records: Any

        _read: Callable[..., Any]  # Environment.read

        def _entry_cost(self, frame_len: int, head_and_record: int) -> int: ...

    def iter_records(
        self, on_damaged: Callable[[bytes, FrameError], None] | None = None
    ) -> Iterator[BlockRecord]:
        """Every stored record, in key order, read in chunks (no transaction stays open between them).

        A record that does not decode (or fails its checksum) is skipped and
        handed to ``on_damaged`` (default: logged); blocks stored without a
        record are skipped.
        """
        decoder = EntryDecoder()
        for key, value in self._entries():
            try:
                rec = decoder.record(key, value)
            except FrameError as e:
                self._damaged(key, e, on_damaged)
                continue
            if rec is not None:
                yield rec

    def iter_index(
        self, on_damaged: Callable[[bytes, FrameError], None] | None = None
    ) -> Iterator[IndexEntry]:
        """What the store's index needs of every record (all but the token ids), faster than iter_records.

        Same order and damage handling as ``iter_records``. ``nbytes`` is the
        block's estimated bytes here (what ``nbytes(key)`` says).
        """
        decoder = EntryDecoder()
        costs: dict[tuple[int, int], int] = {}  # blocks of a layout mostly share their sizes
        for key, value in self._entries():
            sizes = (frame_len(value), len(value))
            nbytes = costs.get(sizes)
            if nbytes is None:
                nbytes = costs[sizes] = self._entry_cost(*sizes)
            try:
                entry = decoder.index_entry(key, value, nbytes)
            except FrameError as e:
                self._damaged(key, e, on_damaged)
                continue
            if entry is not None:
                yield entry

    def iter_index_columns(
        self, on_damaged: Callable[[bytes, FrameError], None] | None = None
    ) -> Iterator[IndexColumns]:
        """What ``iter_index`` gives, as columns, a chunk of records at a time (same order, same
        checks, damaged records handed to ``on_damaged``): rebuilding the index of a million blocks
        makes no per-record tuple and decodes the fixed fields with numpy."""
        decoder = EntryDecoder()
        after: bytes | None = None
        while True:
            keys, values = self._read(partial(self._columns, after=after))
            if not keys:
                return
            cols = decoder.index_columns(keys, values)
            for key, err in cols.damaged:
                self._damaged(key, err, on_damaged)
            yield cols
            if len(keys) < _INDEX_CHUNK:
                return
            after = keys[-1]

    def _columns(self, txn: lmdb.Transaction, after: bytes | None) -> tuple[list[bytes], list[bytes]]:
        """Up to _INDEX_CHUNK keys and values of the records db after ``after`` (from the start if None)."""
        cur = txn.cursor(db=self._records)
        if not (cur.first() if after is None else cur.set_range(after)):
            return [], []
        if after is not None and cur.key() == after and not cur.next():
            return [], []
        # without buffers=True, lmdb hands out bytes
        pairs = cast(list[tuple[bytes, bytes]], list(islice(cur.iternext(), _INDEX_CHUNK)))
        return [k for k, _ in pairs], [v for _, v in pairs]

    def _damaged(
        self, key: bytes, err: FrameError, on_damaged: Callable[[bytes, FrameError], None] | None
    ) -> None:
        if on_damaged is None:
            log.warning("nvme store %s: record of %s is damaged: %s", self.path, key.hex(), err)
        else:
            on_damaged(key, err)

    def _entries(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, records value), in chunks of _CHUNK per read transaction."""
        after: bytes | None = None
        while True:
            chunk = self._read(partial(self._chunk, after=after))
            yield from chunk
            if len(chunk) < _CHUNK:
                return
            after = chunk[-1][0]

    def _chunk(self, txn: lmdb.Transaction, after: bytes | None) -> list[tuple[bytes, bytes]]:
        """Up to _CHUNK (key, value) pairs of the records db after ``after`` (from the start if None)."""
        cur = txn.cursor(db=self._records)
        if after is None:
            if not cur.first():
                return []
        else:
            if not cur.set_range(after):
                return []
            if cur.key() == after and not cur.next():
                return []
        # without buffers=True, lmdb hands out bytes
        return cast(list[tuple[bytes, bytes]], list(islice(cur.iternext(), _CHUNK)))
