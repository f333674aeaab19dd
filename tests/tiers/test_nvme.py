"""NvmeTier: frames and records in a real LMDB environment under tmp_path.

Many short stories, one per promise of the nvme tier.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore.codecs import get_codec
from kvstore.errors import ConfigError, FrameError, StoreFormatError, StoreLocked
from kvstore.record import BlockRecord
from kvstore.tiers import NvmeTier, TierFull, TierIOError
from kvstore.tiers.lmdb_env import DURABILITY, FREEING_SLACK_PAGES, Durability

SHAPE = (2, 2, 16, 2, 64)  # 16 KiB a block in bf16: frames live in overflow pages, like real ones


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(torch.bfloat16)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def record(i: int, sessions: tuple[str, ...] = ()) -> BlockRecord:
    return BlockRecord(
        key=key(i),
        parent=key(i - 1) if i else bytes(32),
        namespace="ns0",
        position=i,
        tokens=bytes(range(64)),
        sessions=sessions,
        created=1000.0 + i,
        last_access=2000.0 + i,
    )


def open_tier(path: Path, capacity: int = 8 << 20, **kw: object) -> NvmeTier:
    return NvmeTier(path, capacity, get_codec("raw"), **kw)  # type: ignore[arg-type]


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[NvmeTier]:
    t = open_tier(tmp_path / "nvme")
    yield t
    t.close()


def test_round_trip_is_bit_exact_and_records_come_back(tier: NvmeTier) -> None:
    for i in range(5):
        tier.put(key(i), block(i), record(i))
    for i in range(5):
        assert torch.equal(tier.get(key(i)).view(torch.int16), block(i).view(torch.int16))
        assert tier.record(key(i)) == record(i)
    assert sorted(tier.keys()) == [key(i) for i in range(5)]
    assert [r.key for r in tier.iter_records()] == [key(i) for i in range(5)]
    assert tier.usage().blocks == 5


def test_put_without_record_keeps_the_stored_one(tier: NvmeTier) -> None:
    tier.put(key(1), block(1), record(1))
    tier.put(key(1), block(2))  # frame replaced, record kept
    assert torch.equal(tier.get(key(1)), block(2))
    assert tier.record(key(1)) == record(1)
    # a block stored without any record has none to give, and the restart iterator skips it
    tier.put(key(2), block(2))
    with pytest.raises(KeyError):
        tier.record(key(2))
    assert [r.key for r in tier.iter_records()] == [key(1)]
    assert key(2) in tier


def test_missing_keys(tier: NvmeTier) -> None:
    with pytest.raises(KeyError):
        tier.get(key(9))
    with pytest.raises(KeyError):
        tier.get_frame(key(9))
    with pytest.raises(KeyError):
        tier.record(key(9))
    with pytest.raises(KeyError):
        tier.nbytes(key(9))
    assert tier.drop(key(9)) == 0 and key(9) not in tier


def test_drop_frees_room_and_pages_are_reused(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme", capacity=1 << 20)
    stored = 0
    try:
        while True:
            tier.put(key(stored), block(stored), record(stored))
            stored += 1
    except TierFull:
        pass
    assert stored > 20
    full = tier.usage()
    # nvme full: drop [0] -> put [stored] fits in its room
    freed = tier.drop(key(0))
    assert freed >= 16 * 1024 and tier.usage().used_bytes < full.used_bytes
    tier.put(key(stored), block(stored), record(stored))
    assert torch.equal(tier.get(key(stored)), block(stored))
    assert tier.usage().used_bytes <= tier.capacity_bytes
    assert (tmp_path / "nvme" / "data.mdb").stat().st_size <= tier.capacity_bytes
    tier.close()


def test_a_full_store_deletes_and_rewrites_any_number_of_entries(tmp_path: Path) -> None:
    # a delete copies every page it touches: keys spread over the B-trees, as block keys are, need a
    # page each, and a store filled to its capacity once could not delete a few dozen in one go
    tier = open_tier(tmp_path / "nvme", capacity=8 << 20)
    spread = [hashlib.sha256(i.to_bytes(8, "big")).digest() for i in range(10_000)]
    n = 0
    with pytest.raises(TierFull):
        while True:
            tier.put(spread[n], block(n), replace(record(n), key=spread[n]))
            n += 1
    recs = [replace(r, last_access=9000.0) for r in tier.iter_records()]
    assert tier.update_records(recs) == n
    assert {r.last_access for r in tier.iter_records()} == {9000.0}
    assert tier.drop_many(spread[: n - 1]) > 0 and sorted(tier.keys()) == [spread[n - 1]]
    size = (tmp_path / "nvme" / "data.mdb").stat().st_size
    assert size <= tier.capacity_bytes + FREEING_SLACK_PAGES * tier._psize  # deletes' room, no more
    tier.put(spread[n], block(n), replace(record(n), key=spread[n]))  # and it takes new blocks
    tier.close()


def test_tier_full_changes_nothing(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme", capacity=1 << 20)
    i = 0
    with pytest.raises(TierFull, match="evict"):
        while True:
            tier.put(key(i), block(i), record(i))
            i += 1
    before = (tier.usage(), sorted(tier.keys()))
    with pytest.raises(TierFull):
        tier.put(key(1000), block(1000), record(1000))
    assert (tier.usage(), sorted(tier.keys())) == before and key(1000) not in tier
    assert not tier.can_put(block(1000))
    tier.close()


def test_map_grows_from_a_small_start(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme", capacity=8 << 20, map_size_initial=64 * 1024)
    for i in range(200):
        tier.put(key(i), block(i), record(i))
    env = tier._env.env
    assert 3 << 20 < env.info()["map_size"] <= 8 << 20
    assert all(torch.equal(tier.get(key(i)), block(i)) for i in (0, 99, 199))
    tier.close()


def test_reopen_finds_frames_records_sessions_and_namespaces(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme")
    for i in range(3):
        tier.put(key(i), block(i), record(i, sessions=("conv-1",)))
    tier.update_records([record(1, sessions=("conv-1", "conv-2"))])
    tier.put_session("conv-1", {"blocks": 3, "created": 1.5})
    tier.put_session("conv-2", {"blocks": 1})
    tier.drop_session("conv-2")
    tier.put_namespace("ab12", {"model": "m", "tenant": "t"})
    created = tier.created
    tier.close()

    again = open_tier(tmp_path / "nvme")
    assert again.created == created and again.reset_reason is None
    assert [r.sessions for r in again.iter_records()] == [("conv-1",), ("conv-1", "conv-2"), ("conv-1",)]
    assert torch.equal(again.get(key(2)), block(2))
    assert list(again.iter_sessions()) == [("conv-1", {"blocks": 3, "created": 1.5})]
    assert list(again.iter_namespaces()) == [("ab12", {"model": "m", "tenant": "t"})]
    again.close()


def test_damaged_rows_and_a_damaged_creation_time_are_dropped_and_the_store_opens(tmp_path: Path) -> None:
    import lmdb

    tier = open_tier(tmp_path / "nvme")
    tier.put(key(1), block(1), record(1))
    tier.put_session("good", {"blocks": 1})
    tier.put_namespace("ab12", {"model": "m"})
    tier.close()
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"torn", b"\x85\xa2ns", db=env.open_db(b"sessions", txn=txn))  # a map cut short
        txn.put(b"cd34", b"\xc1", db=env.open_db(b"namespaces", txn=txn))  # no msgpack at all
        txn.put(b"created", b"1.7e9\x00", db=env.open_db(b"meta", txn=txn))
    env.close()

    again = open_tier(tmp_path / "nvme")
    assert again.created == 0.0  # unknown, not a reason to refuse the store
    assert list(again.iter_sessions()) == [("good", {"blocks": 1})]
    assert list(again.iter_namespaces()) == [("ab12", {"model": "m"})]
    assert torch.equal(again.get(key(1)), block(1))
    again.close()
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=8)
    with env.begin() as txn:  # dropped from disk, not skipped at every start
        assert txn.get(b"torn", db=env.open_db(b"sessions", txn=txn)) is None
        assert txn.get(b"cd34", db=env.open_db(b"namespaces", txn=txn)) is None
    env.close()


def test_update_records_skips_blocks_that_are_gone(tier: NvmeTier) -> None:
    tier.put(key(1), block(1), record(1))
    assert tier.update_records([record(1).touched(5000.0), record(2)]) == 1
    assert tier.record(key(1)).last_access == 5000.0 and key(2) not in tier


def test_iter_records_spans_many_chunks(tier: NvmeTier) -> None:
    small = torch.zeros(1, 2, 1, 1, 8, dtype=torch.bfloat16)
    n = 4096 + 17  # more than one read chunk
    for i in range(n):
        tier.put(key(i), small, record(i))
    assert [r.position for r in tier.iter_records()] == list(range(n))


def test_another_block_s_frame_under_a_key_is_detected_by_its_length(tmp_path: Path) -> None:
    # two blocks' frames swapped on disk: each is sound in itself; with zstd their lengths differ,
    # and the entry written with each frame says how long it was
    tier = NvmeTier(tmp_path / "nvme", 8 << 20, get_codec("int4", zstd=3))
    tier.put(key(1), block(1), record(1))
    tier.put(key(2), torch.zeros_like(block(2)), record(2))
    one, two = tier.get_frame(key(1)), tier.get_frame(key(2))
    assert len(one) != len(two)
    tier._write(lambda txn: (txn.put(key(1), two, db=tier._blocks), txn.put(key(2), one, db=tier._blocks)))
    for k in (key(1), key(2)):
        with pytest.raises(FrameError, match="not this block's"):
            tier.get(k)
        with pytest.raises(FrameError, match="not this block's"):
            tier.checked_frame(k)  # the frame as it is, for the cluster: checked the same way
    tier.close()


def stored(txn: lmdb.Transaction, k: bytes, db: lmdb._Database) -> bytes:
    value = txn.get(k, db=db)
    assert value is not None
    return bytes(value)


def test_another_block_s_frame_of_the_same_length_under_a_key_is_detected(tmp_path: Path) -> None:
    # int4 without zstd: every frame of a layout has one length; the entry records its frame's CRC
    tier = NvmeTier(tmp_path / "nvme", 8 << 20, get_codec("int4"))
    tier.put(key(1), block(1), record(1))
    tier.put(key(2), block(2), record(2))
    one, two = tier.get_frame(key(1)), tier.get_frame(key(2))
    assert len(one) == len(two)
    tier._write(lambda txn: (txn.put(key(1), two, db=tier._blocks), txn.put(key(2), one, db=tier._blocks)))
    for k in (key(1), key(2)):
        with pytest.raises(FrameError, match="not this block's"):
            tier.get(k)
        with pytest.raises(FrameError, match="not this block's"):
            tier.checked_frame(k)
    tier.close()
    tier = NvmeTier(tmp_path / "nvme", 8 << 20, get_codec("int4"))
    tier.put(key(3), block(3), record(3))
    assert tier.checked_frame(key(3)) == tier.get_frame(key(3))
    tier._debug_corrupt(key(3), 100)
    with pytest.raises(FrameError):
        tier.checked_frame(key(3))  # a damaged frame too
    with pytest.raises(KeyError):
        tier.checked_frame(key(4))
    tier.close()


def test_a_block_moved_whole_under_another_key_is_detected(tmp_path: Path) -> None:
    # frame and entry moved together: they match each other, but the entry's CRC starts from its key
    tier = open_tier(tmp_path / "nvme")
    tier.put(key(1), block(1), record(1))
    tier.put(key(2), block(2), None)  # stored bare: an entry without a record
    for src, dst in ((key(1), key(7)), (key(2), key(8))):

        def move(txn: lmdb.Transaction, src: bytes = src, dst: bytes = dst) -> None:
            txn.put(dst, stored(txn, src, tier._blocks), db=tier._blocks)
            txn.put(dst, stored(txn, src, tier._records), db=tier._records)

        tier._write(move)
        with pytest.raises(FrameError, match="another key"):
            tier.get(dst)
        assert torch.equal(tier.get(src), block(int(src[-1])))
    tier.close()
    damaged: list[bytes] = []
    again = open_tier(tmp_path / "nvme")
    assert [e.key for e in again.iter_index(lambda k, e: damaged.append(k))] == [key(1)]
    assert damaged == [key(7), key(8)]  # an entry without a record is bound to its key too
    again.close()


def test_a_store_written_with_format_1_entries_is_still_read(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme")
    for i in range(1, 4):
        tier.put(key(i), block(i), record(i))

    def to_format_1(txn: lmdb.Transaction) -> None:  # the entries as the format before binding wrote them
        for i in range(1, 4):
            value = stored(txn, key(i), tier._records)
            body = value[16:]
            flen = len(stored(txn, key(i), tier._blocks))
            txn.put(
                key(i), struct.pack("<BBxxII", 1, value[1], flen, zlib.crc32(body)) + body, db=tier._records
            )

    tier._write(to_format_1)
    tier.close()
    again = open_tier(tmp_path / "nvme")
    assert [e.key for e in again.iter_index()] == [key(1), key(2), key(3)]
    assert [c.positions.tolist() for c in again.iter_index_columns()] == [[1, 2, 3]]
    assert again.record(key(2)) == record(2)
    assert torch.equal(again.get(key(2)), block(2))
    # a record update rewrites the entry bound to its key and frame
    moved = record(2, sessions=("s",))
    assert again.update_records([moved]) == 1
    assert again._read(lambda txn: stored(txn, key(2), again._records)[0]) == 2
    assert again.record(key(2)) == moved and torch.equal(again.get(key(2)), block(2))
    again.close()


def test_corrupt_frame_on_disk_is_detected(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme")
    tier.put(key(1), block(1), record(1))
    tier.put(key(2), block(2), record(2))
    frame = tier.get_frame(key(1))
    tier.close()
    # flip one payload byte of [1] in the data file itself
    data = tmp_path / "nvme" / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(frame[100:164])
    assert at > 0
    raw[at + 10] ^= 0x40
    data.write_bytes(raw)

    again = open_tier(tmp_path / "nvme")
    with pytest.raises(FrameError):
        again.get(key(1))
    assert torch.equal(again.get(key(2)), block(2))  # the neighbour is fine
    again.close()


def test_damaged_record_is_skipped_and_reported(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme")
    tier.put(key(1), block(1), record(1))
    tier.put(key(2), block(2), record(2))
    tier.close()
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=8)
    with env.begin(write=True) as txn:
        db = env.open_db(b"records", txn=txn)
        value = txn.get(key(1), db=db)
        assert value is not None
        txn.put(key(1), value[:-3] + b"\xc1\xc1\xc1", db=db)  # the last token bytes damaged
    env.close()

    again = open_tier(tmp_path / "nvme")
    damaged: list[bytes] = []
    assert [r.key for r in again.iter_records(on_damaged=lambda k, e: damaged.append(k))] == [key(2)]
    assert damaged == [key(1)]
    with pytest.raises(FrameError):
        again.record(key(1))
    again.close()


def test_put_frame_checks_the_frame(tier: NvmeTier) -> None:
    frame = get_codec("raw", shuffle=True, zstd=3).encode(block(4))
    tier.put_frame(key(4), frame, record(4))
    assert tier.get_frame(key(4)) == bytes(frame)
    assert torch.equal(tier.get(key(4)), block(4))  # a frame of another codec still decodes
    damaged = bytearray(frame)
    damaged[70] ^= 1
    with pytest.raises(FrameError):
        tier.put_frame(key(5), damaged, record(5))
    assert key(5) not in tier


def test_other_format_version_is_refused(tmp_path: Path) -> None:
    open_tier(tmp_path / "nvme").close()
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreFormatError, match="format version 99"):
        open_tier(tmp_path / "nvme")
    # the refusal released the lock: a fixed store opens again
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()
    open_tier(tmp_path / "nvme").close()
    # version 1 is read, and marked 2: a build of version 1 (which dropped format-2 entries as
    # damaged) now refuses it instead
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=8)
    with env.begin() as txn:
        assert txn.get(b"format_version", db=env.open_db(b"meta", txn=txn)) == b"2"
    env.close()


def test_foreign_lmdb_is_refused(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "other"))
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    with pytest.raises(StoreFormatError, match="not a kvstore"):
        open_tier(tmp_path / "other")


def test_second_opener_in_process_is_refused(tier: NvmeTier) -> None:
    with pytest.raises(StoreLocked, match=str(os.getpid())):
        open_tier(tier.path)


def test_second_process_is_refused_and_can_open_after_close(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    probe = textwrap.dedent(f"""
        from kvstore.codecs import get_codec
        from kvstore.errors import StoreLocked
        from kvstore.tiers import NvmeTier
        try:
            NvmeTier({str(path)!r}, 8 << 20, get_codec("raw")).close()
        except StoreLocked as e:
            print("LOCKED", e)
        else:
            print("OPENED")
    """)
    tier = open_tier(path)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("LOCKED") and f"pid {os.getpid()}" in out.stdout, out.stderr
    tier.close()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "OPENED", out.stderr


def test_sigkill_loses_no_commit_and_leaves_the_store_intact(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    writer = textwrap.dedent(f"""
        import os, signal, sys, torch
        from kvstore.codecs import get_codec
        from kvstore.tiers import NvmeTier
        t = NvmeTier({str(path)!r}, 8 << 20, get_codec("raw"), durability="fast")
        for i in range(40):
            g = torch.Generator().manual_seed(i)
            t.put(i.to_bytes(32, "big"), torch.randn({SHAPE!r}, generator=g).to(torch.bfloat16))
        print("written", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no sync, no close
    """)
    out = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9 and "written" in out.stdout, out.stderr
    # same boot: a process kill, so every commit is there and nothing is wiped
    again = open_tier(path)
    assert again.reset_reason is None
    assert sorted(again.keys()) == [key(i) for i in range(40)]
    assert all(torch.equal(again.get(key(i)), block(i)) for i in range(40))
    again.close()


def test_fast_store_down_with_the_machine_is_wiped(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    tier = open_tier(path, durability="fast")
    tier.put(key(1), block(1), record(1))
    tier.sync()
    tier.put(key(2), block(2), record(2))  # unsynced: the dirty marker is on disk now
    tier._env.env.close()  # the process "dies" without sync or close
    os.close(tier._env._lock_fd)
    # pretend the machine rebooted: the marker names another boot
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        assert txn.get(b"dirty_boot", db=meta) is not None
        txn.put(b"dirty_boot", b"another-boot", db=meta)
    env.close()
    again = open_tier(path)
    assert again.reset_reason is not None and "wiped" in again.reset_reason
    assert again.usage().blocks == 0
    again.close()


def test_synced_fast_store_is_kept_after_a_reboot(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    tier = open_tier(path, durability="fast")
    tier.put(key(1), block(1), record(1))
    tier.sync()  # clean on disk: no marker, whatever happens next
    tier._env.env.close()
    os.close(tier._env._lock_fd)
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin() as txn:
        assert txn.get(b"dirty_boot", db=env.open_db(b"meta", txn=txn, create=False)) is None
    env.close()
    again = open_tier(path)
    assert again.reset_reason is None and torch.equal(again.get(key(1)), block(1))
    again.close()


def test_a_fast_store_reopened_on_the_same_boot_and_synced_is_kept_after_a_reboot(tmp_path: Path) -> None:
    # a process dies with unsynced commits (the marker stays); the next one, on the same boot, reads
    # them, writes nothing and syncs: the store is clean, and a reboot later keeps it
    path = tmp_path / "nvme"
    tier = open_tier(path, durability="fast")
    tier.put(key(1), block(1), record(1))
    tier.sync()
    tier.put(key(2), block(2), record(2))  # unsynced: the dirty marker is on disk now
    tier._env.env.close()
    os.close(tier._env._lock_fd)
    again = open_tier(path, durability="fast")
    assert again.reset_reason is None
    again.sync()
    again.close()
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin() as txn:
        assert txn.get(b"dirty_boot", db=env.open_db(b"meta", txn=txn, create=False)) is None
    env.close()
    after_reboot = open_tier(path)
    assert after_reboot.reset_reason is None
    assert torch.equal(after_reboot.get(key(1)), block(1)) and torch.equal(after_reboot.get(key(2)), block(2))
    after_reboot.close()


@pytest.mark.parametrize("mode", list(Durability))
def test_every_durability_mode_stores_and_reopens(tmp_path: Path, mode: Durability) -> None:
    tier = open_tier(tmp_path / mode.value, durability=mode.value)  # as a config names it
    assert tier._env.env.flags()["sync"] == DURABILITY[mode]["sync"]
    assert tier._env.env.flags()["metasync"] == DURABILITY[mode]["metasync"]
    assert not tier._env.env.flags()["writemap"]
    tier.put(key(1), block(1), record(1))
    tier.close()
    again = open_tier(tmp_path / mode, durability=mode)
    assert torch.equal(again.get(key(1)), block(1))
    again.close()


def test_bad_parameters_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="durability"):
        open_tier(tmp_path / "a", durability="yolo")
    with pytest.raises(ConfigError, match="capacity"):
        open_tier(tmp_path / "b", capacity=1000)


def test_closed_tier_refuses_work(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme")
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(TierIOError, match="closed"):
        tier.get(key(1))
    with pytest.raises(TierIOError, match="closed"):
        tier.put(key(1), block(1))


def test_iter_index_matches_iter_records(tier: NvmeTier) -> None:
    for i in range(6):
        tier.put(key(i), block(i), record(i, sessions=("a",) if i % 2 else ()))
    tier.put(key(50), block(50))  # no record: in neither
    index = list(tier.iter_index())
    records = list(tier.iter_records())
    assert [e.key for e in index] == [r.key for r in records] == [key(i) for i in range(6)]
    for e, r in zip(index, records, strict=True):
        assert (e.parent, e.namespace, e.position, e.sessions, e.created, e.last_access) == (
            r.parent,
            r.namespace,
            r.position,
            r.sessions,
            r.created,
            r.last_access,
        )
        assert e.nbytes == tier.nbytes(e.key)


def test_index_columns_match_iter_index(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvstore.tiers.nvme_records._INDEX_CHUNK", 3)  # 7 entries: three chunks
    for i in range(6):
        tier.put(key(i), block(i), record(i, sessions=("a",) if i % 2 else ()))
    tier.put(key(50), block(50))  # no record: in neither
    tier._write(lambda txn: txn.put(key(3), b"\x01\x01" + bytes(80), db=tier._records))  # damaged: in neither
    seen: list[bytes] = []
    cols = list(tier.iter_index_columns(on_damaged=lambda k, e: seen.append(k)))
    index = list(tier.iter_index(on_damaged=lambda k, e: None))
    assert seen == [key(3)] and len(cols) == 3
    rows = [
        (k, bytes(p), int(pos), ns, s, float(c), float(a))
        for c_ in cols
        for k, p, pos, ns, s, c, a in zip(
            c_.keys,
            c_.parents,
            c_.positions,
            c_.namespaces,
            c_.sessions,
            c_.created,
            c_.last_access,
            strict=True,
        )
    ]
    assert rows == [
        (e.key, e.parent, e.position, e.namespace, e.sessions, e.created, e.last_access) for e in index
    ]
    assert [r[0] for r in rows] == [key(i) for i in (0, 1, 2, 4, 5)]


def test_drop_many_in_one_transaction(tier: NvmeTier) -> None:
    for i in range(4):
        tier.put(key(i), block(i), record(i))
    sizes = sum(tier.nbytes(key(i)) for i in (0, 2))
    assert tier.drop_many([key(0), key(2), key(99)]) == sizes
    assert sorted(tier.keys()) == [key(1), key(3)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 23), st.integers(1, 600)), min_size=1, max_size=60))
def test_random_puts_and_drops_never_pass_the_capacity(ops: list[tuple[int, int]]) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        tier = open_tier(Path(d) / "nvme", capacity=1 << 20, map_size_initial=128 * 1024)
        model: dict[bytes, torch.Tensor] = {}
        for n, (k, tokens) in enumerate(ops):
            if tokens % 5 == 0 and key(k) in model:
                # drop [k]
                assert tier.drop(key(k)) > 0
                del model[key(k)]
            else:
                # put [k] with a block of `tokens` tokens (256 bytes each in the frame)
                b = torch.full((1, 2, tokens, 1, 64), float(n), dtype=torch.bfloat16)
                before = sorted(tier.keys())
                try:
                    tier.put(key(k), b, record(k))
                    model[key(k)] = b
                except TierFull:
                    assert sorted(tier.keys()) == before  # nothing changed
                    event("tier full")
            used = tier.usage()
            assert used.used_bytes <= used.capacity_bytes
            assert (Path(d) / "nvme" / "data.mdb").stat().st_size <= tier.capacity_bytes
            assert sorted(tier.keys()) == sorted(model)
        for kb, b in model.items():
            assert torch.equal(tier.get(kb), b)
        tier.close()


def test_readers_keep_reading_while_the_map_grows(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme", capacity=16 << 20, map_size_initial=64 * 1024)
    tier.put(key(0), block(0), record(0))
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                assert torch.equal(tier.get(key(0)), block(0))
                tier.usage()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(1, 300):  # 64 KiB -> several doublings while the readers run
        tier.put(key(i), block(i), record(i))
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert tier._env.env.info()["map_size"] >= 4 << 20
    assert sorted(tier.keys()) == [key(i) for i in range(300)]
    tier.close()


def test_debug_corrupt_makes_get_fail_closed(tier: NvmeTier) -> None:
    tier.put(key(1), block(1), record(1))
    tier._debug_corrupt(key(1), 5000)
    with pytest.raises(FrameError):
        tier.get(key(1))
    assert tier.record(key(1)) == record(1)  # the record is separate and intact
    with pytest.raises(KeyError):
        tier._debug_corrupt(key(2), 0)


@pytest.mark.parametrize("entry", [b"", b"\x02\x01\x00", bytes(12)])
def test_a_records_entry_too_short_to_read_is_a_bad_copy_and_can_be_replaced(
    tmp_path: Path, entry: bytes
) -> None:
    # an empty entry made get raise IndexError (not a bad copy: never deleted), a put over it and
    # its drop raised struct errors
    tier = open_tier(tmp_path / "nvme")
    tier.put(key(1), block(1), record(1))
    tier._write(lambda txn: txn.put(key(1), entry, db=tier._records))
    with pytest.raises(FrameError):
        tier.get(key(1))
    tier.put(key(1), block(1), None)  # the record was lost with the entry: the block is stored bare
    assert torch.equal(tier.get(key(1)), block(1))
    tier._write(lambda txn: txn.put(key(1), entry, db=tier._records))
    assert tier.drop(key(1)) >= 0 and key(1) not in tier
    tier.close()


def test_a_path_that_is_a_file_is_refused_as_such(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(TierIOError, match="cannot be opened: a file, not a directory"):
        NvmeTier(f, 1 << 22, get_codec("raw"))


def test_a_dangling_symlink_is_named_as_such(tmp_path: Path) -> None:
    link = tmp_path / "nvme"
    link.symlink_to(tmp_path / "gone")  # mkdir would say "File exists"
    with pytest.raises(
        TierIOError, match=r"a symbolic link to .*gone, which does not exist; point \[nvme\] path"
    ):
        open_tier(link)


def stored_store(path: Path, blocks: int = 40) -> int:
    """A closed store of ``blocks`` blocks at ``path``; returns its data.mdb's size."""
    t = open_tier(path)
    for i in range(blocks):
        t.put(key(i), block(i), record(i))
    t.close()
    return (path / "data.mdb").stat().st_size


TRUNCATED = """
import sys
from pathlib import Path
from kvstore.codecs import get_codec
from kvstore.daemon.startup import stored_blocks
from kvstore.errors import StoreFormatError
from kvstore.tiers import NvmeTier
path = Path(sys.argv[1])
print("blocks", stored_blocks(path), flush=True)  # what start-up reports before the store opens
try:
    NvmeTier(path, 8 << 20, get_codec("raw"))
except StoreFormatError as e:
    print("refused:", e)
"""


def test_a_truncated_store_is_refused_not_a_crash(tmp_path: Path) -> None:
    # a copy or restore cut short: LMDB maps the missing pages, and reading one is a SIGBUS (the
    # process dies, nothing said); so in a child process, whose death the test can see
    path = tmp_path / "nvme"
    size = stored_store(path)
    os.truncate(path / "data.mdb", size // 2)
    p = subprocess.run(
        [sys.executable, "-c", TRUNCATED, str(path)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert "blocks None" in p.stdout
    assert f"refused: nvme store {path}: data.mdb is truncated ({size // 2} of its" in p.stdout, p.stdout
    assert "start empty" in p.stdout


def lose_main_db_root(path: Path) -> None:
    """What a power loss may leave of a store with unsynced commits: the newest meta page on disk, the
    main database's root page it names not (zeros). Offsets of LMDB's 64-bit MDB_meta, after the
    16-byte page header: the main db's md_root at 128, mm_txnid at 144."""
    f = path / "data.mdb"
    data = bytearray(f.read_bytes())
    psize = 4096
    _, newest = max((struct.unpack_from("<Q", data, m * psize + 144)[0], m) for m in (0, 1))
    root = struct.unpack_from("<Q", data, newest * psize + 128)[0]
    data[root * psize : (root + 1) * psize] = bytes(psize)
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("durability", ["fast", "balanced"])
def test_a_store_whose_newest_pages_did_not_reach_the_disk(tmp_path: Path, durability: str) -> None:
    # "fast": the marker that would say the machine went down unsynced sits behind the lost page, and
    # its read fails: the store is wiped as promised, not refused (the daemon stayed down); another
    # mode syncs its commits, so such damage is no crash's: refused, saying what is wrong
    path = tmp_path / "nvme"
    t = open_tier(path, durability="fast")
    for i in range(40):
        t.put(key(i), block(i), record(i))
    t._env.env.close()  # the process goes down with the machine, without sync or close
    os.close(t._env._lock_fd)
    lose_main_db_root(path)
    if durability == "balanced":
        with pytest.raises(StoreFormatError):
            open_tier(path, durability=durability)
        return
    again = open_tier(path, durability=durability)
    assert (
        again.reset_reason is not None and "damaged" in again.reset_reason and "wiped" in again.reset_reason
    )
    assert again.usage().blocks == 0
    again.put(key(1), block(1), record(1))
    assert torch.equal(again.get(key(1)), block(1))
    again.close()


def test_a_truncated_fast_store_is_wiped_as_one_down_with_the_machine(tmp_path: Path) -> None:
    # durability "fast" syncs nothing: after a power loss the meta page may be on disk and the pages
    # it names not; the marker that would say so cannot be read (its read would be the SIGBUS)
    path = tmp_path / "nvme"
    t = open_tier(path, durability="fast")
    for i in range(40):
        t.put(key(i), block(i), record(i))
    t.close()
    os.truncate(path / "data.mdb", (path / "data.mdb").stat().st_size // 2)
    again = open_tier(path, durability="fast")
    assert (
        again.reset_reason is not None and "truncated" in again.reset_reason and "wiped" in again.reset_reason
    )
    assert again.usage().blocks == 0
    again.put(key(1), block(1), record(1))
    again.close()


def test_a_damaged_page_is_refused_as_damage_not_as_a_full_disk(tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    size = stored_store(path)
    with open(path / "data.mdb", "r+b") as f:  # every page but the two meta pages lost (zeroed)
        f.seek(2 * 4096)
        f.write(bytes(size - 2 * 4096))
    with pytest.raises(StoreFormatError, match="is damaged .*; move the directory aside") as e:
        open_tier(path)
    assert "free space" not in str(e.value)


def test_a_close_whose_sync_fails_says_so_and_still_lets_the_store_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a disk that fails fsync cannot be had here: the sync is made to fail as LMDB's would
    t = open_tier(tmp_path / "nvme")
    t.put(key(0), block(0), record(0))

    def failing() -> None:
        raise TierIOError("nvme store: sync failed: mdb_env_sync: Input/output error; check the disk")

    monkeypatch.setattr(t._env, "_sync", failing)
    with pytest.raises(TierIOError, match="sync failed"):
        t.close()
    t.close()  # closed: a second close is a no-op, not a second failure
    again = open_tier(tmp_path / "nvme")  # the lock went with it
    assert key(0) in again
    again.close()
