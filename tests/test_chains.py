"""Chains: blocks named by token ids or by an engine's page keys (kvstore.chains)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.chains import KeyChain, TokenChain, as_chain, as_engine_key
from kvstore.errors import InvalidTokens
from kvstore.keys import Namespace, block_keys
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16", block_tokens=8)
NS = Namespace(model="m", layout=LAYOUT)
PAGES = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(5)]


def test_engine_keys_are_taken_as_hex_or_bytes_and_nothing_else() -> None:
    assert as_engine_key(PAGES[0]) == bytes.fromhex(PAGES[0]) == as_engine_key(bytes.fromhex(PAGES[0]))
    for bad in ["ab" * 31, "xy" * 32, b"\0" * 33, 7, None]:
        with pytest.raises(InvalidTokens):
            as_engine_key(bad)


def test_a_page_is_the_same_block_whatever_prefix_a_call_passes() -> None:
    whole = KeyChain.of(PAGES).keys(NS, 5)
    tail = KeyChain.of(PAGES[2:], prefix=PAGES[:2])
    assert tail.keys(NS, 3) == whole[2:]
    assert list(KeyChain.of(PAGES).iter_keys(NS, 2)) == whole[2:]  # no hashing of the pages before
    # the prefix gives the parent: the store key of the last prefix page, or none (the root)
    assert tail.parent_key(NS) == whole[1]
    assert KeyChain.of(PAGES).parent_key(NS) is None


def test_namespaces_and_tenants_never_share_an_engine_block() -> None:
    others = [
        Namespace(model="m", layout=LAYOUT, tenant="t2"),
        Namespace(model="m2", layout=LAYOUT),
        Namespace(model="m", layout=LAYOUT, revision="r1"),
    ]
    mine = set(KeyChain.of(PAGES).keys(NS, 5))
    for ns in others:
        assert mine.isdisjoint(KeyChain.of(PAGES).keys(ns, 5))


@given(st.binary(min_size=32, max_size=32))
def test_token_blocks_never_take_an_engine_blocks_key(raw: bytes) -> None:
    # a token block of exactly the key's bytes (T = 8 ids = 32 bytes) hashes under another root
    tokens = np.frombuffer(raw, dtype="<u4")
    assert block_keys(NS, tokens)[0] != KeyChain(raw).keys(NS, 1)[0]


def test_records_keep_the_engine_key_in_place_of_tokens() -> None:
    c = KeyChain.of(PAGES)
    assert c.identity(3, 8) == (b"", bytes.fromhex(PAGES[3]))
    t = as_chain(np.arange(16))
    assert isinstance(t, TokenChain) and t.identity(1, 8)[0] == np.arange(8, 16, dtype="<u4").tobytes()
    assert c.head(2, 8).fields() == {"keys": c.keys_raw[:64], "parent": None}
    with pytest.raises(InvalidTokens):
        KeyChain(b"\0" * 40)
