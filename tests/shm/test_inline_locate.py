"""A same-host locate answered on the daemon's event loop (Handlers.try_inline): only when it can be
made at once, the same reply a worker makes, and nothing pinned or counted when it is not made."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.config import load_config, with_overrides
from kvstore.daemon.handlers import INLINE_LOCATE_BLOCKS, Handlers
from kvstore.daemon.shared_ops import SharedOps
from kvstore.keys import Namespace
from kvstore.shm.plane import SharedPlane
from kvstore.shm.segment import private_dir
from kvstore.store.engine import Store
from kvstore.wire.messages import ErrorReply, Finish, FinishOk, Locate, LocateOk, Put, PutOk
from kvstore.wire.protocol import Request, tensor_payload
from tests.daemon.conftest import LAYOUT, MODEL

NS = Namespace(model=MODEL, layout=LAYOUT)
T = LAYOUT.block_tokens
PEER = b"peer"


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Store, SharedPlane, Handlers]]:
    plane = SharedPlane(private_dir(tmp_path / "shm"), staging_bytes=1 << 20, per_client=256 << 10, lease=5.0)
    if not plane.offered:
        plane.close()
        pytest.skip("shared memory is offered on x86_64 only")
    cfg = load_config(env={})
    cfg = with_overrides(cfg, "hbm", device="cpu", capacity="1MiB")
    cfg = with_overrides(cfg, "ram", capacity="1MiB")
    cfg = with_overrides(cfg, "nvme", enabled=False)
    cfg = with_overrides(cfg, "policy", page_bytes="4KiB")
    store = Store.from_config(cfg, memory=plane.pools.memory)
    try:
        yield store, plane, Handlers(store, dict, plane=plane)
    finally:
        store.close()
        plane.close()


def req(msg: object, tenant: str | None = None) -> Request:
    return Request(PEER, 1, msg, NS, tenant=tenant)  # type: ignore[arg-type]


def put(h: Handlers, tokens: np.ndarray) -> None:
    kv = torch.randn(LAYOUT.shape(len(tokens))).to(torch.float16)
    msg = Put(
        ns=NS.id,
        tokens=tokens,
        shape=LAYOUT.shape(len(tokens)),
        dtype="float16",
        kv=tensor_payload(kv).tobytes(),
    )
    got = h.handle(req(msg))
    assert isinstance(got, PutOk) and got.stored == len(tokens) // T, got


def locate(tokens: np.ndarray, tiers: list[str] | None = None, **kw: int) -> Locate:
    return Locate(ns=NS.id, tokens=tokens, tiers=["hbm", "ram"] if tiers is None else tiers, **kw)  # type: ignore[arg-type]


def finish(h: Handlers, reply: LocateOk) -> None:
    assert h.handle(req(Finish(handle=reply.handle, used=len(reply.blocks)))) == FinishOk(released=True)


def rows(reply: LocateOk) -> list[list[object]]:
    return [list(b) for b in reply.blocks]


def counts(store: Store, plane: SharedPlane, h: Handlers) -> dict[str, int]:
    """What a read counts and holds: lookups, tokens, each tier's hits and misses, pins, leases and
    the quota's same-host reads."""
    st = store.stats()
    got = {
        "lookups": st.lookups,
        "tokens_asked": st.tokens_asked,
        "tokens_matched": st.tokens_matched,
        "tokens_served": st.tokens_served,
        "pinned": st.pinned,
        "leases": plane.stats()["leases"],
        "quota_reads": len(h.pins._located),
    }
    for name, t in st.tiers.items():
        got |= {f"{name}.hits": t.hits, f"{name}.misses": t.misses, f"{name}.promotions": t.promotions}
    return got


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


