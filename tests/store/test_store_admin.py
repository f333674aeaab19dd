"""Store: evict by filter (dry run too), prefetch, sessions, stats."""

from __future__ import annotations

import pytest

from kvstore.keys import Namespace, block_keys
from kvstore.results import EvictFilter, InvalidFilter, InvalidRequest
from tests.store.storekit import NS, Clock, T, kv, same, tokens


def test_evict_by_session_drops_its_blocks_and_keeps_shared_ones(make_store) -> None:
    s = make_store(hbm_blocks=8, ram_blocks=8)
    shared = tokens(2, seed=1)
    a = shared + tokens(2, seed=2)  # a = shared prefix + 2 own blocks
    s.put(NS, a, kv(4 * T, 1), session="a")
    s.put(NS, shared, kv(2 * T, 1), session="b")  # b tags the shared prefix too
    dry = s.evict(EvictFilter(session="a"), dry_run=True)
    assert dry.blocks == 2 and dry.dry_run and set(dry.keys) == set(block_keys(NS, a)[2:])
    assert dry.bytes_freed["hbm"] == 2 * 1024
    assert s.lookup(NS, a).matched_blocks == 4  # nothing changed
    r = s.evict(EvictFilter(session="a"))
    assert r.blocks == 2 and set(r.keys) == set(dry.keys)
    assert s.lookup(NS, a).matched_blocks == 2  # the shared prefix stays for b
    assert [i.name for i in s.sessions()] == ["b"]
    with pytest.raises(KeyError):
        s.session("a")
    assert s.check_integrity() == []


def test_evicting_a_block_drops_its_descendants(make_store) -> None:
    clock = Clock()
    s = make_store(clock=clock, hbm_blocks=8, ram_blocks=8)
    toks, data = tokens(4), kv(4 * T)
    s.put(NS, toks, data)  # [0, 1, 2, 3] now
    clock.advance(3600)
    assert s.get(NS, toks, start_block=2).matched_blocks == 2  # [2, 3] read an hour later, alone
    s.lookup(NS, toks)  # a lookup is not an access
    # older than 30 min selects [0, 1]; their descendants [2, 3] go with them
    dry = s.evict(EvictFilter(older_than=1800), dry_run=True)
    assert set(dry.keys) == set(block_keys(NS, toks))
    assert s.evict(EvictFilter(older_than=1800)).blocks == 4
    assert s.stats().blocks == 0 and s.check_integrity() == []


def test_evict_from_nvme_keeps_the_copies_above(make_store) -> None:
    s = make_store(hbm_blocks=8, ram_blocks=8)
    toks = tokens(4)
    s.put(NS, toks, kv(4 * T))
    assert s.flush(10)
    r = s.evict(EvictFilter(tier="nvme"))
    assert r.blocks == 4 and r.moved == 0 and set(r.keys) == set(block_keys(NS, toks))
    assert s.lookup(NS, toks).tiers == ["hbm"] * 4
    assert not set(s.tiers[-1].keys())
    assert s.holds_namespace(NS.id)
    r = s.evict(EvictFilter(namespace=NS.id))
    assert r.blocks == 4 and s.stats().blocks == 0 and not s.holds_namespace(NS.id)
    assert s.check_integrity() == []


def test_a_block_whose_nvme_record_is_unreadable_goes_whole_but_never_under_a_reader(make_store) -> None:
    s = make_store(hbm_blocks=8, ram_blocks=8)
    toks, data = tokens(3), kv(3 * T)
    s.put(NS, toks, data)
    assert s.flush(10)
    keys = block_keys(NS, toks)
    nvme = s.tiers[-1]
    nvme._write(lambda txn: txn.put(keys[0], b"not a record", db=nvme._records))
    handle = s.pin(keys[2:])  # a reader of block 2, below the damaged record's block
    s.evict(EvictFilter(tier="nvme"))
    # block 0 cannot keep its place without its record, and would take block 2 with it: all stay
    got = s.get(NS, toks)
    assert got.matched_blocks == 3 and same(got.kv, data)
    assert s.release(handle)
    s.evict(EvictFilter(tier="nvme"))
    assert s.lookup(NS, toks).matched_blocks == 0  # once nobody reads below it, it goes whole
    assert s.check_integrity() == []


