"""Blocks larger than a tier: never made room for by pushing that tier's blocks out.

hbm 2 KiB, ram 16 KiB (2 KiB pages), nvme 4 MiB; the tiny layout's blocks are 1 KiB.

    put of a 3 KiB block   hbm cannot hold it even empty: hbm's blocks stay; it goes to ram
    put of an 8 MiB block  no tier can: refused (LayoutError), every tier as it was
"""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import LayoutError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store.engine import Store
from tests.store.storekit import NS, kv, same, tokens


def layout(layers: int) -> KVLayout:
    """The tiny layout with ``layers`` layers: 512 bytes a layer a block."""
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_tokens=4)


def block_of(lay: KVLayout, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(lay.shape(), generator=g).to(torch.bfloat16)


def usage(s: Store) -> dict[str, tuple[int, int, int]]:
    return {name: (u.blocks, u.used, u.evictions) for name, u in s.stats().tiers.items()}


def test_a_block_larger_than_hbm_goes_below_and_hbm_keeps_its_blocks(make_store) -> None:
    s = make_store(hbm_blocks=2, ram_blocks=8)
    # prepare hbm [a0, a1]
    a = tokens(2)
    assert s.put(NS, a, kv(len(a))).stored == 2
    assert s.lookup(NS, a).tiers == ["hbm"] * 2
    big = Namespace("big-model", layout(6))  # 3 KiB blocks: more than hbm's 2 KiB
    x = block_of(big.layout)
    r = s.put(big, tokens(1, seed=7), x)
    assert r.stored == 1 and not r.failed
    assert s.lookup(big, tokens(1, seed=7)).tiers == ["ram"]
    assert s.lookup(NS, a).tiers == ["hbm"] * 2  # nothing was pushed down for it
    got = s.get(NS, a)
    assert got.kv is not None and same(got.kv, kv(len(a)))


def test_a_block_no_tier_could_hold_is_refused_and_changes_nothing(make_store) -> None:
    s = make_store()
    a = tokens(3)
    assert s.put(NS, a, kv(len(a))).stored == 3
    s.flush()
    before = usage(s)
    # 8 MiB blocks: nvme holds 4 MiB
    huge = Namespace(
        "huge-model", KVLayout(num_layers=64, num_kv_heads=32, head_dim=256, dtype="bfloat16", block_tokens=4)
    )
    with pytest.raises(LayoutError, match="larger than any tier can hold"):
        s.put(huge, tokens(1, seed=8), block_of(huge.layout))
    assert usage(s) == before  # every tier as it was: nvme's copies too
    assert s.lookup(NS, a).tiers == ["hbm"] * 3
