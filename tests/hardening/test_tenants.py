"""Tenant isolation: over CURVE tcp, tenant bob can neither find, fetch, time-probe, list nor evict alice's blocks.

Every test puts its own tokens (one daemon serves the module), so they do not depend on each other's order.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.connection import Connection
from kvstore.daemon.auth import ClientKeys
from kvstore.errors import Forbidden
from kvstore.keys import Namespace, as_tokens, block_keys
from kvstore.results import LookupResult
from kvstore.wire.errors import ServerError
from kvstore.wire.messages import Get, Lookup, Put
from tests.hardening.conftest import (
    LAYOUT,
    MODEL,
    T,
    assert_exact,
    client,
    prefix_kv,
    random_tokens,
    write_config,
)
from tests.hardening.curve_daemon import CurveDaemon, start_curve_daemon


@pytest.fixture(scope="module")
def curve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CurveDaemon]:
    cd = start_curve_daemon(tmp_path_factory.mktemp("tenants"))
    try:
        yield cd
    finally:
        assert cd.daemon.stop() == 0, cd.daemon.output()


def tokens_of(seed: int, blocks: int) -> np.ndarray:
    return random_tokens(np.random.default_rng(seed), blocks)


def put(c: KVStoreClient, tokens: np.ndarray, session: str | None = None) -> None:
    r = c.put(tokens, prefix_kv(tokens), session=session)
    assert r.stored + r.present == len(tokens) // T and not r.failed


def test_bob_misses_alice_prefix_on_every_read_path(curve: CurveDaemon) -> None:
    mine, never = tokens_of(10, 4), tokens_of(11, 4)
    with curve.client("alice") as alice, curve.client("bob") as bob:
        put(alice, mine, session="conv")
        assert alice.lookup(mine).matched_tokens == 4 * T
        # bob's keys for the same tokens differ (the tenant is hashed into every key): a plain miss, the
        # same reply as for tokens nobody ever stored, so there is no hit to time
        assert bob.lookup(mine) == bob.lookup(never) == LookupResult(0, 0, [])
        got = bob.get(mine)
        assert (got.matched_tokens, got.kv) == (0, None)
        shown = bob.inspect(token_ids=mine)
        assert shown["matched_tokens"] == 0 and shown["blocks"] == []
        # and alice's blocks are as she left them
        back = alice.get(mine)
        assert_exact(mine, back.kv, back.matched_tokens)
        assert back.matched_tokens == 4 * T


def test_a_forged_namespace_id_is_unknown_to_another_tenant(curve: CurveDaemon) -> None:
    mine = tokens_of(20, 2)
    with curve.client("alice") as alice:
        put(alice, mine)
        alice_ns = alice.namespace
    assert alice_ns is not None
    # bob skips the client library and names alice's (registered) namespace id in a lookup
    keys = ClientKeys.resolve(
        curve.endpoint, str(curve.keys["server"].public_file), str(curve.keys["bob"].secret_file)
    )
    bob_ns = Namespace(model=MODEL, layout=LAYOUT, tenant="bob")
    conn = Connection(curve.endpoint, timeout=10.0, retries=0, namespace=bob_ns, curve=keys)
    try:
        conn.ensure_hello()
        errors = []
        for ns_id in (alice_ns.id, "0123456789abcdef"):  # alice's, and one nobody registered
            # a lookup; a put of a shape and a get of a count that alice's layout would refuse
            # (whose checks would otherwise tell that the namespace exists, and its layout)
            for msg in (
                Lookup(ns=ns_id, tokens=as_tokens(mine)),
                Put(ns=ns_id, tokens=as_tokens(mine), shape=(1, 2, 3, 4, 5), dtype="float32", kv=b"\0" * 480),
                Get(ns=ns_id, tokens=as_tokens(mine), max_blocks=0),
            ):
                with pytest.raises(ServerError) as e:
                    conn.call(msg, idempotent=True, greet=False)
                errors.append((e.value.code, e.value.message.replace(ns_id, "<ns>")))
    finally:
        conn.close()
    # word for word the same answers: bob cannot even learn that alice's namespace exists
    assert errors[:3] == errors[3:] and {code for code, _ in errors} == {"unknown_namespace"}


def test_session_names_are_per_tenant(curve: CurveDaemon) -> None:
    a_tokens, b_tokens = tokens_of(30, 3), tokens_of(31, 2)
    with curve.client("alice") as alice, curve.client("bob") as bob:
        put(alice, a_tokens, session="chat")
        put(bob, b_tokens, session="chat")  # same name, another tenant: a session of its own
        a_chat = alice.inspect(session="chat")
        b_chat = bob.inspect(session="chat")
        assert (a_chat.info.name, a_chat.info.tenant, a_chat.info.tokens) == ("chat", "alice", 3 * T)
        assert (b_chat.info.name, b_chat.info.tenant, b_chat.info.tokens) == ("chat", "bob", 2 * T)
        # listings show each tenant its own sessions only, under the names it gave
        assert {s.tenant for s in alice.sessions()} == {"alice"}
        assert {s.tenant for s in bob.sessions()} == {"bob"}
        assert "chat" in {s.name for s in bob.sessions()}
        put(alice, a_tokens, session="alice-only")
        assert "alice-only" not in {s.name for s in bob.sessions()}
        with pytest.raises(ServerError) as e:
            bob.inspect(session="alice-only")
        assert e.value.code == "not_found"
        with pytest.raises(ServerError) as e:
            bob.prefetch("alice-only")
        assert e.value.code == "not_found"
        assert e.value.message == "no session 'alice-only' to prefetch"  # the name bob gave, not 'bob/...'
        assert bob.prefetch("chat").session == "chat"
    # the operator key sees both, qualified by tenant
    with curve.client("operator", namespace=False) as op:
        names = {(s.name, s.tenant) for s in op.sessions()}
    assert {("alice/chat", "alice"), ("bob/chat", "bob")} <= names


def test_a_session_a_trusted_client_named_in_bob_s_space_is_not_bob_s(curve: CurveDaemon) -> None:
    """An engine of tenant alice over an operator key (or ipc) names its session "bob/conv-42", the
    name bob's own "conv-42" is stored under: bob can neither prefetch, size nor take it over."""
    a_tokens, b_tokens = tokens_of(35, 3), tokens_of(36, 2)
    with curve.client("operator", "alice") as engine, curve.client("bob") as bob:
        put(engine, a_tokens, session="bob/conv-42")
        engine.evict(session="bob/conv-42", tier="hbm")  # alice's blocks below hbm
        with pytest.raises(ServerError) as e:
            bob.prefetch("conv-42", to="hbm")
        assert (e.value.code, e.value.message) == ("not_found", "no session 'conv-42' to prefetch")
        assert "hbm" not in engine.lookup(a_tokens).tiers  # not moved for bob
        with pytest.raises(Forbidden, match="another tenant"):
            put(bob, b_tokens, session="conv-42")
        assert bob.lookup(b_tokens).matched_tokens == 0  # nothing stored by the refused put
        detail = engine.inspect(session="bob/conv-42")
        assert (detail.info.tenant, detail.info.tokens) == ("alice", 3 * T)
        # and the other way round: a session of bob's is not continued by a trusted put for alice
        put(bob, b_tokens, session="mine-1")
        with pytest.raises(Forbidden, match="another tenant"):
            put(engine, a_tokens, session="bob/mine-1")


