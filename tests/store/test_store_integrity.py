"""Store: damaged frames fail closed (deleted, counted, a miss, never served); threads at once."""

from __future__ import annotations

import threading
from pathlib import Path

import lmdb
import pytest

from kvstore.keys import block_keys
from kvstore.results import EvictFilter
from tests.store.storekit import NS, T, close_to, kv, same, served_right, tokens


def test_a_damaged_ram_frame_is_a_miss_and_takes_its_descendants(make_store) -> None:
    s = make_store(nvme=False)
    toks, data = tokens(6), kv(6 * T)
    s.put(NS, toks, data)
    assert s.lookup(NS, toks).tiers[:2] == ["ram", "ram"]
    keys = block_keys(NS, toks)
    s.tiers[1]._debug_corrupt(keys[1], 200)  # a payload byte of block 1's frame
    # get stops at block 1: block 0 is served, 1 is deleted and counted, 2.. go with it (no orphans)
    got = s.get(NS, toks)
    assert got.matched_blocks == 1 and same(got.kv, data[:, :, :T])
    assert s.stats().tiers["ram"].corrupt == 1
    assert s.lookup(NS, toks).matched_blocks == 1
    assert s.check_integrity() == []


def test_a_damaged_ram_frame_falls_back_to_the_good_nvme_copy(make_store) -> None:
    s = make_store()
    toks, data = tokens(6), kv(6 * T)
    s.put(NS, toks, data)
    assert s.flush(10)
    keys = block_keys(NS, toks)
    s.tiers[1]._debug_corrupt(keys[0], 100)
    got = s.get(NS, toks)
    # block 0 came from nvme (int4), never from the damaged ram frame
    assert got.matched_blocks == 6 and got.tiers[0] == "nvme"
    assert close_to(got.kv[:, :, :T], data[:, :, :T])
    assert s.stats().tiers["ram"].corrupt == 1
    assert s.check_integrity() == []


def flip_lmdb_value(path: Path, key: bytes, offset: int) -> None:
    env = lmdb.open(str(path), max_dbs=8, subdir=True)
    try:
        blocks = env.open_db(b"blocks")
        with env.begin(write=True, db=blocks) as txn:
            frame = bytearray(txn.get(key) or b"")
            frame[offset] ^= 0xFF
            txn.put(key, bytes(frame))
    finally:
        env.close()


def with_block_2_damaged_on_disk(make_store, tmp_path: Path):
    """A store holding 5 blocks on disk, reopened after a byte of block 2's frame was flipped.
    Returns the store, the tokens, the K/V put and the blocks' keys."""
    path = tmp_path / "lmdb"
    s = make_store(path=path)
    toks, data = tokens(5), kv(5 * T)
    s.put(NS, toks, data)
    s.close()
    keys = block_keys(NS, toks)
    flip_lmdb_value(path, keys[2], 100)  # inside block 2's frame on disk
    return make_store(path=path), toks, data, keys


def test_a_damaged_lmdb_value_is_never_served(make_store, tmp_path: Path) -> None:
    s2, toks, data, keys = with_block_2_damaged_on_disk(make_store, tmp_path)
    assert s2.lookup(NS, toks).matched_blocks == 5  # lookup reads no frames
    got = s2.get(NS, toks)
    assert got.matched_blocks == 2 and close_to(got.kv, data[:, :, : 2 * T])
    st = s2.stats()
    assert st.tiers["nvme"].corrupt == 1
    assert s2.lookup(NS, toks).matched_blocks == 2
    assert not {keys[2], keys[3], keys[4]} & set(s2.tiers[-1].keys())
    assert s2.check_integrity() == []


def with_a_frame_of_another_model(make_store, path: Path, session: str | None = None):
    """A store on ``path`` holding 3 blocks of NS, whose block 1's value on disk was replaced by the
    same tokens' block 1 of a model of another dtype (sound in itself: only the layout it holds
    tells). Returns the reopened store, the tokens and the K/V put."""
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout

    other = Namespace("other-model", KVLayout(**{**NS.layout.to_dict(), "dtype": "float16"}))
    s = make_store(path=path)
    toks, data = tokens(3), kv(3 * T)
    s.put(NS, toks, data, session=session)
    s.put(other, toks, data.to(other.layout.torch_dtype))
    s.close()
    env = lmdb.open(str(path), max_dbs=8, subdir=True)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        txn.put(block_keys(NS, toks)[1], bytes(txn.get(block_keys(other, toks)[1]) or b""))
    env.close()
    return make_store(path=path), toks, data


