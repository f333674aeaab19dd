"""The nvme tier: codec frames (int4 + zstd by default) and block records in LMDB on local disk.

::

    <path>/data.mdb, lock.mdb    the LMDB environment (lmdb_env.py: locking, format, durability)
    <path>/kvstore.lock          flock'd while a process has the store open (StoreLocked otherwise)

    db blocks      key (32 B) -> frame
    db records     key (32 B) -> entry: frame length and CRC, CRC from the key, record (nvme_format.py)
    db sessions    name       -> msgpack map
    db namespaces  ns id      -> msgpack map
    db meta        format_version, created, dirty_boot

A block's frame and entry are written in one transaction. Every block has an
entry (it gives the frame's length without touching the frame's pages), so
keys, sizes and the restart index (``iter_index_columns``: ~1 s of CPU per
million records here, fixed fields read by numpy) come from the small records
db. ``get`` checks and decodes the frame straight from the memory map inside
the read transaction: the decode's output (or, with ``out=``, the caller's
tensor) is the only copy.

Capacity is hard twice over:

- ``used_bytes`` is the pages the B-trees really hold (``mdb_stat``: branch +
  leaf + overflow pages of every db, plus the two meta pages) times the page
  size. A write is refused (TierFull, nothing changed) when ``used`` minus
  the replaced entry plus the new one would pass ``capacity - reserve``. The
  estimate of one value: a frame takes ``ceil((len + 16) / psize)`` overflow
  pages plus its leaf node; a small value (entry, session) its node (8 B
  header + 32 B key + value + 2 B slot) times 1.5, for leaves left half
  empty by splits under random keys. The reserve (64 pages + two of the
  largest frames) is room for copy-on-write: pages a commit frees are reused
  only after the next commit, since the previous snapshot must stay intact.
- The LMDB map never grows past the capacity: a MapFullError grows it by
  doubling from ``map_size_initial`` up to the capacity and retries; at the
  capacity the write is TierFull. So the data file never exceeds the
  configured bytes.

One tier over one LMDB environment whose transactions must see each other's layout: frames,
records and size estimates here; the reads of every record for a restart in nvme_records.py; the
sessions, namespaces and meta's access-time slot in nvme_maps.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import lmdb
import torch

from kvstore.codecs import Codec, check_frame, decode_frame
from kvstore.codecs.frame import HEADER_SIZE, Buffer, stored_checksum
from kvstore.errors import ConfigError, FrameError, KVStoreError
from kvstore.keys import KEY_BYTES
from kvstore.layout import KVLayout
from kvstore.record import BlockRecord
from kvstore.tiers import lmdb_env
from kvstore.tiers.base import Tier, TierFull, TierName, TierUsage
from kvstore.tiers.lmdb_env import DEFAULT_DURABILITY, Durability
from kvstore.tiers.nvme_format import (
    EntryDecoder,
    check_binding,
    frame_crc,
    frame_len,
    pack_entry,
    with_frame,
)
from kvstore.tiers.nvme_maps import NvmeMaps
from kvstore.tiers.nvme_records import RecordReads

log = logging.getLogger(__name__)

MIN_CAPACITY = 1 << 20
DROP_BATCH = 256  # keys deleted (or records rewritten) in one transaction
DEFAULT_MAP_SIZE = 64 << 20
_RECORD_GUESS = 512  # bytes of a records entry when can_put has only the block to go on


class NvmeTier(RecordReads, NvmeMaps, Tier):
    """Frames and records in an LMDB environment under ``path`` (a directory), at most ``capacity_bytes``.

    Raises StoreLocked when another process has ``path`` open, StoreFormatError
    when it holds another format version, ConfigError for bad parameters.
    """

    name = TierName.NVME

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        codec: Codec,
        *,
        durability: Durability | str = DEFAULT_DURABILITY,
        map_size_initial: int = DEFAULT_MAP_SIZE,
        head_codec: Codec | None = None,
        head_blocks: int = 1,
    ) -> None:
        """``head_codec``: the codec of a prefix's first ``head_blocks`` blocks (record.position <
        head_blocks; the attention sink's), None = every block with ``codec`` (see ``codec_for``)."""
        if (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes < MIN_CAPACITY
        ):
            raise ConfigError(
                f"nvme capacity must be an integer of at least {MIN_CAPACITY} bytes, got {capacity_bytes!r}"
            )
        if (
            isinstance(map_size_initial, bool)
            or not isinstance(map_size_initial, int)
            or map_size_initial < 1
        ):
            raise ConfigError(f"nvme map_size_initial must be a positive integer, got {map_size_initial!r}")
        if isinstance(head_blocks, bool) or not isinstance(head_blocks, int) or head_blocks < 0:
            raise ConfigError(f"nvme head_blocks must be a non-negative integer, got {head_blocks!r}")
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.head_codec = head_codec if head_blocks else None
        self.head_blocks = head_blocks if head_codec is not None else 0
        ceiling = capacity_bytes - capacity_bytes % 4096
        self._env = lmdb_env.open_environment(
            path, durability=durability, ceiling=ceiling, map_size=min(map_size_initial, ceiling)
        )
        self.path = self._env.path
        self.durability = self._env.durability
        self.created = self._env.created
        self.reset_reason = self._env.reset_reason
        self._psize = self._env.psize
        # LMDB's largest node kept in a leaf (me_nodemax); larger values go to overflow pages.
        self._nodemax = (((self._psize - 16) // 2) & ~1) - 2
        self._blocks, self._records = self._env.dbs["blocks"], self._env.dbs["records"]
        self._sessions, self._namespaces = self._env.dbs["sessions"], self._env.dbs["namespaces"]
        self._read, self._write = self._env.read, self._env.write
        self._frame_bytes: dict[tuple[KVLayout, bool], int] = {}  # (layout, head?) -> largest frame seen
        self._largest = 0  # the largest frame's cost written since open (sizes the reserve)

    # -- size estimates ---------------------------------------------------------------
    def _value_cost(self, vlen: int) -> int:
        node = 8 + KEY_BYTES + vlen
        if node > self._nodemax:
            return -(-(vlen + 16) // self._psize) * self._psize + 8 + KEY_BYTES + 8 + 2
        return (node + 2) * 3 // 2

    def _entry_cost(self, frame_len: int, head_and_record: int) -> int:
        return self._value_cost(frame_len) + self._value_cost(head_and_record)

    def _cost_of(self, txn: lmdb.Transaction, key: bytes) -> int:
        value = txn.get(key, db=self._records)
        return 0 if value is None else self._entry_cost(frame_len(value), len(value))

    def _reserve(self) -> int:
        """Room kept free for copy-on-write: 64 pages for B-tree paths, plus two of the largest frames,
        because pages freed by the last commit are reused only after the next one (the previous
        snapshot must stay intact for crash safety)."""
        return 64 * self._psize + 2 * self._largest

    def _admit(self, txn: lmdb.Transaction, new_cost: int, old_cost: int) -> None:
        """TierFull unless replacing ``old_cost`` bytes by ``new_cost`` keeps within the capacity."""
        used = self._env.used_bytes(txn)
        if used - old_cost + new_cost > self.capacity_bytes - self._reserve():
            raise TierFull(
                f"nvme store {self.path}: an entry of ~{new_cost} bytes does not fit "
                f"({used} of {self.capacity_bytes} bytes used); evict first"
            )
        if used - old_cost + new_cost > self._env.disk_room() - self._reserve():
            raise TierFull(
                f"nvme store {self.path}: the filesystem is full (an entry of ~{new_cost} bytes "
                "does not fit); evict, or free disk space"
            )

    # -- blocks -----------------------------------------------------------------------
    def block_cost(self, layout: KVLayout) -> int:
        """A frame of ``layout`` in the codec of most blocks, before zstd (an estimate: zstd's gain
        and LMDB's pages are not known per block)."""
        return HEADER_SIZE + self.codec.payload_bytes(layout)

    def codec_for(self, position: int | None) -> Codec:
        """The codec a block at ``position`` in its prefix is stored with: ``head_codec`` for the
        first ``head_blocks``, ``codec`` otherwise (and when the position is unknown)."""
        if self.head_codec is not None and position is not None and position < self.head_blocks:
            return self.head_codec
        return self.codec

    def _frame_hint(self, layout: KVLayout, head: bool) -> int:
        codec = self.head_codec if head and self.head_codec is not None else self.codec
        return self._frame_bytes.get((layout, head), codec.max_frame_bytes(layout))

    def can_put(self, block: torch.Tensor, position: int | None = None) -> bool:
        """Whether ``put`` of ``block`` at ``position`` in its prefix would fit now; with no position,
        whether a block of either codec would. Changes nothing."""
        need, reserve = self._need(block, position)
        room = min(self.capacity_bytes, self._env.disk_room())  # a full disk is as full as the capacity
        return self.usage().used_bytes + need <= room - reserve

    def could_hold(self, block: torch.Tensor, position: int | None = None) -> bool:
        """Whether ``block`` would fit in an empty store of this capacity (its reserve kept). Changes
        nothing."""
        need, reserve = self._need(block, position)
        return need <= self.capacity_bytes - reserve

    def _need(self, block: torch.Tensor, position: int | None) -> tuple[int, int]:
        """(the entry's estimated bytes, the room kept free beside it) for ``block`` at ``position``."""
        layout = KVLayout.of_block(block)
        heads = (False, True) if position is None else (self.codec_for(position) is not self.codec,)
        frame = max(self._frame_hint(layout, h) for h in heads if not h or self.head_codec is not None)
        return self._entry_cost(frame, _RECORD_GUESS), 64 * self._psize + 2 * max(
            self._largest, self._value_cost(frame)
        )

    def put(self, key: bytes, block: torch.Tensor, record: BlockRecord | None = None) -> int:
        """Encode ``block`` with ``codec_for(record.position)`` and store frame and ``record`` in one
        transaction; returns the estimated bytes.

        ``record=None`` keeps the key's stored record, if any (and its position picks the codec).
        TierFull / TierIOError: nothing changed.
        """
        if record is not None:
            position: int | None = record.position
        else:  # the stored record's position, read only when a head policy makes it matter
            position = self._stored_position(key) if self.head_codec is not None else None
        codec = self.codec_for(position)
        frame = codec.encode(block)
        hint = (KVLayout.of_block(block), codec is not self.codec)
        self._frame_bytes[hint] = max(
            len(frame), self._frame_bytes.get(hint, 0)
        )  # a hint; races are harmless
        return self._put_frame(key, frame, record)

    def _stored_position(self, key: bytes) -> int | None:
        """The position in the stored record of ``key``; None when absent, stored bare or damaged."""
        try:
            return self.record(key).position
        except (KeyError, FrameError):
            return None

    def put_frame(self, key: bytes, frame: Buffer, record: BlockRecord | None = None) -> int:
        """Store an already-encoded frame (checked first: FrameError if damaged) and ``record``, as it is:
        the caller chose its codec (``codec_for(position)`` gives the tier's choice). The store never
        hands nvme a ready frame; it re-encodes from the best copy through ``put``."""
        check_frame(frame)
        return self._put_frame(key, frame, record)

    def _put_frame(self, key: bytes, frame: Buffer, record: BlockRecord | None) -> int:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise KVStoreError(f"nvme keys are {KEY_BYTES} bytes, got {key!r:.40}")
        if record is not None and record.key != key:
            raise KVStoreError("the record's key differs from the key it is stored under")
        flen, fcrc = memoryview(frame).nbytes, stored_checksum(frame)
        if fcrc is None:
            raise FrameError(f"a frame of {flen} bytes is shorter than a frame header")
        packed = pack_entry(key, flen, fcrc, record) if record is not None else None

        def txn_put(txn: lmdb.Transaction) -> int:
            value = packed
            if value is None:
                old = txn.get(key, db=self._records)
                value = (
                    with_frame(key, old, flen, fcrc) if old is not None else pack_entry(key, flen, fcrc, None)
                )
            cost = self._entry_cost(flen, len(value))
            self._largest = max(self._largest, self._value_cost(flen))
            self._admit(txn, cost, self._cost_of(txn, key))
            txn.put(key, frame, db=self._blocks)
            txn.put(key, value, db=self._records)
            return cost

        return self._write(txn_put)

    def get(
        self, key: bytes, device: torch.device | str | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Check and decode the frame under ``key`` straight from the map onto ``device`` (default CPU),
        or into ``out`` (with the raw codec, one copy from the map into ``out``).

        KeyError when absent, FrameError when the frame is damaged.
        """
        codecs = (self.codec,) if self.head_codec is None else (self.codec, self.head_codec)

        def decode(txn: lmdb.Transaction) -> torch.Tensor:
            frame = txn.get(key, db=self._blocks)
            if frame is None:
                raise KeyError(key)
            # another block's frame under this key (a value moved on disk) is sound in itself: the
            # entry written with the frame, under this key, records its length and CRC
            check_binding(key, txn.get(key, db=self._records), frame)
            return decode_frame(frame, device=device, out=out, codecs=codecs)

        return self._read(decode, buffers=True)

    def checked_frame(self, key: bytes) -> bytes:
        """A copy of the frame stored under ``key``, checked as ``get`` checks it before decoding: sound
        (header, CRC, length) and this block's (the entry written with it under ``key``). KeyError when
        absent, FrameError when damaged or another block's."""

        def copy(txn: lmdb.Transaction) -> bytes:
            frame = txn.get(key, db=self._blocks)
            if frame is None:
                raise KeyError(key)
            check_binding(key, txn.get(key, db=self._records), frame)
            check_frame(frame)
            return bytes(frame)

        return self._read(copy, buffers=True)

    def get_frame(self, key: bytes) -> bytes:
        """A copy of the stored frame, unchecked (the receiver checks it). KeyError when absent."""

        def copy(txn: lmdb.Transaction) -> bytes:
            frame = txn.get(key, db=self._blocks)
            if frame is None:
                raise KeyError(key)
            return bytes(frame)

        return self._read(copy, buffers=True)

    def _debug_corrupt(self, key: bytes, offset: int, mask: int = 0xFF) -> None:
        """Flip bits of byte ``offset`` of the stored frame (rewritten unchecked). For corruption tests only."""

        def flip(txn: lmdb.Transaction) -> None:
            frame = txn.get(key, db=self._blocks)
            if frame is None:
                raise KeyError(key)
            if not 0 <= offset < len(frame):
                raise IndexError(f"offset {offset} is outside the {len(frame)}-byte frame")
            damaged = bytearray(frame)
            damaged[offset] ^= mask
            txn.put(key, bytes(damaged), db=self._blocks)

        self._write(flip)

    def drop(self, key: bytes) -> int:
        def txn_drop(txn: lmdb.Transaction) -> int:
            cost = self._cost_of(txn, key)
            txn.delete(key, db=self._blocks)
            txn.delete(key, db=self._records)
            return cost

        return self._write(txn_drop, frees=True)

    def drop_many(self, keys: Iterable[bytes]) -> int:
        """Remove every key, DROP_BATCH to a transaction (a delete copies the pages it touches: one
        transaction of thousands would need more room than a full store has); return the bytes freed
        (absent keys count 0). On a failure, the batches before it are gone and the rest stay."""
        todo = list(keys)

        def txn_drop(batch: list[bytes], txn: lmdb.Transaction) -> int:
            freed = 0
            for key in batch:
                freed += self._cost_of(txn, key)
                txn.delete(key, db=self._blocks)
                txn.delete(key, db=self._records)
            return freed

        return sum(
            self._write(partial(txn_drop, todo[i : i + DROP_BATCH]), frees=True)
            for i in range(0, len(todo), DROP_BATCH)
        )

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        return self._read(lambda txn: txn.get(key, db=self._records) is not None, buffers=True)

    def keys(self) -> Iterator[bytes]:
        def collect(txn: lmdb.Transaction) -> list[bytes]:
            return [bytes(k) for k in txn.cursor(db=self._records).iternext(keys=True, values=False)]

        return iter(self._read(collect))

    def nbytes(self, key: bytes) -> int:
        cost = self._read(lambda txn: self._cost_of(txn, key), buffers=True)
        if not cost:
            raise KeyError(key)
        return cost

    def usage(self) -> TierUsage:
        def measure(txn: lmdb.Transaction) -> TierUsage:
            blocks = int(txn.stat(self._records)["entries"])
            return TierUsage(self.name, blocks, self._env.used_bytes(txn), self.capacity_bytes)

        return self._read(measure)

    def over_capacity(self) -> bool:
        """Whether the tier holds more than its capacity lets a write leave (it was written under a
        larger ``capacity`` than it is opened with now)."""
        return self._read(lambda txn: self._env.used_bytes(txn)) > self.capacity_bytes - self._reserve()

    # -- records ----------------------------------------------------------------------
    def record(self, key: bytes) -> BlockRecord:
        """The stored record of ``key``. KeyError when absent (or stored without one), FrameError if damaged."""
        value = self._read(lambda txn: txn.get(key, db=self._records))  # bytes: buffers=False
        rec = EntryDecoder().record(key, bytes(value)) if value is not None else None
        if rec is None:
            raise KeyError(key)
        return rec

    def update_records(self, records: Iterable[BlockRecord]) -> int:
        """Rewrite the records of blocks still stored (DROP_BATCH to a transaction, in the room a
        delete may take: a record keeps its size); returns how many were updated. On a failure, the
        batches before it are written and the rest are not."""
        recs = list(records)

        def txn_update(batch: list[BlockRecord], txn: lmdb.Transaction) -> int:
            done = 0
            for rec in batch:
                old = txn.get(rec.key, db=self._records)
                if old is not None:
                    txn.put(rec.key, self._rewritten(txn, old, rec), db=self._records)
                    done += 1
            return done

        return sum(
            self._write(partial(txn_update, recs[i : i + DROP_BATCH]), frees=True)
            for i in range(0, len(recs), DROP_BATCH)
        )

    def _rewritten(self, txn: lmdb.Transaction, old: bytes | memoryview, rec: BlockRecord) -> bytes:
        """``rec`` as the entry replacing ``old``, for the same frame. A format-1 entry recorded no
        frame CRC: it is taken from the frame under the key when that frame is sound and of the
        length the entry recorded (what a format-1 entry could check); otherwise the entry records
        none that fits (0), and the next get finds the frame is not this block's."""
        fcrc = frame_crc(old)
        if fcrc is None:
            frame = txn.get(rec.key, db=self._blocks)
            if frame is not None and len(frame) == frame_len(old):
                try:
                    fcrc = check_frame(frame).checksum
                except FrameError:
                    fcrc = None
        return pack_entry(rec.key, frame_len(old), fcrc or 0, rec)

    # -- lifecycle --------------------------------------------------------------------
    def sync(self) -> None:
        """Flush every commit so far to disk (fsync), whatever the durability mode. TierIOError on failure."""
        self._env.sync()

    def close(self) -> None:
        """Sync, close the environment and release the lock. Idempotent."""
        self._env.close()
