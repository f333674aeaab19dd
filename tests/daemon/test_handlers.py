"""The request handlers over a real in-process store (no sockets): replies, errors, the inline lookup."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.config import load_config, with_overrides
from kvstore.daemon.handlers import INLINE_BLOCKS, Handlers
from kvstore.keys import Namespace
from kvstore.store.engine import Store
from kvstore.wire.messages import ErrorReply, Get, GetOk, Inspect, Lookup, LookupOk, Prefetch, Put, PutOk
from kvstore.wire.protocol import Request, tensor_payload
from tests.daemon.conftest import LAYOUT, MODEL

NS = Namespace(model=MODEL, layout=LAYOUT)
T = LAYOUT.block_tokens


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    cfg = load_config(env={})
    cfg = with_overrides(cfg, "hbm", device="cpu", capacity="4MiB")
    cfg = with_overrides(cfg, "ram", capacity="1MiB")
    cfg = with_overrides(cfg, "nvme", enabled=False)
    cfg = with_overrides(cfg, "policy", page_bytes="4KiB")
    s = Store.from_config(cfg)
    yield s
    s.close()


def req(msg: object, rid: int = 1) -> Request:
    return Request(b"peer", rid, msg, NS)  # type: ignore[arg-type]


def test_put_then_get_and_lookup_through_the_handlers(store: Store) -> None:
    h = Handlers(store, dict)
    tokens = np.arange(3 * T, dtype="<u4")
    kv = torch.randn(LAYOUT.shape(3 * T)).to(torch.float16)
    put = h.handle(
        req(
            Put(
                ns=NS.id,
                tokens=tokens,
                shape=LAYOUT.shape(3 * T),
                dtype="float16",
                kv=tensor_payload(kv).tobytes(),
                session="s",
            )
        )
    )
    assert put == PutOk(stored=3, present=0, failed=[], deferred=0)
    got = h.handle(req(Get(ns=NS.id, tokens=tokens, start_block=1, max_blocks=5)))
    assert isinstance(got, GetOk) and (got.start_block, got.blocks) == (1, 2)
    back = torch.frombuffer(bytearray(got.kv), dtype=torch.float16).view(LAYOUT.shape(2 * T))
    assert torch.equal(back, kv[:, :, T:])
    assert h.handle(req(Lookup(ns=NS.id, tokens=tokens))) == LookupOk(3, 3 * T, ["hbm"] * 3)


def test_inline_lookup_only_when_the_store_is_free(store: Store) -> None:
    h = Handlers(store, dict)
    lookup = req(Lookup(ns=NS.id, tokens=np.arange(2 * T, dtype="<u4")))
    # free: answered at once (the event loop's fast path)
    assert h.try_inline(lookup) == LookupOk(0, 0, [])
    # another thread is inside the store: the loop must not wait, so no inline answer
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:  # what a put moving blocks does
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10)
        assert h.try_inline(lookup) is None
    finally:
        release.set()
        t.join()
    # only lookups are ever answered inline
    assert h.try_inline(req(Get(ns=NS.id, tokens=np.arange(T, dtype="<u4")))) is None
    # and only short ones: a walk of many blocks (block_tokens = 1: one per token) would hold up every client
    long = np.arange((INLINE_BLOCKS + 1) * T, dtype="<u4")
    assert h.try_inline(req(Lookup(ns=NS.id, tokens=long))) is None
    assert h.handle(req(Lookup(ns=NS.id, tokens=long))) == LookupOk(0, 0, [])  # a worker answers it


def test_errors_become_error_replies(store: Store) -> None:
    h = Handlers(store, dict)
    missing = h.handle(req(Inspect(session="nobody")))
    assert isinstance(missing, ErrorReply) and missing.code == "not_found"
    bad_tier = h.handle(req(Prefetch(session="s", to="disk")))
    assert isinstance(bad_tier, ErrorReply) and bad_tier.code == "invalid_argument"
    # a put whose parent block is absent is answered with per-block failures, never "stored"
    tokens = np.arange(3 * T, dtype="<u4")
    kv = torch.zeros(LAYOUT.shape(T), dtype=torch.float16)
    put = h.handle(
        req(
            Put(
                ns=NS.id,
                tokens=tokens,
                shape=LAYOUT.shape(T),
                dtype="float16",
                kv=tensor_payload(kv).tobytes(),
                start_block=2,
            )
        )
    )
    assert (
        isinstance(put, PutOk) and put.stored == 0 and [f[:2] for f in put.failed] == [[2, "missing_parent"]]
    )
    # a closed store: every request still gets a reply
    store.close()
    closed = h.handle(req(Lookup(ns=NS.id, tokens=tokens)))
    assert isinstance(closed, ErrorReply) and closed.message
