"""Blocks named by an engine's own chained page keys (kvstore.chains.KeyChain), against real daemons.

SGLang names a page by a SHA-256 chained over the pages before it; the store takes those keys in
place of token ids, namespaced like every other block, and keeps them prefix-closed by the order
they come in (page i's parent is page i - 1, the first page's the last prefix key).
"""

from __future__ import annotations

import hashlib
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.chains import KeyChain
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidTokens
from kvstore.keys import Namespace
from tests.hardening.conftest import LAYOUT, MODEL, Raw, T, client, header, write_config

SHM = {"shm_staging": "1MiB", "shm_staging_per_client": "512KiB"}


def page_keys(n: int, seed: str = "s", last: str = "") -> list[str]:
    """SGLang-style page hashes: 64 hex digits, each chained over the one before."""
    out, h = [], last
    for i in range(n):
        h = hashlib.sha256(f"{h}|{seed}|{i}".encode()).hexdigest()
        out.append(h)
    return out


def page_kv(keys: list[str]) -> torch.Tensor:
    """K/V ``[L, 2, n*T, H, D]`` whose block i is a function of page key i."""
    blocks = []
    for k in keys:
        g = torch.Generator().manual_seed(zlib.crc32(bytes.fromhex(k)))
        blocks.append(torch.randn(LAYOUT.shape(T), generator=g).to(torch.float16))
    return torch.cat(blocks, dim=2)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def socket_client(endpoint: str, tenant: str = "default", model: str = MODEL) -> KVStoreClient:
    return KVStoreClient(
        endpoint, model=model, layout=LAYOUT, tenant=tenant, timeout=10.0, shared_memory=False
    )


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "socket"])
def test_pages_round_trip_by_engine_key(daemons: Any, tmp_path: Path, shared: bool) -> None:
    cfg = write_config(tmp_path, server=SHM)
    d = daemons(cfg)
    keys = page_keys(6)
    kv = page_kv(keys)
    with client(d.endpoint) if shared else socket_client(d.endpoint) as c:
        # put pages 0..2, then 3..5 after them (the prefix names the parent)
        assert c.put_from_keys(keys[:3], kv[:, :, : 3 * T]).stored == 3
        r = c.put_from_keys(keys[3:], kv[:, :, 3 * T :], prefix=keys[:3], session="conv")
        assert (r.stored, r.failed) == (3, [])
        assert c.shared_memory == shared
        # found by the keys alone, whatever prefix a call passes: identity is the page key
        assert c.lookup_keys(keys).matched_blocks == 6
        assert c.lookup_keys(keys[3:]).matched_blocks == 3
        assert c.lookup_keys(keys[3:], prefix=keys[:3]).matched_tokens == 3 * T
        out = torch.zeros_like(kv)
        got = c.get_into_keys(keys, out)
        assert got.matched_blocks == 6 and same(out, kv)
        out = torch.zeros_like(kv[:, :, : 3 * T])
        got = c.get_into_keys([bytes.fromhex(k) for k in keys[3:]], out)  # bytes work as well as hex
        assert got.matched_blocks == 3 and same(out, kv[:, :, 3 * T :])
        # the session's chain runs through the engine pages
        assert c.inspect(session="conv").info.blocks == 6
    with socket_client(d.endpoint) as other:  # the other path reads the same blocks
        out = torch.zeros_like(kv)
        assert other.get_into_keys(keys, out).matched_blocks == 6 and same(out, kv)


def test_leading_hits_stop_at_the_first_missing_page(daemons: Any, tmp_path: Path) -> None:
    d = daemons(write_config(tmp_path, server=SHM))
    keys = page_keys(5)
    kv = page_kv(keys)
    with client(d.endpoint) as c:
        c.put_from_keys(keys[:2], kv[:, :, : 2 * T])
        # page 2 never stored; 3 and 4 are refused without their parent
        r = c.put_from_keys(keys[3:], kv[:, :, 3 * T :], prefix=keys[:3])
        assert r.stored == 0 and {f.code for f in r.failed} == {"missing_parent"}
        # stored without a prefix they hang off the root: held, but the walk stops at page 2
        assert c.put_from_keys(keys[3:], kv[:, :, 3 * T :]).stored == 2
        assert c.lookup_keys(keys).matched_blocks == 2
        out = torch.zeros_like(kv)
        assert c.get_into_keys(keys, out).matched_blocks == 2
        assert same(out[:, :, : 2 * T], kv[:, :, : 2 * T])
        assert c.lookup_keys(keys[3:]).matched_blocks == 2


