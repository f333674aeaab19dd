"""Rebuilding the index on start: the columnar path (NvmeTier) against the per-record one.

Both read the same LMDB files (built twice, identically) and must give the same index: the
same blocks in the same access order, the same tree, the same orphans dropped from disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch

from kvstore.codecs import get_codec
from kvstore.record import BlockRecord
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.namespaces import NamespaceTable
from kvstore.store.restore import _orphaned, _rows_of, restore
from kvstore.tiers.nvme import NvmeTier

FRAME = bytes(get_codec("raw").encode(torch.zeros((1, 2, 4, 1, 8), dtype=torch.bfloat16)))


def k(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def build(path: Path) -> NvmeTier:
    """A forest on disk (names are keys; access times make the LRU order):

    a0 - a1 - a2 - a3            prompt a
           \\- b2 - b3           prompt b shares a0, a1: a1 has two children
    c0 - c1 - c2 - c3            c1's record is damaged: c2, c3 are orphans' kin
    d1 - d2                      d0 never reached disk: d1 is an orphan, d2 with it
    e0                           no record at all (a bare frame): not indexed
    """
    tier = NvmeTier(path, 8 << 20, get_codec("raw"))
    root = b"R" * 32
    chains = {
        "a": ["a0", "a1", "a2", "a3"],
        "b": ["a0", "a1", "b2", "b3"],
        "c": ["c0", "c1", "c2", "c3"],
        "d": ["d0", "d1", "d2"],
    }
    t = 100.0
    for sessions, names in (
        ((), chains["a"]),
        (("s1",), chains["b"]),
        (("s1", "s2"), chains["c"]),
        ((), chains["d"]),
    ):
        parent = root
        for pos, name in enumerate(names):
            t += 1.0
            rec = BlockRecord(
                key=k(name),
                parent=parent,
                namespace="ns" + name[0],
                position=pos,
                tokens=bytes(16),
                sessions=sessions,
                created=float(pos),
                last_access=t - 50.0 if name == "b2" else t,
            )  # b2: the least recently used
            tier.put_frame(k(name), FRAME, rec)
            parent = k(name)
    tier.put_frame(k("e0"), FRAME, None)
    tier.drop(k("d0"))

    def c1_record(txn: lmdb.Transaction) -> bytes:
        raw = txn.get(k("c1"), db=tier._records)
        assert raw is not None  # put above with a record
        return bytes(raw)

    damaged = bytearray(tier._read(c1_record))
    damaged[-1] ^= 0xFF  # a token byte: only the CRC can tell
    tier._write(lambda txn: txn.put(k("c1"), bytes(damaged), db=tier._records))
    return tier


def snapshot(index: BlockIndex) -> list[tuple[Any, ...]]:
    def name(e: Entry | None) -> str | None:
        return None if e is None else e.key.rstrip(b".").decode()

    return [
        (
            name(e),
            name(e.parent),
            sorted(str(name(c)) for c in e.child_list()),
            e.ns,
            e.sessions,
            e.created,
            e.last_access,
            e.tiers,
        )
        for e in index.entries()
    ]


def test_restore_rebuilds_the_tree_and_drops_damaged_and_orphaned_blocks(tmp_path: Path) -> None:
    tier = build(tmp_path / "nvme")
    index, namespaces = BlockIndex(3), NamespaceTable()
    report = restore(index, tier, 2, namespaces)
    entries, roots, on_disk = snapshot(index), namespaces.roots(), sorted(tier.keys())
    tier.close()
    # c1 (damaged) is dropped, frame and entry: c2, c3 follow it out; d1, d2 are orphans: gone as well
    # prompt b rewrote the records of a0 and a1: they were used after a2 and a3
    assert [e[0] for e in entries] == ["b2", "a2", "a3", "a0", "a1", "b3", "c0"]
    assert report.blocks == 7 and report.orphans == 4 and report.damaged == 1
    assert not {k("c1"), k("c2"), k("d1")} & set(on_disk) and k("e0") in on_disk
    a1 = next(e for e in entries if e[0] == "a1")
    assert a1[1] == "a0" and a1[2] == ["a2", "b2"]  # two children, linked both ways
    assert roots == {"nsa": b"R" * 32, "nsc": b"R" * 32}


def test_rows_of_finds_keys_that_share_their_first_bytes() -> None:
    keys = sorted([bytes(8) + os.urandom(24) for _ in range(50)] + [os.urandom(32) for _ in range(50)])
    wanted = [keys[7], keys[60], b"\xff" * 32, keys[0], bytes(32)]
    rows = _rows_of(keys, np.frombuffer(b"".join(wanted), dtype="V32"))
    assert rows.tolist() == [7, 60, -1, 0, -1]


def test_orphaned_marks_whole_subtrees() -> None:
    # 0 <- 1 <- 2 <- 3 <- 4, and 5 <- 6; 1 is an orphan: 1..4 go, 0, 5 and 6 stay
    prow = np.array([-1, -1, 1, 2, 3, -1, 5])
    orphans = np.array([False, True, False, False, False, False, False])
    assert _orphaned(prow, orphans).tolist() == [False, True, True, True, True, False, False]


def test_orphaned_marks_parent_cycles_and_what_hangs_below_them() -> None:
    # 0 <- 1 (rooted); 2 <-> 3 name each other (damaged records that pass their CRC), 4 below 3:
    # indexed, no lookup from a root reached them, and evict --all walked their subtree forever
    prow = np.array([-1, 0, 3, 2, 3])
    orphans = np.zeros(5, dtype=bool)
    assert _orphaned(prow, orphans).tolist() == [False, False, True, True, True]


def test_restore_drops_records_whose_parents_name_each_other(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme", 8 << 20, get_codec("raw"))
    for name, parent in (("x1", "y1"), ("y1", "x1"), ("a0", None)):
        rec = BlockRecord(
            key=k(name),
            parent=b"R" * 32 if parent is None else k(parent),
            namespace="ns",
            position=0 if parent is None else 1,
            tokens=bytes(16),
            sessions=(),
            created=1.0,
            last_access=1.0,
        )
        tier.put_frame(k(name), FRAME, rec)
    index, namespaces = BlockIndex(3), NamespaceTable()
    report = restore(index, tier, 2, namespaces)
    on_disk = sorted(tier.keys())
    tier.close()
    assert [e[0] for e in snapshot(index)] == ["a0"] and report.orphans == 2
    assert on_disk == [k("a0")]