def test_a_locate_of_pool_blocks_is_answered_inline_as_a_worker_answers_it(rig) -> None:
    store, plane, h = rig
    tokens = np.arange(5 * T, dtype="<u4")
    put(h, tokens[: 3 * T])  # blocks 0-2 held, 3-4 not: the prefix ends after block 2
    c0 = counts(store, plane, h)
    inline = h.try_inline(req(locate(tokens)))
    assert isinstance(inline, LocateOk)
    assert (len(inline.blocks), inline.tiers, inline.rest, inline.staging) == (3, ["hbm"] * 3, 0, None)
    assert store.stats().pinned == 3 and store.stats().lookups == c0["lookups"] + 1  # pinned, counted once
    assert len(h.pins._located) == 1 and plane.stats()["leases"] == 1  # in the quota, leased
    finish(h, inline)
    c1 = counts(store, plane, h)
    worker = h.handle(req(locate(tokens)))
    assert isinstance(worker, LocateOk)
    assert rows(worker) == rows(inline) and worker.tiers == inline.tiers and worker.rest == inline.rest
    assert (worker.lease, worker.staging) == (inline.lease, inline.staging)
    finish(h, worker)
    # the loop's locate and finish moved every count as a worker's do
    assert delta(c0, c1) == delta(c1, counts(store, plane, h))
    assert store.stats().pinned == 0 and plane.stats()["leases"] == 0 and not h.pins._located
    # from a later block, and capped
    part = h.try_inline(req(locate(tokens, start_block=1, max_blocks=1)))
    assert isinstance(part, LocateOk) and rows(part) == rows(inline)[1:2] and part.start_block == 1
    finish(h, part)


def test_a_locate_that_cannot_be_made_at_once_is_left_to_a_worker_untouched(rig, monkeypatch) -> None:
    """None, and nothing pinned, counted or leased, whenever the answer would wait or needs a worker."""
    store, plane, h = rig
    tokens = np.arange(4 * T, dtype="<u4")
    put(h, tokens)

    def untouched(msg: Locate, tenant: str | None = None, held_lock: Any = None) -> None:
        before = counts(store, plane, h)
        if held_lock is None:
            assert h.try_inline(req(msg, tenant)) is None
        else:
            held, release, got = threading.Event(), threading.Event(), []

            def hold() -> None:
                # what a put moving blocks does (the store's), or a pin waiting for it (the ledger's)
                with held_lock:
                    held.set()
                    release.wait(10)

            t = threading.Thread(target=hold)
            t.start()
            try:
                assert held.wait(10)
                got.append(h.try_inline(req(msg, tenant)))
            finally:
                release.set()
                t.join()
            assert got == [None]
        assert counts(store, plane, h) == before  # (pins included)

    untouched(locate(tokens), held_lock=store._lock)
    untouched(locate(tokens), held_lock=h.pins._lock)
    untouched(locate(tokens), held_lock=plane._lock)  # (a worker making a staging segment, a sweep)
    # blocks held in a tier the client did not map: the daemon copies them into staging, on a worker
    untouched(locate(tokens, tiers=["ram"]))
    untouched(locate(tokens, tiers=[]))
    # a client confined to a tenant (CURVE, tcp) is refused by the worker, as it always was
    untouched(locate(tokens), tenant="t")
    refused = h.handle(req(locate(tokens), tenant="t"))
    assert isinstance(refused, ErrorReply) and refused.code == "no_shared_memory"
    # a long walk would hold up every client
    long = np.arange((INLINE_LOCATE_BLOCKS + 1) * T, dtype="<u4")
    untouched(locate(long))
    capped = h.try_inline(req(locate(long, max_blocks=INLINE_LOCATE_BLOCKS)))
    assert isinstance(capped, LocateOk) and len(capped.blocks) == 4  # (the blocks put: its first four)
    finish(h, capped)
    # the client at its lease bound: nothing pinned, and the worker says why
    from kvstore.shm import plane as plane_mod

    monkeypatch.setattr(plane_mod, "MAX_LEASES_PER_CLIENT", 1)
    held = plane.reserve(PEER, 0)
    untouched(locate(tokens))
    bound = h.handle(req(locate(tokens)))
    assert isinstance(bound, ErrorReply) and bound.code == "too_many_leases", bound
    assert store.stats().pinned == 0
    plane.take(held.handle)
    monkeypatch.undo()
    # the ledger holds many reads (its check walks them all): not on the loop
    from kvstore.daemon import pin_quota

    first = h.try_inline(req(locate(tokens)))
    assert isinstance(first, LocateOk)
    monkeypatch.setattr(pin_quota, "QUICK_HELD", 0)
    untouched(locate(tokens))
    finish(h, first)
    monkeypatch.undo()

    # the reply's rows failing (what nothing should): nothing taken, the worker answers
    def broken(*args: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(SharedOps, "_places", broken)
    untouched(locate(tokens))