def test_the_same_engine_key_is_another_block_in_another_tenant_or_model(
    daemons: Any, tmp_path: Path
) -> None:
    d = daemons(write_config(tmp_path))
    keys = page_keys(3)
    with socket_client(d.endpoint) as a:
        assert a.put_from_keys(keys, page_kv(keys)).stored == 3
    for other in (socket_client(d.endpoint, tenant="t2"), socket_client(d.endpoint, model="other-model")):
        with other:
            assert other.lookup_keys(keys).matched_blocks == 0
            assert other.get_into_keys(keys, torch.zeros_like(page_kv(keys))).matched_blocks == 0
    # and never the block of a token chain: the store keys differ by construction
    ns = Namespace(model=MODEL, layout=LAYOUT)
    chain = KeyChain.of(keys)
    assert chain.keys(ns, 3) != KeyChain.of(keys).keys(Namespace(model=MODEL, layout=LAYOUT, tenant="t2"), 3)
    tokens = np.frombuffer(bytes.fromhex(keys[0]), dtype="<u4")  # T=4: one block of the key's bytes
    from kvstore.keys import block_keys

    assert block_keys(ns, tokens)[0] != chain.keys(ns, 1)[0]


def test_evicting_a_parent_page_drops_its_children(daemons: Any, tmp_path: Path) -> None:
    d = daemons(write_config(tmp_path, server=SHM))
    parents, children = page_keys(2, "p"), page_keys(2, "c")
    with client(d.endpoint) as c:
        c.put_from_keys(parents, page_kv(parents))
        # the children name the parents as their prefix: they hang below the last parent
        assert c.put_from_keys(children, page_kv(children), prefix=parents).stored == 2
        time.sleep(1.5)
        out = torch.zeros_like(page_kv(children))
        assert c.get_into_keys(children, out, prefix=parents).matched_blocks == 2  # the children read alone
        # evict the old pages -> the parents, and with them (prefix-closed) the newer children
        r = c.evict(older_than=1.0)
        assert r.blocks == 4
        assert c.lookup_keys(children).matched_blocks == 0
        assert c.lookup_keys(parents).matched_blocks == 0


def test_engine_pages_survive_a_restart(daemons: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, server=SHM)
    d = daemons(cfg)
    keys = page_keys(4)
    kv = page_kv(keys)
    with client(d.endpoint) as c:
        c.put_from_keys(keys[:2], kv[:, :, : 2 * T])
        c.put_from_keys(keys[2:], kv[:, :, 2 * T :], prefix=keys[:2])
        assert c.flush(30)
    assert d.stop(signal.SIGTERM) == 0
    d = daemons(cfg)
    with client(d.endpoint) as c:
        assert c.lookup_keys(keys).matched_blocks == 4
        out = torch.zeros_like(kv)
        assert c.get_into_keys(keys, out).matched_blocks == 4 and same(out, kv)  # raw nvme codec: exact
        assert c.evict(all=True).blocks == 4


def test_bad_engine_keys_get_a_clear_error_and_change_nothing(daemons: Any, tmp_path: Path) -> None:
    d = daemons(write_config(tmp_path))
    keys = page_keys(2)
    with socket_client(d.endpoint) as c:
        c.put_from_keys(keys, page_kv(keys))
        before = c.stats()["store"]["blocks"]
        with pytest.raises(InvalidTokens, match="64 hex digits"):
            c.lookup_keys(["abcd"])
        with pytest.raises(InvalidTokens, match="not hex"):
            c.lookup_keys(["zz" * 32])
        ns = c.namespace
        assert ns is not None
        raw = Raw(d.endpoint)
        try:
            hello = raw.ask(header("hello", rid=1, namespace=ns.to_dict()))
            nsid = hello["ns"]
            bad: list[tuple[dict[str, Any], str]] = [
                ({"keys": b"x" * 33}, "invalid_tokens"),  # not whole keys
                ({"keys": b""}, "invalid_tokens"),  # no key at all
                ({"keys": b"x" * 32, "tokens": b"\0" * 16}, "bad_header"),  # both ways at once
                ({}, "bad_header"),  # neither
                ({"tokens": b"\0" * 16, "parent": b"p" * 32}, "bad_header"),  # a parent for tokens
                ({"keys": b"x" * 32, "parent": b"p" * 31}, "invalid_tokens"),
                ({"keys": "ab" * 32}, "bad_header"),  # hex on the wire: bytes only
            ]
            for i, (fields, code) in enumerate(bad, start=2):
                reply = raw.ask(header("lookup", rid=i, ns=nsid, **fields))
                assert reply["op"] == "error" and reply["code"] == code, (fields, reply)
            put = header(
                "put", rid=99, ns=nsid, keys=b"k" * 33, shape=list(LAYOUT.shape(T)), dtype=LAYOUT.dtype
            )
            reply = raw.ask(put, page_kv(keys[:1]).numpy().tobytes())
            assert reply["op"] == "error" and reply["code"] == "invalid_tokens"
        finally:
            raw.close()
        c.ping()
        assert c.stats()["store"]["blocks"] == before
        assert c.lookup_keys(keys).matched_blocks == 2
