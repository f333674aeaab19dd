"""Two stores standing for two hosts, each with its own tiers and LMDB, sharing one Redis Cluster.

host A: put blocks 0..3 --(write-through, background)--> cluster
host B: lookup -> cluster tiers; get -> from the cluster, checked, decoded, stored locally
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.chains import KeyChain
from kvstore.codecs import get_codec
from kvstore.errors import LayoutError
from kvstore.keys import Namespace
from kvstore.results import EvictFilter, GetResult, InvalidRequest
from kvstore.store.adoption import Adoption
from kvstore.store.engine import Store
from kvstore.tiers.cluster import ClusterUnavailable
from kvstore.tiers.nvme import NvmeTier
from tests.cluster.conftest import HostFactory
from tests.cluster.rediscluster import LocalCluster
from tests.hardening.conftest import wait_until
from tests.store.storekit import LAYOUT, NS, Clock, T, close_to, kv, same, tokens


def got(r: GetResult) -> torch.Tensor:
    assert r.kv is not None
    return r.kv


def written(s: Store, n: int, timeout: float = 10.0) -> None:
    """Wait until ``n`` blocks of ``s`` reached the cluster."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.stats().cluster["written"] >= n:  # type: ignore[index]
            return
        time.sleep(0.02)
    raise AssertionError(f"the cluster got {s.stats().cluster} blocks, not {n}")