def test_bob_cannot_evict_alice_blocks(curve: CurveDaemon) -> None:
    a_tokens, b_tokens = tokens_of(40, 3), tokens_of(41, 2)
    with curve.client("alice") as alice, curve.client("bob") as bob:
        put(alice, a_tokens, session="keep")
        put(bob, b_tokens, session="mine")
        alice_keys = set(block_keys(alice.namespace, a_tokens))  # type: ignore[arg-type]

        # by session name: bob's "keep" is not alice's "keep"
        assert bob.evict(session="keep").blocks == 0
        # by a tenant filter naming alice: refused outright
        with pytest.raises(Forbidden):
            bob.evict(tenant="alice")
        with pytest.raises(Forbidden):
            bob.evict(tenant="alice", dry_run=True)
        # by alice's namespace id: ANDed with tenant bob, it selects nothing
        assert bob.evict(namespace=alice.namespace.id).blocks == 0  # type: ignore[union-attr]
        # by --all: every block of bob, none of alice
        gone = bob.evict(all=True)
        assert gone.blocks >= 2 and not alice_keys & set(gone.keys)
        assert bob.lookup(b_tokens).matched_tokens == 0

        assert alice.lookup(a_tokens).matched_tokens == 3 * T
        assert "keep" in {s.name for s in alice.sessions()}
        # alice's own evict by session works as before, on her blocks
        assert alice.evict(session="keep").blocks == 3
        assert alice.lookup(a_tokens).matched_tokens == 0


