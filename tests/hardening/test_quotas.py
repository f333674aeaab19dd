"""Per-tenant quotas: one tenant cannot lock the others out of the daemon's shared tables.

    alice (CURVE, confined)                 bob (CURVE, confined)
    hello m0 m1 m2        ok                hello          ok   (alice at her namespace quota)
    hello m3              quota_exceeded    pin x PINS     ok   (alice at her pin quota)
    pin x PINS            ok
    pin                   busy: alice's own count and quota, nothing of bob's
    pin of a miss x 50    ok, 0 blocks: no table slot taken

The global tables (MAX_NAMESPACES, MAX_PINS) stay as a backstop; each tenant gets a share.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.wire.errors import ServerError
from tests.hardening.conftest import MODEL, T, prefix_kv, random_tokens
from tests.hardening.curve_daemon import CurveDaemon, start_curve_daemon

NAMESPACES, PINS = 3, 4
MODELS = [MODEL, "ns-model-1", "ns-model-2"]  # alice's namespaces (the pin test's is the first)


@pytest.fixture(scope="module")
def curve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CurveDaemon]:
    cd = start_curve_daemon(
        tmp_path_factory.mktemp("quotas"),
        server={"max_namespaces_per_tenant": NAMESPACES, "max_pins_per_tenant": PINS},
    )
    try:
        yield cd
    finally:
        assert cd.daemon.stop() == 0, cd.daemon.output()


def test_a_tenant_at_its_namespace_quota_leaves_room_for_others(curve: CurveDaemon) -> None:
    for model in MODELS:
        with curve.client("alice", model=model) as c:
            c.ping()
            c.lookup(list(range(T)))  # hello, then a request in that namespace
    with curve.client("alice", model="one-too-many", retries=0) as c, pytest.raises(ServerError) as e:
        c.lookup(list(range(T)))
    assert e.value.code == "quota_exceeded"
    assert f"tenant 'alice' has registered {NAMESPACES} namespaces" in e.value.message
    with curve.client("alice", model=MODELS[1]) as c:  # her registered namespaces go on working
        assert c.lookup(list(range(T))).matched_tokens == 0
    with curve.client("bob", model="ns-model-bob") as c:
        assert c.lookup(list(range(T))).matched_tokens == 0


def test_a_tenant_at_its_pin_quota_is_told_only_its_own_figures(curve: CurveDaemon) -> None:
    tokens = random_tokens(np.random.default_rng(7), 2)
    other = random_tokens(np.random.default_rng(8), 3)
    with curve.client("alice", retries=0) as alice, curve.client("bob", retries=0) as bob:
        alice.put(tokens, prefix_kv(tokens))
        bob.put(other, prefix_kv(other))
        bobs = [bob.pin(other)[0] for _ in range(2)]  # bob's pins: nothing of them may show to alice
        mine = [alice.pin(tokens)[0] for _ in range(PINS)]
        with pytest.raises(ServerError) as e:
            alice.pin(tokens)
        assert e.value.code == "busy"
        msg = e.value.message
        assert f"tenant 'alice' holds {PINS} pins of {PINS * 2} blocks" in msg and f"{PINS} pins" in msg
        assert "bob" not in msg and set(re.findall(r"\d+", msg)) <= {str(PINS), str(PINS * 2), "2", "65536"}
        # bob is not locked out by alice
        bobs += [bob.pin(other)[0] for _ in range(PINS - 2)]
        # a pin that holds nothing takes no slot: alice, at her quota, may ask as often as she likes
        missing = random_tokens(np.random.default_rng(9), 2)
        for _ in range(50):
            handle, blocks = alice.pin(missing)
            assert blocks == 0
            assert alice.release(handle) is False
        assert all(alice.release(h) for h in mine)
        assert all(bob.release(h) for h in bobs)
        assert alice.pin(tokens)[1] == 2  # room again