def test_a_frame_of_another_model_under_a_block_s_key_is_a_miss_not_an_error(
    make_store, tmp_path: Path
) -> None:
    s2, toks, data = with_a_frame_of_another_model(make_store, tmp_path / "lmdb")
    got = s2.get(NS, toks)  # decoded into a tensor of this model's layout
    assert got.matched_blocks == 1 and close_to(got.kv, data[:, :, :T])
    assert s2.stats().tiers["nvme"].corrupt == 1
    assert s2.lookup(NS, toks).matched_blocks == 1 and s2.check_integrity() == []
    s2.close()


def test_a_frame_of_another_model_is_a_bad_copy_also_where_it_is_decoded_alone(
    make_store, tmp_path: Path
) -> None:
    s2, toks, _ = with_a_frame_of_another_model(make_store, tmp_path / "lmdb", session="s")
    r = s2.prefetch("s", to="ram")  # each block decoded on its own, then stored in ram
    assert (r.moved, r.failed) == (1, 1)
    assert s2.stats().tiers["nvme"].corrupt == 1 and s2.lookup(NS, toks).matched_blocks == 1
    assert s2.check_integrity() == []


def test_many_threads_at_once_keep_the_store_sound(make_store) -> None:
    s = make_store(hbm_blocks=6, ram_blocks=6)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(12):
                seed = w * 100 + i % 4
                toks, data = tokens(3, seed=seed), kv(3 * T, seed)
                s.put(NS, toks, data, session=f"w{w}")
                got = s.get(NS, toks)
                # whatever survived is this prompt's data (exact from raw tiers, int4 within error)
                keys = block_keys(NS, toks)
                for j, tier in enumerate(got.tiers):
                    part, want = got.kv[:, :, j * T : (j + 1) * T], data[:, :, j * T : (j + 1) * T]
                    assert served_right(s, keys[j], tier, part, want)
                s.lookup(NS, toks)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert s.flush(30)
    assert s.check_integrity() == []
    st = s.stats()
    assert all(ts.used <= ts.capacity for ts in st.tiers.values())
    assert st.pinned == 0


def test_a_damaged_copy_reported_for_a_block_put_again_since_deletes_nothing(make_store) -> None:
    # a reader found block 0's copy damaged, and before it said so the block was evicted and put
    # again: the copy under that key now is the new block's. Deleting it left the index naming a
    # copy that was gone
    s = make_store(nvme=False)
    toks, data = tokens(2), kv(2 * T)
    s.put(NS, toks, data)
    key = block_keys(NS, toks)[0]
    stale = s._index.get(key)
    s.evict(EvictFilter(all=True))
    s.put(NS, toks, data)
    with s._lock:
        s._mover.corrupt(stale, 0)
    assert s.check_integrity() == []
    got = s.get(NS, toks)
    assert got.matched_blocks == 2 and same(got.kv, data)


@pytest.mark.parametrize("refused", ["every delete", "the descendants' deletes"])
def test_a_damaged_copy_the_disk_cannot_delete_is_a_miss_every_time_not_an_error(
    make_store, tmp_path: Path, monkeypatch, refused: str
) -> None:
    """A damaged LMDB page fails the deletes that a bad frame brings (MDB_CORRUPTED: a TierIOError):
    the get still answers the blocks before it, now and on every later get, never serves it, and
    the prompt can be stored again (no block is left indexed with no copy, taken as present)."""
    from kvstore.tiers.base import TierIOError

    s2, toks, data, keys = with_block_2_damaged_on_disk(make_store, tmp_path)
    nvme = s2.tiers[-1]

    def damaged(*_: object) -> None:
        raise TierIOError("nvme store: damaged (mdb_del: MDB_CORRUPTED: Located page was wrong type)")

    if refused == "every delete":
        monkeypatch.setattr(nvme, "drop", damaged)
    monkeypatch.setattr(nvme, "drop_many", damaged)
    for _ in range(3):
        got = s2.get(NS, toks)
        assert got.matched_blocks == 2 and close_to(got.kv, data[:, :, : 2 * T])
    assert s2.stats().tiers["nvme"].corrupt == 1  # found bad once, then no longer indexed
    assert s2.lookup(NS, toks).matched_blocks == 2
    assert set(keys[3:]) <= set(nvme.keys())  # still on disk, unread
    r = s2.put(NS, toks, data)
    assert (r.stored, r.present) == (3, 2)
    got = s2.get(NS, toks)
    assert got.matched_blocks == 5 and close_to(got.kv, data)
