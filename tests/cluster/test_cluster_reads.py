"""Blocks received straight into their places: a get into contiguous host blocks (as the daemon's
staging for a same-host client is) has each value's last block_nbytes read off the socket into the
block itself; a raw frame is then checked there and not copied, any other value is joined and decoded.

host A: put --> cluster (raw frames)        host B: get(out=[block, block, ...]) <-- cluster
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvstore.store.cluster_reads as reads
from kvstore.codecs import get_codec
from kvstore.keys import block_keys
from kvstore.store.engine import Store
from kvstore.tiers.cluster import ClusterUnavailable
from kvstore.tiers.cluster_format import pack_value, record_of
from tests.cluster.conftest import HostFactory
from tests.cluster.rediscluster import LocalCluster
from tests.cluster.test_store_cluster import written
from tests.store.storekit import LAYOUT, NS, T, kv, same, tokens


def places(n: int) -> list[torch.Tensor]:
    """``n`` contiguous blocks, filled with NaN: whatever a read leaves in them shows."""
    return [torch.full(LAYOUT.shape(T), float("nan"), dtype=LAYOUT.torch_dtype) for _ in range(n)]


@pytest.fixture
def placed(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each block's verdict as its value is checked: True where it was received in place and taken as it lay."""
    verdicts: list[bool] = []
    real = reads.decode_placed

    def observed(*args: Any, **kw: Any) -> bool:
        try:
            verdicts.append(real(*args, **kw))
        except Exception:
            verdicts.append(False)
            raise
        return verdicts[-1]

    monkeypatch.setattr(reads, "decode_placed", observed)
    return verdicts


def stored_by_a(host: HostFactory, n: int, seed: int) -> tuple[Store, list[int], torch.Tensor]:
    """Host B, and ``n`` blocks host A stored that reached the cluster (raw frames)."""
    a, b = host("a"), host("b")
    toks, x = tokens(n), kv(n * T, seed=seed)
    a.put(NS, toks, x)
    written(a, n)
    return b, toks, x


def written_over(monkeypatch: pytest.MonkeyPatch, b: Store, out: torch.Tensor, at: int) -> None:
    """After each fetch of B's, byte ``at`` of ``out`` changes: what a same-host client writing into
    its staging while the daemon checks the blocks there would do."""
    tier = b._cluster.cluster  # type: ignore[union-attr]
    fetch = tier.fetch

    def then_written_over(*args: Any, **kw: Any) -> Any:
        values = fetch(*args, **kw)
        out.view(torch.uint8).view(-1)[at] ^= 0xFF
        return values

    monkeypatch.setattr(tier, "fetch", then_written_over)


def stored(rc: LocalCluster, b: Store, key: bytes) -> tuple[Any, str]:
    name = b._cluster.cluster.block_key(key)  # type: ignore[union-attr]
    return rc.node(rc.master_of(name)), name


def test_raw_blocks_are_received_in_place_and_stored_on_the_host(
    host: HostFactory, placed: list[bool]
) -> None:
    b, toks, x = stored_by_a(host, 4, seed=3)
    outs = places(4)
    r = b.get(NS, toks, out=outs)
    assert r.matched_blocks == 4 and r.tiers == ["cluster"] * 4
    assert placed == [True] * 4  # each checked where it landed, none copied
    for j, o in enumerate(outs):
        assert same(o, x[:, :, j * T : (j + 1) * T])
    # B stored them as a put would, and its nvme encodes them from the blocks (no frame was kept)
    assert b.flush(timeout=10)
    assert b.lookup(NS, toks).tiers == ["hbm"] * 4
    nvme = b.tiers.nvme
    assert nvme is not None and all(nvme.get_frame(k) for k in block_keys(NS, toks))
    r = b.get(NS, toks)
    assert r.kv is not None and same(r.kv, x[:, :, : 4 * T])