def test_stats_of_a_tenant_count_only_its_own_blocks(curve: CurveDaemon) -> None:
    with curve.client("alice") as alice, curve.client("bob") as bob:
        put(alice, tokens_of(50, 5), session="big")
        bob.evict(all=True)
        put(bob, tokens_of(51, 2), session="small")
        s = bob.stats()
        a = alice.stats()
        bob_sessions = len(
            bob.sessions()
        )  # "small", and those of earlier tests (sessions outlive their blocks)
    assert s["tenant"] == "bob" and s["store"]["blocks"] == 2 and s["store"]["sessions"] == bob_sessions
    assert s["store"]["tiers"]["hbm"]["used"] == 2 * LAYOUT.block_nbytes
    assert a["tenant"] == "alice" and a["store"]["blocks"] >= 5
    # no store-wide or other clients' activity in a tenant's view
    assert not {"lookups", "tokens_asked", "tokens_matched", "namespaces"} & set(s["store"])
    assert not {"requests", "errors", "clients", "namespaces", "inflight"} & set(s["server"])
    with curve.client("operator", namespace=False) as op:
        assert op.stats()["store"]["blocks"] >= 7


def test_a_tenant_s_bytes_are_its_own_whatever_others_store(curve: CurveDaemon) -> None:
    """Blocks of another size stored and evicted by alice leave bob's figures as they were (his
    bytes were his share of the tier's blocks times all the bytes it held: alice's put moved them)."""
    from dataclasses import replace

    from kvstore.client import KVStoreClient

    wide = replace(LAYOUT, num_layers=LAYOUT.num_layers * 4)
    alice_wide = KVStoreClient(
        curve.endpoint,
        model=MODEL,
        layout=wide,
        tenant="alice",
        timeout=10.0,
        curve_server_key=str(curve.keys["server"].public_file),
        curve_secret_key=str(curve.keys["alice"].secret_file),
    )
    with alice_wide, curve.client("bob") as bob:
        bob.evict(all=True)
        put(bob, tokens_of(70, 1))
        before = bob.stats()["store"]["tiers"]["hbm"]
        assert before["blocks"] == 1 and before["used"] >= LAYOUT.block_nbytes
        tokens = tokens_of(71, 3)
        g = torch.Generator().manual_seed(3)
        assert alice_wide.put(tokens, torch.randn(wide.shape(len(tokens)), generator=g).half()).stored == 3
        assert bob.stats()["store"]["tiers"]["hbm"] == before
        alice_wide.evict(all=True)
        assert bob.stats()["store"]["tiers"]["hbm"] == before


def test_over_ipc_the_hello_tenant_is_trusted_and_operators_span_tenants(
    daemons: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path)
    d = daemons(config)
    run = tmp_path / "run"
    # the socket's directory is private to the daemon's user; the socket too
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(run / "kv.sock").st_mode) == 0o600
    a_tokens = tokens_of(60, 2)
    alice = KVStoreClient(d.endpoint, model=MODEL, layout=LAYOUT, tenant="alice", timeout=10.0)
    bob = KVStoreClient(d.endpoint, model=MODEL, layout=LAYOUT, tenant="bob", timeout=10.0)
    with alice, bob, client(d.endpoint) as operator:
        put(alice, a_tokens, session="conv")
        # tenants still never share blocks (the keys differ) ...
        assert bob.lookup(a_tokens).matched_tokens == 0
        # ... but over ipc there is no authenticated identity: session names are not qualified and
        # operator ops span every tenant, including a tenant filter naming another
        assert ("conv", "alice") in {(s.name, s.tenant) for s in operator.sessions()}
        assert bob.evict(tenant="alice").blocks == 2
        assert alice.lookup(a_tokens).matched_tokens == 0
    assert d.stop() == 0