def test_host_b_serves_what_host_a_stored_then_from_its_own_tiers(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(4, tail=2), kv(18)
    a.put(NS, toks, x, session="conv-1")
    written(a, 4)
    # B has never seen these tokens: its local tiers miss at block 0, the cluster holds all four
    assert b.lookup(NS, toks).tiers == ["cluster"] * 4
    r = b.get(NS, toks)
    assert r.matched_blocks == 4 and r.tiers == ["cluster"] * 4
    assert same(got(r), x[:, :, : 4 * T])  # raw codec in the cluster: bit-exact
    # B stored them locally as a put would: the next lookup and get stay on this host
    assert b.lookup(NS, toks).tiers == ["hbm"] * 4
    assert same(got(b.get(NS, toks)), x[:, :, : 4 * T])
    st = b.stats().cluster
    assert st is not None and st["hits"] == 4 and st["state"] == "up"
    time.sleep(0.3)
    assert b.stats().cluster["written"] == 0  # type: ignore[index]  # what came from the cluster is not sent back


def test_cluster_hits_and_misses_count_blocks(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(6), kv(24)
    a.put(NS, toks[: 2 * T], x[:, :, : 2 * T])
    written(a, 2)
    assert b.get(NS, toks).tiers == ["cluster"] * 2  # six blocks asked for, two served
    st = b.stats().cluster
    assert st is not None and (st["hits"], st["misses"]) == (2, 4)


def test_local_blocks_then_cluster_blocks_in_one_get(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(6), kv(24, seed=3)
    a.put(NS, toks, x)
    written(a, 6)
    b.put(NS, toks[: 2 * T], x[:, :, : 2 * T])  # B computed the first two blocks itself
    assert b.lookup(NS, toks).tiers == ["hbm", "hbm"] + ["cluster"] * 4
    r = b.get(NS, toks, start_block=1)
    assert r.tiers == ["hbm"] + ["cluster"] * 4 and same(got(r), x[:, :, T:])
    out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.bfloat16)
    assert b.get(NS, toks, out=out).matched_blocks == 6 and same(out, x)


def test_int4_in_the_cluster_is_served_within_its_error(host: HostFactory) -> None:
    a, b = host("a", codec="int4"), host("b", codec="int4")
    toks, x = tokens(3), kv(12, seed=5)
    a.put(NS, toks, x)
    written(a, 3)
    r = b.get(NS, toks)
    assert r.tiers == ["cluster"] * 3 and close_to(got(r), x)


@pytest.mark.parametrize("write_through", [True, False])
def test_frames_read_from_the_cluster_wait_for_nvme_only_while_a_write_will_take_them(
    host: HostFactory, write_through: bool
) -> None:
    a, b = host("a"), host("b", codec="int4", write_through=write_through)
    toks, x = tokens(4), kv(4 * T)
    a.put(NS, toks, x)
    written(a, 4)
    assert b.get(NS, toks).tiers == ["cluster"] * 4
    wb = b._writeback
    assert wb is not None
    deadline = time.monotonic() + 10  # the blocks are stored here after the get answered
    while b.lookup(NS, toks).tiers != ["hbm"] * 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert wb.drain(10)  # what write-through took is written (no flush: it would write the rest)
    assert wb._ready == {}  # offered frames went with their writes, or were never kept
    assert b.flush(10)
    assert b.lookup(NS, toks).tiers == ["hbm"] * 4


def test_a_value_damaged_in_redis_is_deleted_and_a_miss(rc: LocalCluster, host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(16, seed=7)
    a.put(NS, toks, x)
    written(a, 4)
    key = b._cluster.cluster.block_key(_keys(toks)[2])  # type: ignore[union-attr]
    node = rc.node(rc.master_of(key))
    value = bytearray(node.get(key))
    value[-100] ^= 0xFF  # a flipped bit in the frame's payload
    node.set(key, bytes(value))
    r = b.get(NS, toks)
    assert r.matched_blocks == 2 and same(got(r), x[:, :, : 2 * T])  # served up to the damaged block
    assert node.exists(key) == 0  # deleted from the cluster
    assert b.stats().cluster["corrupt"] == 1  # type: ignore[index]
    # unmarked, unlike an operator's evict: a host that holds the block may write it back
    assert b._cluster.cluster.evicted([_keys(toks)[2]]) == [False]  # type: ignore[union-attr]
    # a value moved under another block's key is caught by its header too
    k0, k3 = (b._cluster.cluster.block_key(k) for k in (_keys(toks)[0], _keys(toks)[3]))  # type: ignore[union-attr]
    rc.node(rc.master_of(k3)).set(k3, rc.node(rc.master_of(k0)).get(k0))
    c = host("c")
    assert c.get(NS, toks).matched_blocks == 2  # 0, 1 from the cluster; 2 gone; 3 never reached


def _keys(toks: list[int]) -> list[bytes]:
    from kvstore.keys import block_keys

    return block_keys(NS, toks)


def test_another_tenant_never_sees_the_blocks(rc: LocalCluster, host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(3), kv(12)
    a.put(NS, toks, x)
    written(a, 3)
    other = Namespace(NS.model, LAYOUT, tenant="other-tenant")
    assert b.lookup(other, toks).matched_blocks == 0
    assert b.get(other, toks).matched_blocks == 0
    # no token id appears in a key: each is the hash of a chain
    assert all(len(k.split(b":")[-1]) == 64 for k in rc.keys())


def test_a_session_name_two_tenants_use_on_two_hosts_stays_the_first_one_s_in_the_cluster(
    host: HostFactory,
) -> None:
    # a host refuses a put that continues another tenant's session; the cluster did not: host B's
    # record replaced host A's, and A's evict --session then deleted tenant t's blocks from the cluster
    a, b, c = host("a"), host("b"), host("c")
    u, t = (Namespace(NS.model, LAYOUT, tenant=name) for name in ("u", "t"))
    tu, tt = tokens(4, seed=1), tokens(4, seed=2)
    a.put(u, tu, kv(16, seed=1), session="conv-1")
    written(a, 4)
    time.sleep(0.2)  # the session record follows on the cluster thread
    b.put(t, tt, kv(16, seed=2), session="conv-1")
    written(b, 4)
    time.sleep(0.2)
    assert c.session_tenant("conv-1") == "u"  # the first conversation of the name keeps it
    assert b.stats().cluster["session_dropped"] == 1  # type: ignore[index]
    a.evict(EvictFilter(session="conv-1"))
    assert c.lookup(u, tu).matched_blocks == 0  # u's conversation went from the cluster
    assert c.lookup(t, tt).tiers == ["cluster"] * 4  # t's stayed
    assert c.session_tenant("conv-1") is None  # and so did u's record


def test_sessions_are_seen_and_warmed_up_on_another_host(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(16, seed=2)
    a.put(NS, toks, x, session="conv-9")
    written(a, 4)
    time.sleep(0.2)  # the session record follows on the cluster thread
    d = b.session("conv-9")
    assert d.info.tiers == {"cluster": 4} and d.info.tokens == 4 * T and d.info.namespace == NS.id
    assert [blk.tiers for blk in d.blocks] == [["cluster"]] * 4
    p = b.prefetch("conv-9", to="ram")
    assert (p.moved, p.failed, p.remaining) == (4, 0, 0)
    assert b.session("conv-9").info.tiers["hbm"] == 4  # known here now, from this host's tiers
    assert b.lookup(NS, toks).tiers == ["hbm"] * 4


def test_a_session_from_the_cluster_is_prefetched_from_its_root(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(6), kv(24, seed=3)
    a.put(NS, toks, x, session="S")
    written(a, 6)
    time.sleep(0.2)  # the session record follows on the cluster thread
    with pytest.raises(InvalidRequest, match="from block 0"):
        b.prefetch("S", "ram", start_block=3)  # blocks 3.. cannot be stored here without 0..2
    assert b.lookup(NS, toks).tiers == ["cluster"] * 6  # nothing was stored, nothing recorded
    first = b.prefetch("S", "ram", max_blocks=3)
    assert (first.moved, first.present, first.failed, first.remaining) == (3, 0, 0, 3)
    # not this host's session yet (its tail is not here): shown from the cluster's record, with the
    # blocks this host holds now
    assert b.drain(10)  # (on nvme too)
    assert b.session("S").info.tiers == {"hbm": 3, "nvme": 3, "cluster": 6}
    rest = b.prefetch("S", "ram", start_block=3)
    assert (rest.moved, rest.present, rest.failed, rest.remaining) == (3, 0, 0, 0)
    assert b.session("S").info.tiers["hbm"] == 6 and b.lookup(NS, toks).tiers == ["hbm"] * 6
    # past its end: nothing to do, nothing remaining (a cluster-only session answered -4 here)
    past = host("c").prefetch("S", "ram", start_block=10)
    assert (past.moved, past.failed, past.remaining) == (0, 0, 0)


def test_a_session_another_host_stored_is_shown_with_the_blocks_this_host_holds_too(
    rc: LocalCluster, host: HostFactory
) -> None:
    # B computed the first two blocks itself: inspect showed the session's blocks in the cluster
    # alone, and none at all once the cluster lost its first block, though B could serve them
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(16, seed=31)
    a.put(NS, toks, x, session="conv-1")
    written(a, 4)
    assert a._cluster is not None and a._cluster.drain(5)  # and the session's record
    b.put(NS, toks[: 2 * T], x[:, :, : 2 * T])
    assert b.drain(10)  # on nvme too
    d = b.session("conv-1")
    assert [blk.tiers for blk in d.blocks] == [["hbm", "nvme", "cluster"]] * 2 + [["cluster"]] * 2
    assert d.info.blocks == 4 and d.info.tiers == {"hbm": 2, "nvme": 2, "cluster": 4}
    key = a._cluster.cluster.block_key(_keys(toks)[0])
    assert rc.node(rc.master_of(key)).delete(key) == 1
    d = b.session("conv-1")
    assert [blk.tiers for blk in d.blocks] == [
        ["hbm", "nvme"],
        ["hbm", "nvme", "cluster"],
        ["cluster"],
        ["cluster"],
    ]
    key = a._cluster.cluster.block_key(_keys(toks)[2])
    assert rc.node(rc.master_of(key)).delete(key) == 1
    assert b.session("conv-1").info.blocks == 2  # the blocks after one held nowhere are out of reach


def test_evict_reaches_the_cluster_copies(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(16)
    a.put(NS, toks, x, session="conv-1")
    shared, y = toks[: 2 * T] + tokens(2, seed=9), torch.cat([x[:, :, : 2 * T], kv(8, seed=9)], dim=2)
    a.put(NS, shared, y, session="conv-2")  # builds on conv-1's first two blocks
    written(a, 6)
    time.sleep(0.2)
    dry = b.evict(EvictFilter(session="conv-1", tier="cluster"), dry_run=True)
    assert dry.blocks == 2 and b.lookup(NS, toks).matched_blocks == 4
    # B holds none of it; the cluster's copies of conv-1's own blocks go, those conv-2 builds on stay
    r = b.evict(EvictFilter(session="conv-1"))
    assert r.blocks == 2 and b.lookup(NS, toks).tiers == ["cluster"] * 2
    assert b.session("conv-2").info.tiers == {"cluster": 4}
    with pytest.raises(KeyError):
        b.session("conv-1")
    r = a.evict(EvictFilter(all=True, tier="cluster"))  # A's copies of everything it holds
    assert (
        r.blocks == 4 and a.lookup(NS, shared).tiers == ["hbm"] * 4
    )  # the cluster held 4; local copies stay


def test_the_host_that_evicted_the_cluster_copies_does_not_write_them_again(host: HostFactory) -> None:
    # its next local hit, a quarter of the TTL on, refreshed their TTL, found them absent, took them
    # for lost and wrote them all back: the operator's evict undone by the host that ran it
    a = host("a", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=8)
    a.put(NS, toks, x, session="conv-1")
    written(a, 4)
    assert a.evict(EvictFilter(all=True, tier="cluster")).blocks == 4
    time.sleep(0.6)
    assert a.get(NS, toks).tiers == ["hbm"] * 4
    time.sleep(1.0)
    assert a.stats().cluster["written"] == 4  # type: ignore[index]
    assert host("b").lookup(NS, toks).matched_blocks == 0


def test_blocks_evicted_from_the_cluster_by_one_host_are_not_written_back_by_another_that_serves_them(
    rc: LocalCluster, host: HostFactory
) -> None:
    # B read them from the cluster and serves them from its own tiers since; its next hit a quarter
    # of the TTL on found the cluster's copies gone and wrote them all back as lost ones: A's evict
    # undone by any host that held them
    a, b = host("a", ttl=2.0), host("b", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=23)
    a.put(NS, toks, x, session="conv-1")
    written(a, 4)
    assert b.get(NS, toks).tiers == ["cluster"] * 4
    assert a.evict(EvictFilter(session="conv-1", tier="cluster")).blocks == 4
    time.sleep(0.6)
    assert b.get(NS, toks).tiers == ["hbm"] * 4  # B's own copies stay: they are its tiers'
    assert wait_until(lambda: b.stats().cluster["kept_evicted"] == 4, 10)  # type: ignore[index]
    assert b._cluster.drain(5) and b.stats().cluster["written"] == 0  # type: ignore[union-attr,index]
    assert host("c").lookup(NS, toks).matched_blocks == 0
    b.put(NS, toks, x)  # held: it asks the cluster about none of them again
    assert b._cluster.drain(5) and b.stats().cluster["kept_evicted"] == 4  # type: ignore[union-attr,index]
    # a put that brings them to a host that did not hold them writes them, and clears the marks:
    # a copy the cluster loses after that is written again as a lost one
    d = host("d", ttl=2.0)
    d.put(NS, toks, x)
    written(d, 4)
    key = d._cluster.cluster.block_key(_keys(toks)[0])  # type: ignore[union-attr]
    assert rc.node(rc.master_of(key)).delete(key) == 1
    time.sleep(0.6)
    assert d.get(NS, toks).tiers == ["hbm"] * 4
    written(d, 5)
    assert host("e").lookup(NS, toks).tiers == ["cluster"] * 4


def lost_while_b_serves(rc: LocalCluster, host: HostFactory, seed: int) -> tuple[Store, Store, Any, Any]:
    """A stores four blocks; B (a TTL of 2 s) reads them from the cluster and serves them from its own
    tiers; the cluster then loses block 0. Returns A, B, the tokens and the blocks' K/V."""
    a, b = host("a"), host("b", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=seed)
    a.put(NS, toks, x)
    written(a, 4)
    assert b.get(NS, toks).tiers == ["cluster"] * 4
    key = a._cluster.cluster.block_key(_keys(toks)[0])  # type: ignore[union-attr]
    assert rc.node(rc.master_of(key)).delete(key) == 1
    return a, b, toks, x


def evict_between_check_and_write(monkeypatch: pytest.MonkeyPatch, a: Store, b: Store) -> None:
    """A's evict of each block B writes back lands between B's check of its mark and B's write."""
    tier = b._cluster.cluster  # type: ignore[union-attr]
    store = tier.store

    def evicted_meanwhile(items: Any, *, again: bool = False) -> int:
        if again:
            assert a._cluster is not None
            a._cluster.cluster.delete([k for k, _ in items], mark=True)
        return store(items, again=again)

    monkeypatch.setattr(tier, "store", evicted_meanwhile)


def test_an_evict_that_lands_while_a_block_is_written_back_is_not_undone(
    rc: LocalCluster, host: HostFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # B writes back a block the cluster lost; another host's evict of it lands between B's check of
    # its mark and B's write: B's write brought it back, the evict undone
    a, b, toks, _ = lost_while_b_serves(rc, host, seed=47)
    evict_between_check_and_write(monkeypatch, a, b)
    time.sleep(0.6)  # past a quarter of B's TTL: its next hit refreshes the copies, and finds one gone
    assert b.get(NS, toks).tiers == ["hbm"] * 4
    assert wait_until(lambda: b.stats().cluster["kept_evicted"] == 1, 10)  # type: ignore[index]
    assert host("c").lookup(NS, toks).matched_blocks == 0
    assert b._cluster.cluster.evicted(_keys(toks)[:1]) == [True]  # type: ignore[union-attr]


def test_a_block_written_back_over_an_evict_it_could_not_check_after_is_deleted_at_its_next_write_back(
    rc: LocalCluster, host: HostFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as above, but the check after the write fails (the cluster goes away): the write-back is
    # dropped, to go again; its next try found the mark and left the block it had brought back
    a, b, toks, x = lost_while_b_serves(rc, host, seed=53)
    evict_between_check_and_write(monkeypatch, a, b)
    tier = b._cluster.cluster  # type: ignore[union-attr]
    evicted = tier.evicted
    checks: list[list[bytes]] = []

    def check(keys: Any) -> list[bool]:
        checks.append(list(keys))
        if len(checks) == 2:  # the check after the write
            raise ClusterUnavailable("the cluster went away")
        return evicted(keys)

    monkeypatch.setattr(tier, "evicted", check)
    key = tier.block_key(_keys(toks)[0])
    node = rc.node(rc.master_of(key))
    time.sleep(0.6)  # past a quarter of B's TTL: its next hit refreshes the copies, and finds one gone
    assert b.get(NS, toks).tiers == ["hbm"] * 4
    assert wait_until(lambda: b.stats().cluster["write_dropped"] == 1, 10)  # type: ignore[index]
    assert node.exists(key) == 1  # brought back over the evict
    b.put(NS, toks, x)  # the dropped write-back goes with it: it finds the mark, and deletes the block
    assert wait_until(lambda: b.stats().cluster["kept_evicted"] == 1, 10)  # type: ignore[index]
    assert node.exists(key) == 0 and len(checks) == 3


def test_a_put_the_cluster_missed_while_down_is_written_afresh_over_an_old_evict(
    rc: LocalCluster, host: HostFactory
) -> None:
    # C put the blocks for the first time while the cluster was down (dropped, to go with the next
    # put); an operator's evict of the same blocks elsewhere had left marks. C's next put sent them
    # as write-backs of copies it held, found the marks and kept them: the fleet never saw C's put
    a = host("a")
    toks, x = tokens(4), kv(16, seed=41)
    a.put(NS, toks, x, session="S")
    written(a, 4)
    assert a.evict(EvictFilter(session="S", tier="cluster")).blocks == 4  # marks left
    c = host("c")
    c._cluster.cluster._failed(ConnectionError("a node went away"))  # type: ignore[union-attr]
    c.put(NS, toks, x)  # new here, dropped: the cluster is down
    assert c.stats().cluster["write_dropped"] == 4  # type: ignore[index]
    assert wait_until(lambda: c._cluster.cluster.available(), 10)  # type: ignore[union-attr]
    c.put(NS, toks, x)  # held now: the dropped blocks go with it, as the fresh writes they were
    written(c, 4)
    assert c.stats().cluster["kept_evicted"] == 0  # type: ignore[index]
    assert host("d").lookup(NS, toks).matched_blocks == 4


def test_a_host_that_knew_a_block_evicted_writes_it_back_once_it_is_the_fleet_s_again(
    rc: LocalCluster, host: HostFactory
) -> None:
    # E evicted S's blocks from the cluster, then C put them afresh and E read them from it: E still
    # took them for evicted, and when the cluster lost one, E, serving them, never wrote it back
    a, e = host("a"), host("e", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=43)
    a.put(NS, toks, x, session="S")
    written(a, 4)
    assert a._cluster is not None and a._cluster.drain(5)  # and the session's record
    assert e.evict(EvictFilter(session="S")).blocks == 4  # E never held them
    c = host("c")
    c.put(NS, toks, x)
    written(c, 4)
    assert e.get(NS, toks).tiers == ["cluster"] * 4
    key = e._cluster.cluster.block_key(_keys(toks)[0])  # type: ignore[union-attr]
    assert rc.node(rc.master_of(key)).delete(key) == 1  # lost by the cluster
    time.sleep(0.6)  # past a quarter of E's TTL: its next hit refreshes the copies, and finds one gone
    assert e.get(NS, toks).tiers == ["hbm"] * 4
    written(e, 1)
    assert host("f").lookup(NS, toks).matched_blocks == 4


def test_evict_of_a_session_from_another_host_keeps_the_record_of_blocks_stored_before_it_was_named(
    host: HostFactory,
) -> None:
    # an engine saves as it computes (no session), then names the conversation: the cluster's
    # records of its blocks carry no session (and such a prefix may be others' too, unnamed). An evict
    # of it from another host deleted none of them and dropped its record: served on from the
    # cluster, with no name left to find or evict it by. The record stays now, and the result says why
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(16, seed=6)
    shared = tokens(2, seed=1)
    a.put(NS, toks, x)
    a.put(NS, toks + shared, torch.cat([x, kv(8, seed=1)], dim=2))  # another, unnamed, on top
    written(a, 6)
    a.put(NS, toks, x, session="S")
    time.sleep(0.3)  # the session record follows on the cluster thread
    assert b.session("S").info.tiers == {"cluster": 4}
    r = b.evict(EvictFilter(session="S"))
    assert r.blocks == 0 and "stored before it was named" in r.not_done
    assert b.session("S").info.tiers == {"cluster": 4}
    assert host("c").lookup(NS, toks + shared).matched_blocks == 6  # the unnamed one is whole


def test_evict_of_a_session_leaves_the_cluster_blocks_others_build_on(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(6), kv(24)
    a.put(NS, toks[: 3 * T], x[:, :, : 3 * T], session="A")  # A: blocks 0..2
    a.put(NS, toks, x, session="B")  # B builds on them: 3..5
    written(a, 6)
    # --tier cluster: A's blocks stay in the cluster, as they stay here (B goes on below them)
    assert a.evict(EvictFilter(session="A", tier="cluster")).blocks == 0
    assert b.lookup(NS, toks).tiers == ["cluster"] * 6


@pytest.mark.parametrize("model", [None, NS.model])
def test_evict_of_a_session_leaves_the_blocks_another_host_s_session_builds_on(
    host: HostFactory, model: str | None
) -> None:
    # with another criterion (one every block matches) the cluster was asked to delete the blocks
    # chosen here as they were, past every check: host B's session lost its prefix for every host
    a, b, c = host("a"), host("b"), host("c")
    toks, x = tokens(4), kv(16)
    a.put(NS, toks, x, session="S")
    written(a, 4)
    theirs = toks[: 2 * T] + tokens(2, seed=9)  # B's session builds on S's first two blocks
    b.put(NS, theirs, torch.cat([x[:, :, : 2 * T], kv(8, seed=9)], dim=2), session="T")
    written(b, 2)
    a.evict(EvictFilter(session="S", model=model))
    assert c.lookup(NS, theirs).tiers == ["cluster"] * 4
    assert c.lookup(NS, toks).matched_blocks == 2  # S's own blocks are gone


def test_evict_of_a_session_leaves_the_cluster_blocks_a_request_continued(host: HostFactory) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(6), kv(24)
    a.put(NS, toks[: 3 * T], x[:, :, : 3 * T], session="A")
    a.put(NS, toks, x)  # an engine's request continues A's conversation, naming no session
    written(a, 6)
    r = a.evict(EvictFilter(session="A"))
    assert r.blocks == 0 and a.lookup(NS, toks).matched_blocks == 6  # kept here: something continues them
    assert b.lookup(NS, toks).tiers == ["cluster"] * 6  # and kept in the cluster: nothing is orphaned
    with pytest.raises(KeyError):
        b.session("A")  # the session itself is gone, here and in the cluster


def test_evict_of_the_cluster_tier_keeps_to_every_criterion(host: HostFactory) -> None:
    # --tier cluster --session S with another criterion deleted every block S's record named, and
    # the record, whatever the other criterion said ("filters combine with AND")
    clock = Clock()
    a, c = host("a", clock=clock), host("c")
    toks, x = tokens(6), kv(24)
    a.put(NS, toks[: 3 * T], x[:, :, : 3 * T], session="S")
    clock.advance(3600)
    a.put(NS, toks, x, session="S")  # an hour later: every block touched
    written(a, 6)
    time.sleep(0.2)  # and the session's record, written after them
    clock.advance(10)
    assert a.evict(EvictFilter(session="S", older_than=1800, tier="cluster")).blocks == 0
    assert a.evict(EvictFilter(session="S", tenant="someone-else", tier="cluster")).blocks == 0
    assert c.lookup(NS, toks).tiers == ["cluster"] * 6 and c.session("S").info.blocks == 6
    # the session's own tenant narrows nothing: its whole conversation goes, with its record
    assert a.evict(EvictFilter(session="S", tenant=NS.tenant, tier="cluster")).blocks == 6
    assert c.lookup(NS, toks).matched_blocks == 0
    with pytest.raises(KeyError):
        c.session("S")


def test_evict_of_the_cluster_tier_by_age_takes_what_follows_the_old_blocks(
    rc: LocalCluster, host: HostFactory
) -> None:
    # an engine read the later blocks of a prefix alone (from block 3): the first blocks are old, the
    # later ones young. Only the old blocks' cluster copies went: the young ones stayed there,
    # unreachable by any host
    clock = Clock()
    a, c = host("a", clock=clock), host("c")
    toks, x = tokens(6, seed=11), kv(24, seed=11)
    a.put(NS, toks, x)
    written(a, 6)
    clock.advance(7200)
    assert a.get(NS, toks, start_block=3).matched_blocks == 3
    r = a.evict(EvictFilter(older_than=3600, tier="cluster"))
    assert r.blocks == 6 and c.lookup(NS, toks).matched_blocks == 0
    assert not [k for p in rc.live_masters() for k in rc.node(p).scan_iter(match="kvstore:b:*")]


def test_evict_of_a_session_takes_its_blocks_from_the_cluster_without_its_record(
    rc: LocalCluster, host: HostFactory
) -> None:
    # the cluster's record of S is gone (expired, or refused: another tenant's session of the name
    # holds it): the cluster evict went by the record alone, and every host still read S's blocks
    a, c = host("a"), host("c")
    toks, x = tokens(4), kv(16)
    a.put(NS, toks, x, session="S")
    written(a, 4)
    time.sleep(0.2)
    for port in rc.live_masters():
        node = rc.node(port)
        for k in node.scan_iter(match="kvstore:s:*"):
            node.delete(k)
    r = a.evict(EvictFilter(session="S"))
    assert r.blocks == 4 and not r.not_done  # here and in the cluster, each block counted once
    assert c.lookup(NS, toks).matched_blocks == 0


def test_a_tenant_s_own_evict_of_its_session_takes_the_cluster_s_record_too(host: HostFactory) -> None:
    # a tenant's evict names its tenant: that made S "not the only criterion", so its record (the
    # conversation's token ids) stayed in the cluster, and a host that did not hold S deleted nothing
    a, b, c = host("a"), host("b"), host("c")
    toks, x = tokens(4), kv(16)
    a.put(NS, toks, x, session="S")
    written(a, 4)
    time.sleep(0.2)
    r = b.evict(EvictFilter(session="S", tenant=NS.tenant))
    assert r.blocks == 4
    assert c.lookup(NS, toks).matched_blocks == 0
    with pytest.raises(KeyError):
        c.session("S")


def test_a_dead_cluster_degrades_to_local_tiers(host: HostFactory) -> None:
    b = host("b", urls=["redis://127.0.0.1:1"], connect=False, timeout=0.3, retry_after=60.0)
    toks, x = tokens(3), kv(12)
    b.put(NS, toks[:T], x[:, :, :T])
    t = time.monotonic()
    assert b.lookup(NS, toks).matched_blocks == 1  # one time-out at most, then local only
    assert b.get(NS, toks).matched_blocks == 1
    assert b.lookup(NS, toks).matched_blocks == 1
    assert time.monotonic() - t < 2.0
    # the first connect runs on the cluster thread (the put's write) and none of the calls above
    # waited for it; on a loaded machine it may still be under way: its failure is awaited here
    deadline = time.monotonic() + 10
    while b.stats().cluster["state"] != "down" and time.monotonic() < deadline:  # type: ignore[index]
        time.sleep(0.05)
    st = b.stats().cluster
    assert st is not None and st["state"] == "down" and st["errors"] >= 1


def test_blocks_from_the_cluster_reach_nvme_as_the_cluster_framed_them(
    rc: LocalCluster, host: HostFactory
) -> None:
    # nvme and the cluster both store int4: B's disk gets the cluster's frames byte for byte (one
    # quantization, no encode on B); a raw cluster copy is encoded for nvme as any new block
    a, b = host("a", codec="int4"), host("b", codec="int4")
    toks, x = tokens(3), kv(12, seed=11)
    a.put(NS, toks, x)
    written(a, 3)
    assert b.get(NS, toks).tiers == ["cluster"] * 3
    assert b.flush(timeout=10)
    nvme = b.tiers.nvme
    assert nvme is not None
    for k in _keys(toks):
        value = rc.node(rc.master_of(b._cluster.cluster.block_key(k))).get(b._cluster.cluster.block_key(k))  # type: ignore[union-attr]
        assert value.endswith(nvme.get_frame(k))


def _only_on_nvme(
    rc: LocalCluster, host: HostFactory, codec: str, seed: int
) -> tuple[Store, list[int], torch.Tensor]:
    """Host A with 2 blocks whose only copy is nvme's (hbm and ram let them go), and a cluster that
    has lost them: what A's link writes next is what the cluster gets."""
    a = host("a", codec=codec)
    toks, x = tokens(2), kv(2 * T, seed=seed)
    a.put(NS, toks, x)
    assert a.flush(timeout=10) and a._cluster is not None and a._cluster.drain(10)
    for tier in ("hbm", "ram"):
        a.evict(EvictFilter(all=True, tier=tier))
    assert a.lookup(NS, toks).tiers == ["nvme"] * 2
    rc.flushall()
    return a, toks, x


@pytest.mark.parametrize("codec", ["int4", "raw"])
def test_a_block_kept_only_on_nvme_reaches_the_cluster_as_nvme_framed_it(
    rc: LocalCluster, host: HostFactory, codec: str
) -> None:
    # the block's best copy is nvme's int4 frame when its cluster write runs (again: the cluster lost
    # it). An int4 cluster gets that frame as it is (decoded and encoded again it would be quantized
    # twice); a raw cluster too (the block as it was put is gone: the frame is all that is left of it,
    # in fewer bytes than a raw frame of its decoding)
    a, toks, x = _only_on_nvme(rc, host, codec, seed=21)
    nvme, link = a.tiers.nvme, a._cluster
    assert nvme is not None and link is not None
    for k in _keys(toks):
        link._write(k)
        name = link.cluster.block_key(k)
        assert rc.node(rc.master_of(name)).get(name).endswith(nvme.get_frame(k))
    b = host("b")
    r = b.get(NS, toks)
    assert r.tiers == ["cluster"] * 2 and close_to(got(r), x)


def test_a_frame_nvme_holds_under_another_block_s_key_never_reaches_the_cluster(
    rc: LocalCluster, host: HostFactory
) -> None:
    # two frames swapped on disk: each is sound in itself, and only nvme's entry under the key says it
    # is another block's. The cluster must not get it under this key (a frame carries no key: every
    # host would serve block 1's K/V as block 0's)
    a, toks, x = _only_on_nvme(rc, host, "int4", seed=22)
    nvme, link = a.tiers.nvme, a._cluster
    assert nvme is not None and link is not None
    k0, k1 = _keys(toks)
    one, two = nvme.get_frame(k0), nvme.get_frame(k1)
    nvme._write(lambda txn: (txn.put(k0, two, db=nvme._blocks), txn.put(k1, one, db=nvme._blocks)))
    for k in (k0, k1):
        link._write(k)
    assert rc.keys() == []  # neither went
    assert host("b").get(NS, toks).matched_blocks == 0


def test_a_hung_node_costs_one_timeout_then_the_cluster_is_used_again(
    rc: LocalCluster, host: HostFactory
) -> None:
    a = host("a")
    b = host("b", timeout=0.5, retry_after=1.0)
    toks, x = tokens(6), kv(24, seed=4)
    a.put(NS, toks, x)
    written(a, 6)
    port = rc.master_of(b._cluster.cluster.block_key(_keys(toks)[0]))  # type: ignore[union-attr]
    rc.pause(port)  # the node hangs: it holds the connection and answers nothing
    try:
        t = time.monotonic()
        assert b.lookup(NS, toks).matched_blocks == 0  # no error: a miss, within the time-out
        assert b.get(NS, toks).matched_blocks == 0  # marked down: not even asked
        assert time.monotonic() - t < 1.5
        assert b.stats().cluster["state"] == "down"  # type: ignore[index]
    finally:
        rc.resume(port)
    time.sleep(1.2)  # retry_after: the next call reconnects by itself
    r = b.get(NS, toks)
    assert r.tiers == ["cluster"] * 6 and same(got(r), x)
    assert b.stats().cluster["state"] == "up"  # type: ignore[index]


def test_a_slow_node_cuts_a_get_short_after_about_one_timeout(rc: LocalCluster, host: HostFactory) -> None:
    # a node that answers each batch within the time-out never marks the cluster down: a get of 128
    # blocks, sixteen batches, waited on each (16 x up to 0.2 s against a time-out of 0.5 s)
    import subprocess
    import sys

    a, b = host("a"), host("b", timeout=0.5)
    n = 128
    toks, x = tokens(n, seed=5), kv(n * T, seed=5)
    a.put(NS, toks, x)
    written(a, n)
    busy = (
        "local t0 = redis.call('TIME'); "
        "repeat local t = redis.call('TIME') until (t[1] - t0[1]) * 1e6 + t[2] - t0[2] > 200000"
    )
    # in a process of its own: a thread here would wait for the GIL while b's get decodes, and the
    # gaps it left between scripts let batches through at once (the get was not cut short, once)
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import redis, sys\n"
            f"node = redis.Redis('127.0.0.1', {rc.ports[0]}, socket_timeout=5)\n"
            f"while True: node.eval({busy!r}, 0)\n",
        ]
    )
    try:
        time.sleep(0.5)
        t = time.monotonic()
        r = b.get(NS, toks)
        took = time.monotonic() - t
    finally:
        hog.kill()
        hog.wait(5)
    assert took < 2.0, f"{took:.2f} s"  # the time-out, a batch and the decoding; not 16 batches
    # (a reads the best copy it holds to write it: for blocks its hbm and ram had no room for, int4)
    assert 0 < r.matched_blocks < n and close_to(got(r), x[:, :, : r.matched_blocks * T])
    assert b.stats().cluster["state"] == "up"  # type: ignore[index]  # slow is not down


def test_blocks_served_from_a_host_s_own_tiers_keep_their_cluster_copies_alive(host: HostFactory) -> None:
    # only reads from the cluster refreshed the TTL: a prefix one host serves all day from its own
    # tiers (a system prompt) expired for every other host
    a, b = host("a", ttl=2.0), host("b", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=6)
    a.put(NS, toks, x)
    written(a, 4)
    for _ in range(10):  # 3 s of local hits on host A, past the 2 s TTL
        assert a.get(NS, toks).tiers == ["hbm"] * 4
        time.sleep(0.3)
    assert b.lookup(NS, toks).tiers == ["cluster"] * 4
    assert same(got(b.get(NS, toks)), x[:, :, : 4 * T])
    time.sleep(2.5)  # and nothing used them since: they expire as the TTL says
    assert host("c").lookup(NS, toks).matched_blocks == 0


def test_a_block_the_cluster_lost_while_a_host_serves_it_is_written_again(
    rc: LocalCluster, host: HostFactory
) -> None:
    # the cluster lost block 0 (its maxmemory, a failover, an operator) while host A serves the
    # prefix from its own tiers: A never sent it again, and every block after it was out of reach
    a = host("a", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=8)
    a.put(NS, toks, x)
    written(a, 4)
    key = a._cluster.cluster.block_key(_keys(toks)[0])  # type: ignore[union-attr]
    assert rc.node(rc.master_of(key)).delete(key) == 1
    assert host("b").lookup(NS, toks).matched_blocks == 0
    time.sleep(0.6)  # past a quarter of the TTL: A's next hit refreshes the copies' TTL, and finds it gone
    assert a.get(NS, toks).tiers == ["hbm"] * 4
    written(a, 5)
    assert host("c").lookup(NS, toks).tiers == ["cluster"] * 4


def test_the_blocks_written_last_are_looked_up_again_once_the_cluster_is_back(
    rc: LocalCluster, host: HostFactory
) -> None:
    # a failover loses the writes its replica had not received: the newest. They went again only at
    # a refresh a quarter of the TTL later (1.75 days at 7d), every other host missing the prefix
    a = host("a")  # the TTL of 7 days: no refresh comes within the test
    toks, x = tokens(4), kv(16, seed=12)
    a.put(NS, toks, x)
    written(a, 4)
    key = a._cluster.cluster.block_key(_keys(toks)[0])  # type: ignore[union-attr]
    assert rc.node(rc.master_of(key)).delete(key) == 1  # what the failover lost
    a._cluster.cluster._failed(ConnectionError("a node went away"))  # type: ignore[union-attr]
    written(a, 5)  # reconnected (retry_after 0.5 s), it asked about its last writes and wrote block 0
    assert host("b").lookup(NS, toks).tiers == ["cluster"] * 4


def test_a_block_read_before_its_cluster_write_lands_is_written_once(host: HostFactory) -> None:
    # read at once after its put: its TTL is due for a refresh before the write reaches the cluster,
    # and the refresh finds it absent; that is a block on its way, not one the cluster lost
    a = host("a", ttl=2.0)
    toks, x = tokens(24), kv(24 * T, seed=9)
    a.put(NS, toks, x)
    assert a.get(NS, toks).matched_blocks == 24
    written(a, 24)
    time.sleep(0.3)
    assert a.stats().cluster["written"] == 24  # type: ignore[index]


def test_a_session_served_from_a_host_s_own_tiers_keeps_its_cluster_record_alive(host: HostFactory) -> None:
    # the blocks' TTL was refreshed, the session's record not: other hosts could no longer inspect or
    # prefetch a conversation whose blocks were all still there
    a, c = host("a", ttl=2.0), host("c", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=6)
    a.put(NS, toks, x, session="S")
    written(a, 4)
    for _ in range(10):  # 3 s of local hits on host A, past the 2 s TTL
        assert a.get(NS, toks).tiers == ["hbm"] * 4
        time.sleep(0.3)
    detail = c.session("S")
    assert detail.info.blocks == 4 and detail.info.tiers == {"cluster": 4}
    assert c.prefetch("S", "ram").moved == 4


def test_a_session_read_from_the_cluster_keeps_its_record_alive(host: HostFactory) -> None:
    # host B does not know the session by name: it reads the blocks, whose records name it
    a, b, c = host("a", ttl=2.0), host("b", ttl=2.0), host("c", ttl=2.0)
    toks, x = tokens(4), kv(16, seed=7)
    a.put(NS, toks, x, session="S")
    written(a, 4)
    for _ in range(10):  # 3 s of reads from the cluster on host B, past the 2 s TTL
        b.evict(EvictFilter(all=True))
        assert b.get(NS, toks).tiers == ["cluster"] * 4
        time.sleep(0.3)
    assert c.session("S").info.blocks == 4


def test_a_get_may_leave_storing_the_cluster_blocks_until_after_it_returns(host: HostFactory) -> None:
    """``get(adopted=Adoption(...))`` (what the daemon uses: it answers its client first) stores the
    cluster's blocks on the link's thread afterwards, once ``start`` is set, calls ``done`` once that
    is over, and every later call that reads the index starts and waits for it."""
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(16, seed=9)
    a.put(NS, toks, x)
    written(a, 4)
    calls: list[str] = []
    # nothing from the cluster (a local miss with no cluster copy): done before get returns
    r = b.get(NS, tokens(2, seed=1), adopted=Adoption(lambda: calls.append("none")))
    assert r.matched_blocks == 0 and calls == ["none"]
    with pytest.raises(LayoutError):  # a bad request: done too
        b.get(NS, toks, out=torch.zeros(3), adopted=Adoption(lambda: calls.append("bad")))
    assert calls == ["none", "bad"]

    out = torch.zeros(LAYOUT.shape(4 * T), dtype=torch.bfloat16)
    later = Adoption(lambda: calls.append("stored"), wait=60.0)  # until start is set: the client copies
    r = b.get(NS, toks, out=out, adopted=later)
    assert r.tiers == ["cluster"] * 4 and same(out, x)
    time.sleep(0.3)
    assert calls == ["none", "bad"] and b.try_lookup(NS, toks) is None  # the event loop hands it on
    looked = b.lookup(NS, toks).tiers  # a call that needs them starts storing them, and waits
    assert looked == ["hbm"] * 4 and calls == ["none", "bad", "stored"] and later.start.is_set()
    assert same(got(b.get(NS, toks)), x)  # stored from ``out``, as it was when get returned

    toks2, x2 = tokens(3, seed=2), kv(12, seed=2)
    a.put(NS, toks2, x2)
    written(a, 7)
    soon = Adoption(lambda: calls.append("soon"), wait=60.0)
    assert b.get(NS, toks2, adopted=soon).tiers == ["cluster"] * 3
    soon.start.set()  # the client is done: stored without anyone asking
    deadline = time.monotonic() + 10
    while calls[-1] != "soon" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls[-1] == "soon" and b.try_lookup(NS, toks2).tiers == ["hbm"] * 3  # type: ignore[union-attr]
    assert b.stats().cluster["hits"] == 7  # type: ignore[index]


def test_a_put_after_a_get_from_the_cluster_finds_its_parents_stored(host: HostFactory) -> None:
    """An engine's next step after loading a prefix from the cluster: it stores the blocks it
    computed after it. They hang off the loaded blocks, which a get with ``adopted`` stores only
    later; the put waits for them (settle) rather than refusing its blocks as orphans."""
    a, b = host("a"), host("b")
    toks, x = tokens(6), kv(24, seed=4)
    a.put(NS, toks, x[:, :, : 4 * T])
    written(a, 4)
    out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.bfloat16)
    done: list[bool] = []
    later = Adoption(lambda: done.append(True), wait=60.0)  # the client has not finished copying
    assert b.get(NS, toks, out=out, adopted=later).tiers == ["cluster"] * 4
    r = b.put(NS, toks, x[:, :, 4 * T :], start_block=4)
    assert (r.stored, r.failed) == (2, []) and done == [True]
    assert b.lookup(NS, toks).tiers == ["hbm"] * 6 and same(got(b.get(NS, toks)), x)


def test_engine_pages_are_read_from_the_cluster_whatever_they_were_stored_after(
    rc: LocalCluster, host: HostFactory
) -> None:
    """SGLang stores pages after their prefix pages and reads them back by their keys alone, from
    the middle of a sequence. A page key already names everything before it: another host serves
    such pages from the cluster as this one does from its own tiers, and deletes nothing."""
    a, b, c = host("a"), host("b"), host("c")
    pages = [bytes([i]) * 32 for i in range(1, 5)]
    x = kv(16, seed=5)
    a.put(NS, KeyChain.of(pages[:2]), x[:, :, : 2 * T])
    a.put(NS, KeyChain.of(pages[2:], pages[:2]), x[:, :, 2 * T :])  # batch_set_v1 with prefix keys
    written(a, 4)
    assert a.get(NS, KeyChain.of(pages[2:])).tiers == ["hbm"] * 2
    r = b.get(NS, KeyChain.of(pages[2:]))  # batch_get_v1: the pages alone
    assert r.tiers == ["cluster"] * 2 and same(got(r), x[:, :, 2 * T :])
    # pages stored again as a run of their own (no prefix given, on a host that did not hold
    # them), then read as one run with the pages before them on a third host
    d = host("d")
    d.put(NS, KeyChain.of(pages[2:]), x[:, :, 2 * T :])
    written(d, 2)
    r = c.get(NS, KeyChain.of(pages))
    assert r.tiers == ["cluster"] * 4 and same(got(r), x)
    assert b.stats().cluster["corrupt"] == c.stats().cluster["corrupt"] == 0  # type: ignore[index]
    assert len(rc.keys()) >= 4  # nothing deleted


def test_evict_of_a_session_while_the_cluster_is_down_does_this_host_s_part_and_says_what_is_left(
    rc: LocalCluster, host: HostFactory
) -> None:
    # it raised after dropping the local blocks and the session: the operator was told it failed
    a = host("a", timeout=0.3, retry_after=30.0)
    toks = tokens(3)
    a.put(NS, toks, kv(3 * T), session="S")
    written(a, 3)
    masters = list(rc.live_masters())
    for port in masters:
        rc.pause(port)
    try:
        a.lookup(NS, tokens(4, seed=9))  # meets the outage: the cluster is marked down
        dry = a.evict(EvictFilter(session="S"), dry_run=True)
        assert dry.blocks == 3 and "cluster" in dry.not_done and a.lookup(NS, toks).matched_blocks == 3
        done = a.evict(EvictFilter(session="S"))
        assert done.blocks == 3 and "evict --session again" in done.not_done
        assert a.lookup(NS, toks).matched_blocks == 0
        # not "no such session": its record is still in the cluster, which cannot be asked
        with pytest.raises(InvalidRequest, match="cannot be asked now"):
            a.session("S")
    finally:
        for port in masters:
            rc.resume(port)


def test_close_stores_what_gets_read_from_the_cluster_before_it_closes(
    tmp_path: Path, host: HostFactory
) -> None:
    # close refused the puts of blocks a get had read from the cluster (the store was already
    # marked closed when its last flush started them): they were lost from this host
    a, b = host("a"), host("b")
    toks, x = tokens(3, seed=4), kv(12, seed=4)
    a.put(NS, toks, x)
    written(a, 3)
    stored: list[str] = []
    out = torch.zeros(LAYOUT.shape(3 * T), dtype=torch.bfloat16)
    assert (
        b.get(NS, toks, out=out, adopted=Adoption(lambda: stored.append("done"), wait=60.0)).matched_blocks
        == 3
    )
    b.close()  # its last flush starts storing them, and waits
    assert stored == ["done"]
    again = NvmeTier(tmp_path / "b", 1 << 22, get_codec("int4"))
    try:
        assert sum(k in again for k in _keys(toks)) == 3
    finally:
        again.close()


def test_the_event_loops_lookup_and_locate_leave_a_block_the_cluster_may_hold_to_a_worker(
    host: HostFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """try_lookup and try_locate (the daemon's event loop) never ask the cluster: a local miss the
    cluster may hold is None, nothing pinned or counted, and the worker's call asks it."""
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(16, seed=5)
    a.put(NS, toks, x)
    written(a, 4)
    b.put(NS, toks[: 2 * T], x[:, :, : 2 * T])  # blocks 0-1 here, 2-3 in the cluster only
    asked: list[bool] = []
    reads = b._cluster.reads  # type: ignore[union-attr]
    leading = reads.leading

    def asking(keys: list[bytes]) -> int:
        asked.append(True)
        return leading(keys)

    monkeypatch.setattr(reads, "leading", asking)
    hbm = {b.tiers.names.index("hbm")}
    lookups = b.stats().lookups
    assert b.try_lookup(NS, toks) is None
    assert b.try_locate(NS, toks, hbm) is None
    assert asked == [] and b.stats().pinned == 0 and b.stats().lookups == lookups
    located = b.locate(NS, toks, hbm)  # a worker's: the cluster says what follows
    assert asked == [True] and len(located.places) == 2 and located.rest == 2
    b.unlocate(located)
    held = b.try_locate(NS, toks[: 2 * T], hbm)  # all held here: answered at once
    assert held is not None and len(held.places) == 2 and asked == [True]
    b.finish(held, 2)