def test_a_block_damaged_in_redis_is_caught_where_it_landed(
    rc: LocalCluster, host: HostFactory, placed: list[bool]
) -> None:
    b, toks, x = stored_by_a(host, 4, seed=5)
    node, name = stored(rc, b, block_keys(NS, toks)[2])
    value = bytearray(node.get(name))
    value[-3] ^= 0x10  # one bit of the block's own bytes: received into its place, then checked
    node.set(name, bytes(value))
    outs = places(4)
    r = b.get(NS, toks, out=outs)
    assert r.matched_blocks == 2 and r.tiers == ["cluster"] * 2
    assert all(same(outs[j], x[:, :, j * T : (j + 1) * T]) for j in range(2))
    assert node.exists(name) == 0  # deleted, counted, and never stored on B
    assert b.stats().cluster["corrupt"] == 1  # type: ignore[index]
    assert b.lookup(NS, toks).tiers[:2] == ["hbm"] * 2 and len(b.lookup(NS, toks).tiers) == 2


def test_values_whose_last_bytes_are_not_the_block_are_joined_and_decoded(
    rc: LocalCluster, host: HostFactory, placed: list[bool]
) -> None:
    # another host's codec (raw with its bytes shuffled, the same length; raw + zstd of a block zstd
    # cannot shrink, longer than the block) is read whole; a value cut short is refused, not served
    b, toks, x = stored_by_a(host, 4, seed=9)
    keys = block_keys(NS, toks)
    for j, codec in ((1, get_codec("raw", shuffle=True)), (2, get_codec("raw", zstd=1))):
        node, name = stored(rc, b, keys[j])
        rec = record_of(keys[j], node.get(name))
        assert rec is not None
        node.set(name, pack_value(rec, codec.encode(x[:, :, j * T : (j + 1) * T].contiguous())))
    node, name = stored(rc, b, keys[3])
    node.set(name, node.get(name)[:-5])
    outs = places(4)
    r = b.get(NS, toks, out=outs)
    assert r.matched_blocks == 3
    assert all(same(outs[j], x[:, :, j * T : (j + 1) * T]) for j in range(3))
    assert placed[:3] == [True, False, False]
    assert node.exists(name) == 0 and b.stats().cluster["corrupt"] == 1  # type: ignore[index]


def test_a_get_into_one_tensor_is_read_as_before(host: HostFactory, placed: list[bool]) -> None:
    # a block of one [L, 2, tokens, H, D] tensor is not contiguous: nothing is received into it
    b, toks, x = stored_by_a(host, 3, seed=4)
    out = torch.full(LAYOUT.shape(3 * T), float("nan"), dtype=LAYOUT.torch_dtype)
    r = b.get(NS, toks, out=out)
    assert r.matched_blocks == 3 and same(out, x) and placed == []


def test_a_placed_read_spans_batches_and_stops_at_the_damaged_block(
    rc: LocalCluster, host: HostFactory, placed: list[bool]
) -> None:
    # two batches, the next fetched (into its places) while this one is checked (as many blocks as
    # A's hbm and ram hold: a block A kept only on nvme would reach the cluster as int4 left it)
    n = reads.FETCH_BATCH + 4
    b, toks, x = stored_by_a(host, n, seed=12)
    node, name = stored(rc, b, block_keys(NS, toks)[reads.FETCH_BATCH + 2])
    value = bytearray(node.get(name))
    value[-1] ^= 0x01
    node.set(name, bytes(value))
    outs = places(n)
    r = b.get(NS, toks, out=outs)
    assert r.matched_blocks == reads.FETCH_BATCH + 2
    assert all(same(outs[j], x[:, :, j * T : (j + 1) * T]) for j in range(r.matched_blocks))
    assert node.exists(name) == 0 and b.stats().cluster["corrupt"] == 1  # type: ignore[index]


