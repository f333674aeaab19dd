"""Store: put / lookup / get, block boundaries, presence, parents, input checks."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import InvalidTokens, LayoutError
from kvstore.keys import Namespace, block_keys
from kvstore.results import MISSING_PARENT, InvalidRequest
from tests.store.storekit import NS, T, kv, same, tokens


def test_put_then_lookup_and_get_return_the_same_blocks(make_store) -> None:
    s = make_store(nvme=False)
    toks, data = tokens(3), kv(3 * T)
    # put [0, 1, 2] -> all three new, in hbm
    r = s.put(NS, toks, data)
    assert (r.stored, r.present, r.failed) == (3, 0, [])
    look = s.lookup(NS, toks)
    assert (look.matched_blocks, look.matched_tokens, look.tiers) == (3, 3 * T, ["hbm"] * 3)
    got = s.get(NS, toks)
    assert got.matched_tokens == 3 * T and got.kv is not None
    assert same(got.kv, data)  # hbm is bit-exact
    assert s.check_integrity() == []


def test_a_put_of_separate_block_tensors_stores_what_a_put_of_one_tensor_does(make_store) -> None:
    s = make_store()
    toks, data = tokens(3), kv(3 * T, seed=4)
    blocks = [data[:, :, j * T : (j + 1) * T].clone() for j in range(3)]  # block-major, as get fills
    r = s.put(NS, toks, blocks[1:], start_block=1)
    assert r.failed and r.failed[0].code == MISSING_PARENT  # block 0 first, as for a tensor
    assert s.put(NS, toks, blocks).stored == 3
    assert same(s.get(NS, toks).kv, data)
    assert s.put(NS, toks, blocks[:2]).present == 2
    with pytest.raises(LayoutError, match="put block"):
        s.put(NS, toks, [blocks[0], data[:, :, : T + 1]])  # a block must be T tokens
    with pytest.raises(LayoutError, match="request names only"):
        s.put(NS, toks, [*blocks, blocks[0]])  # more blocks than the tokens name
    assert s.check_integrity() == []


def test_only_full_blocks_are_stored_and_matched(make_store) -> None:
    s = make_store(nvme=False)
    # 3 blocks + 2 tail tokens -> 3 blocks stored, the tail is the engine's to recompute
    toks, data = tokens(3, tail=2), kv(3 * T + 2)
    assert s.put(NS, toks, data).stored == 3
    assert s.lookup(NS, toks).matched_tokens == 3 * T
    # a longer prompt sharing the prefix matches the prefix only
    assert s.lookup(NS, tokens(5)).matched_blocks == 3
    # a prompt diverging inside block 1 matches block 0 only
    other = list(toks)
    other[T + 1] += 7
    assert s.lookup(NS, other).matched_blocks == 1


def test_blocks_already_present_are_not_rewritten(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T, seed=1))
    # the same prefix again with other values: present, kept as first stored
    r = s.put(NS, toks, kv(2 * T, seed=2), session="later")
    assert (r.stored, r.present) == (0, 2)
    assert same(s.get(NS, toks).kv, kv(2 * T, seed=1))
    # ... but the session tag is added
    assert s.session("later").info.blocks == 2


def test_put_without_its_parent_is_refused_not_orphaned(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(4)
    # put blocks [2, 3] while [1] is absent -> both refused with missing_parent, nothing stored
    r = s.put(NS, toks, kv(2 * T), start_block=2)
    assert r.stored == 0 and [(i, code) for i, code, _ in r.failed] == [
        (2, MISSING_PARENT),
        (3, MISSING_PARENT),
    ]
    assert s.lookup(NS, toks).matched_blocks == 0
    assert s.stats().blocks == 0
    assert s.check_integrity() == []


def test_a_put_that_stores_nothing_registers_no_namespace(make_store, tmp_path) -> None:
    # a put refused whole (its parent missing) added its namespace to the store, its stats and the
    # disk, for good: bad input changes nothing
    s = make_store(path=tmp_path / "disk")
    ghost = Namespace("ghost", NS.layout)
    assert s.put(ghost, tokens(2), kv(T), start_block=1).stored == 0
    assert s.stats().namespaces == 0 and s.usage() == []
    assert s.put(NS, tokens(2), kv(2 * T)).stored == 2
    assert s.stats().namespaces == 1
    assert s.flush(10)
    s.close()
    assert make_store(path=tmp_path / "disk").stats().namespaces == 1


def test_a_put_refused_for_room_registers_no_namespace(make_store) -> None:
    s = make_store(nvme=False, hbm_blocks=2, ram_blocks=2)
    toks = tokens(8, seed=3)
    assert s.put(NS, toks, kv(8 * T)).stored >= 2
    s.pin(block_keys(NS, toks))  # every block held pinned: no tier has room for another
    r = s.put(Namespace("other-model", NS.layout), tokens(1, seed=4), kv(T))
    assert r.stored == 0 and r.failed[0].code == "no_room"
    assert s.stats().namespaces == 1


def test_a_long_prefix_streams_in_chunks(make_store) -> None:
    s = make_store(nvme=False)
    toks, data = tokens(4), kv(4 * T)
    assert s.put(NS, toks, data[:, :, : 2 * T]).stored == 2  # blocks [0, 1]
    assert s.put(NS, toks, data[:, :, 2 * T :], start_block=2).stored == 2  # blocks [2, 3]
    assert s.lookup(NS, toks).matched_blocks == 4
    assert same(s.get(NS, toks).kv, data)
    # get from block 2 on: only those blocks come back
    part = s.get(NS, toks, start_block=2, max_blocks=1)
    assert part.matched_blocks == 1 and same(part.kv, data[:, :, 2 * T : 3 * T])


def test_namespaces_do_not_share_blocks(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    other_tenant = Namespace(NS.model, NS.layout, tenant="someone-else")
    other_model = Namespace("other-model", NS.layout)
    assert s.lookup(other_tenant, toks).matched_blocks == 0
    assert s.lookup(other_model, toks).matched_blocks == 0
    assert s.get(other_tenant, toks).kv is None


def test_malformed_input_raises_clear_errors(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(2)
    with pytest.raises(LayoutError, match="dtype"):
        s.put(NS, toks, kv(2 * T).float())
    with pytest.raises(LayoutError, match="shape"):
        s.put(NS, toks, kv(2 * T)[:, :, :, :1])
    with pytest.raises(LayoutError, match="full blocks"):
        s.put(NS, toks, kv(3 * T))  # more kv than tokens to key it with
    with pytest.raises(InvalidTokens):
        s.put(NS, [-1] * 8, kv(2 * T))
    with pytest.raises(InvalidRequest, match="start_block"):
        s.put(NS, toks, kv(2 * T), start_block=-1)
    assert s.stats().blocks == 0


def test_lookup_walks_keys_from_block_keys(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(3)
    s.put(NS, toks, kv(3 * T))
    keys = block_keys(NS, toks)
    assert s.pin(keys).keys == tuple(keys)  # the index is keyed by the chained keys
    assert torch.equal(torch.tensor(s.lookup(NS, toks[: 2 * T]).matched_tokens), torch.tensor(2 * T))


def test_a_put_longer_than_one_chunk_is_stored_whole(make_store) -> None:
    # puts go in chunks of 32 blocks (the lock is let go in between); 70 blocks span three
    s = make_store(hbm_blocks=40, ram_blocks=40, nvme=False)
    toks, data = tokens(70), kv(70 * T)
    r = s.put(NS, toks, data, session="long")
    assert (r.stored, r.failed) == (70, [])
    assert s.lookup(NS, toks).matched_blocks == 70
    assert same(s.get(NS, toks).kv, data)
    assert s.session("long").info.tokens == 70 * T
    assert s.check_integrity() == []