def test_evict_by_tier_moves_blocks_down_one_tier(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(3)
    s.put(NS, toks, kv(3 * T))
    r = s.evict(EvictFilter(tier="hbm"))
    assert r.blocks == 3 and r.moved == 3 and r.bytes_freed == {"hbm": 3 * 1024}
    assert s.lookup(NS, toks).tiers == ["ram"] * 3
    # from the last tier they are dropped, descendants first
    r = s.evict(EvictFilter(tier="ram"))
    assert r.blocks == 3 and r.moved == 0
    assert s.stats().blocks == 0
    assert s.check_integrity() == []


def test_evict_by_tier_counts_a_block_moved_down_also_when_nvme_holds_a_copy(make_store) -> None:
    s = make_store()  # write-through: every block on nvme too
    toks = tokens(3)
    s.put(NS, toks, kv(3 * T))
    assert s.flush(10)
    r = s.evict(EvictFilter(tier="hbm"))
    assert r.blocks == 3 and r.moved == 3  # hbm -> ram, as without nvme
    assert s.lookup(NS, toks).tiers == ["ram"] * 3
    r = s.evict(EvictFilter(tier="ram"))  # the next tier (nvme) holds them: ram's copies just go
    assert r.blocks == 3 and r.moved == 0 and s.lookup(NS, toks).tiers == ["nvme"] * 3


def test_evict_by_tier_says_which_other_blocks_its_moves_pushed_out_of_the_store(make_store) -> None:
    """hbm [4] holds A (4 blocks); ram [3] holds B (3 blocks); no nvme. evict --tier hbm moves A to
    ram, whose room is made the usual way: B, with nothing below ram, leaves the store, and so does
    A's tail, for which there is no room left. The result says so: B is not among the blocks
    evicted, and A's tail did not move down."""
    s = make_store(nvme=False, hbm_blocks=4, ram_blocks=3)
    b, a = tokens(3, seed=1), tokens(4, seed=2)
    s.put(NS, b, kv(3 * T, 1))
    s.evict(EvictFilter(tier="hbm"))  # B in ram
    s.put(NS, a, kv(4 * T, 2))
    r = s.evict(EvictFilter(tier="hbm"))
    assert r.blocks == 4 and r.moved == 3  # ram took three of A; its tail went (nothing below ram)
    assert s.lookup(NS, a).tiers == ["ram"] * 3 and s.lookup(NS, b).matched_blocks == 0
    assert r.displaced == 3
    dry = s.evict(EvictFilter(tier="ram"), dry_run=True)
    assert dry.displaced == 0
    assert s.check_integrity() == []


def test_evict_by_model_and_tenant_and_all(make_store) -> None:
    s = make_store(hbm_blocks=8, ram_blocks=8)
    other = Namespace("other-model", NS.layout, tenant="t2")
    s.put(NS, tokens(2), kv(2 * T))
    s.put(other, tokens(2), kv(2 * T))
    assert s.evict(EvictFilter(model="other-model"), dry_run=True).blocks == 2
    assert s.evict(EvictFilter(tenant="t2")).blocks == 2
    assert s.lookup(other, tokens(2)).matched_blocks == 0
    assert s.lookup(NS, tokens(2)).matched_blocks == 2
    assert s.evict(EvictFilter(all=True)).blocks == 2
    assert s.stats().blocks == 0
    with pytest.raises(InvalidFilter, match="all=True"):
        s.evict(EvictFilter())
    with pytest.raises(InvalidFilter, match="unknown tier"):
        s.evict(EvictFilter(tier="disk"))
    with pytest.raises(InvalidFilter, match=r"the cluster tier is off: \[cluster\] enabled = false"):
        s.evict(EvictFilter(tier="cluster"))


def test_evict_refuses_criteria_that_select_by_accident_and_changes_nothing(make_store) -> None:
    # a NaN or negative age selected every block; a mistyped namespace id none, said as "0 evicted"
    s = make_store(hbm_blocks=8, ram_blocks=8)
    s.put(NS, tokens(2), kv(2 * T))
    for age in (float("nan"), -1.0, float("inf")):
        with pytest.raises(InvalidFilter, match="older_than must be a finite number of seconds >= 0"):
            s.evict(EvictFilter(older_than=age))
    for ns_id in ("zz", NS.id + "0", ""):
        with pytest.raises(InvalidFilter, match="is not a namespace id: 16 hex digits"):
            s.evict(EvictFilter(namespace=ns_id))
    assert s.stats().blocks == 2
    # the id as an operator may copy it, upper case: the same namespace
    assert s.evict(EvictFilter(namespace=NS.id.upper()), dry_run=True).blocks == 2
    assert s.evict(EvictFilter(older_than=0.0, namespace=NS.id)).blocks == 2


def test_evict_leaves_pinned_blocks_alone(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    s.pin(block_keys(NS, toks)[1:])
    # dropping block 0 would take pinned block 1: neither goes
    assert s.evict(EvictFilter(all=True)).blocks == 0
    assert s.lookup(NS, toks).matched_blocks == 2


def test_prefetch_brings_a_session_up_from_nvme(make_store, tmp_path) -> None:
    path = tmp_path / "lmdb"
    s = make_store(path=path)
    toks = tokens(3)
    s.put(NS, toks, kv(3 * T), session="conv-42")
    s.close()
    s = make_store(path=path)
    assert s.lookup(NS, toks).tiers == ["nvme"] * 3
    r = s.prefetch("conv-42", to="ram")
    assert (r.moved, r.present, r.failed) == (3, 0, 0)
    assert s.lookup(NS, toks).tiers == ["ram"] * 3
    assert s.prefetch("conv-42", to="ram").present == 3
    assert s.prefetch("conv-42", to="hbm").moved == 3
    with pytest.raises(KeyError):
        s.prefetch("nobody")
    with pytest.raises(InvalidRequest):
        s.prefetch("conv-42", to="tape")
    assert s.check_integrity() == []


def test_sessions_report_their_prefix_and_tiers(make_store) -> None:
    s = make_store(hbm_blocks=8, ram_blocks=8)
    toks = tokens(3, tail=1)
    s.put(NS, toks[: 2 * T], kv(2 * T), session="conv")
    s.put(NS, toks, kv(3 * T + 1), session="conv")  # the conversation grew by a block
    (info,) = s.sessions()
    assert (info.name, info.tokens, info.blocks, info.model, info.tenant) == (
        "conv",
        3 * T,
        3,
        NS.model,
        "default",
    )
    assert info.tiers["hbm"] == 3
    detail = s.session("conv")
    assert [b.position for b in detail.blocks] == [0, 1, 2]
    assert detail.blocks[2].key == block_keys(NS, toks)[2].hex()


def test_stats_count_hits_misses_and_tokens(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(5)
    s.put(NS, toks, kv(5 * T))  # [0] in ram, [1..4] in hbm
    s.get(NS, tokens(6))  # asks 6 blocks, 5 served
    st = s.stats()
    assert st.tiers["ram"].hits == 1 and st.tiers["hbm"].hits == 4
    assert st.tiers["hbm"].misses == 1 + 1  # block 0 was not in hbm; block 5 was nowhere
    assert (st.lookups, st.tokens_asked, st.tokens_served) == (1, 6 * T, 5 * T)
    s.lookup(NS, tokens(5, tail=T - 1))  # the tail is never cached: not asked for (the hit rate read 5/5.x)
    s.get(NS, tokens(5, tail=T - 1))
    st = s.stats()
    assert (st.lookups, st.tokens_asked, st.tokens_matched, st.tokens_served) == (3, 16 * T, 5 * T, 10 * T)
    assert st.blocks == 5 and st.tiers["hbm"].capacity == 4096
    assert st.to_dict()["tiers"]["ram"]["blocks"] == st.tiers["ram"].blocks


def test_a_get_asks_for_what_it_may_serve_and_misses_count_per_block(make_store) -> None:
    """A get of at most 2 blocks asks for 2 (it counted every block of the prompt: chunked gets of
    a fully held prompt read a hit rate of 0.4); blocks held nowhere are a miss each, in every tier."""
    s = make_store(hbm_blocks=8, nvme=False)
    toks = tokens(4)
    s.put(NS, toks, kv(4 * T))
    for start in range(0, 4, 2):
        assert s.get(NS, toks, start_block=start, max_blocks=2).matched_blocks == 2
    st = s.stats()
    assert (st.lookups, st.tokens_asked, st.tokens_served) == (2, 4 * T, 4 * T)
    before = {t: c.misses for t, c in st.tiers.items()}
    s.get(NS, tokens(4, seed=99))  # four blocks held nowhere
    st = s.stats()
    assert {t: c.misses - before[t] for t, c in st.tiers.items()} == {"hbm": 4, "ram": 4}
    loc = s.locate(NS, toks, tiers=(0,))  # hbm
    s.finish(loc, len(loc.places))
    assert s.stats().tokens_asked == 4 * T + 4 * T + 4 * T  # all four located, asked once


def test_prefetch_in_chunks_reports_the_chain_and_what_remains(make_store, tmp_path) -> None:
    path = tmp_path / "lmdb"
    s = make_store(path=path, ram_blocks=8)
    toks = tokens(5)
    s.put(NS, toks, kv(5 * T), session="conv-7")
    s.close()
    s = make_store(path=path, ram_blocks=8)  # restarted: the 5 blocks sit on nvme only
    assert s.stats().tiers["ram"].used == 0
    # 2 blocks a call: [0, 1], [2, 3], [4]; each call names the chain's length and what is left after it
    steps = [s.prefetch("conv-7", to="ram", start_block=b, max_blocks=2) for b in (0, 2, 4)]
    assert [(r.start_block, r.moved, r.present, r.failed, r.blocks, r.remaining) for r in steps] == [
        (0, 2, 0, 0, 5, 3),
        (2, 2, 0, 0, 5, 1),
        (4, 1, 0, 0, 5, 0),
    ]
    assert s.lookup(NS, toks).tiers == ["ram"] * 5
    # bytes_moved: what the moved blocks now take in ram
    assert sum(r.bytes_moved for r in steps) == s.stats().tiers["ram"].used > 0
    # again: nothing to move; a slice past the end visits nothing
    again = s.prefetch("conv-7", to="ram", start_block=1, max_blocks=3)
    assert (again.moved, again.present, again.bytes_moved, again.remaining) == (0, 3, 0, 1)
    past = s.prefetch("conv-7", to="ram", start_block=9, max_blocks=2)
    assert (past.moved, past.present, past.failed, past.blocks, past.remaining) == (0, 0, 0, 5, 0)
    # the default is still the whole chain
    whole = s.prefetch("conv-7", to="ram")
    assert (whole.present, whole.blocks, whole.remaining) == (5, 5, 0)
    for bad in ({"start_block": -1}, {"max_blocks": -2}):
        with pytest.raises(InvalidRequest, match="non-negative"):
            s.prefetch("conv-7", to="ram", **bad)
    assert s.check_integrity() == []