def test_a_block_changed_where_it_landed_is_read_again_and_never_deleted(
    rc: LocalCluster, host: HostFactory, placed: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a same-host client maps its staging, where blocks land: one that writes there while the daemon
    # checks them makes a sound block fail its check in place. The daemon's own copy decides: the
    # block is served from it, and stays in the cluster for every other host
    b, toks, x = stored_by_a(host, 4, seed=13)
    outs = places(4)
    written_over(monkeypatch, b, outs[1], 7)
    r = b.get(NS, toks, out=outs)
    assert r.matched_blocks == 4 and sorted(placed) == [False, True, True, True]
    assert all(same(outs[j], x[:, :, j * T : (j + 1) * T]) for j in range(4))
    assert b.stats().cluster["corrupt"] == 0  # type: ignore[index]
    node, name = stored(rc, b, block_keys(NS, toks)[1])
    assert node.exists(name) == 1


def test_a_block_changed_where_it_landed_while_the_cluster_is_down_is_a_miss_not_deleted(
    rc: LocalCluster, host: HostFactory, placed: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    b, toks, x = stored_by_a(host, 4, seed=15)
    outs = places(4)
    written_over(monkeypatch, b, outs[2], 9)

    def down(keys: Any) -> Any:  # the cluster went down between the fetch and the second read
        raise ClusterUnavailable("the cluster is down")

    monkeypatch.setattr(b._cluster.cluster, "peek", down)  # type: ignore[union-attr]
    r = b.get(NS, toks, out=outs)
    assert r.matched_blocks == 2 and b.stats().cluster["corrupt"] == 0  # type: ignore[index]
    node, name = stored(rc, b, block_keys(NS, toks)[2])
    assert node.exists(name) == 1


def test_outs_over_one_another_get_nothing_received_into_them(host: HostFactory, placed: list[bool]) -> None:
    # a caller's mistake (one tensor given twice): each value is read whole, none fails for the other
    b, toks, x = stored_by_a(host, 2, seed=14)
    one = places(1)[0]
    r = b.get(NS, toks, out=[one, one])
    assert r.matched_blocks == 2 and placed == [] and b.stats().cluster["corrupt"] == 0  # type: ignore[index]


@pytest.mark.parametrize("into_places", [True, False])
def test_a_value_of_another_type_under_a_block_key_is_a_damaged_block_not_an_outage(
    rc: LocalCluster, host: HostFactory, into_places: bool
) -> None:
    # a hash under block 2's key (another program's, an operator's typo): its GETEX answered WRONGTYPE,
    # which took the whole tier down on every host reading the prefix, again after each reconnect,
    # and the blocks before it were not served either
    b, toks, x = stored_by_a(host, 4, seed=11)
    node, name = stored(rc, b, block_keys(NS, toks)[2])
    node.delete(name)
    node.hset(name, "f", "v")
    r = b.get(NS, toks, out=places(4)) if into_places else b.get(NS, toks)
    assert r.matched_blocks == 2 and r.tiers == ["cluster"] * 2
    cl = b.stats().cluster
    assert cl["state"] == "up" and cl["corrupt"] == 1  # type: ignore[index]
    assert node.exists(name) == 0  # deleted as a damaged value is


@pytest.mark.parametrize("later", ["value format", "record version", "frame codec"])
def test_a_block_written_by_a_later_build_is_a_miss_left_for_the_hosts_that_read_it(
    rc: LocalCluster, host: HostFactory, later: str
) -> None:
    """A rolling upgrade: a host of a later build writes blocks this build cannot read (another value
    format, record version or codec). They are a miss here, never deleted: the fleet's newer hosts
    read them still (a damaged value is deleted, as before)."""
    import msgpack

    from kvstore.tiers.cluster_format import MAGIC

    b, toks, x = stored_by_a(host, 4, seed=7)
    node, name = stored(rc, b, block_keys(NS, toks)[2])
    value = bytearray(node.get(name))
    if later == "value format":
        value[:4] = MAGIC[:3] + b"9"
    elif later == "record version":
        head = 4 + 32 + 4  # magic, key, record length (cluster_format._HEAD)
        n = int.from_bytes(value[36:40], "little")
        rec = msgpack.unpackb(bytes(value[head : head + n]), raw=False)
        rec["v"] += 1
        packed = msgpack.packb(rec, use_bin_type=True)
        value = value[:36] + len(packed).to_bytes(4, "little") + packed + value[head + n :]
    else:  # a codec id this build does not know, the frame's checksum made anew over it
        import zlib

        from kvstore.codecs.frame import _CRC_AT, HEADER_SIZE

        at = 40 + int.from_bytes(value[36:40], "little")
        value[at + 5] = 250  # the frame header's codec id byte
        crc = zlib.crc32(bytes(value[at + HEADER_SIZE :]), zlib.crc32(bytes(value[at : at + _CRC_AT])))
        value[at + _CRC_AT : at + _CRC_AT + 4] = crc.to_bytes(4, "little")
    node.set(name, bytes(value))
    r = b.get(NS, toks, out=places(4))
    assert r.matched_blocks == 2
    assert node.exists(name) == 1 and b.stats().cluster["corrupt"] == 0  # type: ignore[index]
