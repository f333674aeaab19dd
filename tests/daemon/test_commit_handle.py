"""A commit given a handle that is not a reservation (a locate's, a read's) is refused, and the read
it names goes on: its blocks stay pinned and readable, and its finish lets go of them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.wire.errors import ServerError
from kvstore.wire.messages import Commit, Finish, FinishOk, Locate, LocateOk
from tests.hardening.conftest import (  # noqa: F401 - daemons: a fixture
    LAYOUT,
    NS,
    T,
    assert_exact,
    client,
    daemons,
    endpoint_of,
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)

SHM = {"shm_staging": "1MiB", "shm_staging_per_client": "512KiB"}


def shm_leases(c: KVStoreClient) -> int:
    return int(c.stats()["server"]["shm"]["leases"])


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("where", ["hbm", "nvme"])
def test_a_commit_with_a_locate_handle_is_refused_and_the_read_goes_on(
    daemons: Any,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    keep: bool,
    where: str,
) -> None:
    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": "30s"})
    daemons(cfg)
    rng = np.random.default_rng(7)
    a, b = random_tokens(rng, 6), random_tokens(rng, 6)
    with client(endpoint_of(cfg)) as c:
        assert c.put(a, prefix_kv(a)).stored == 6
        if where == "nvme":  # only on nvme: the read decodes the blocks into the client's staging
            assert c.flush(30)
            c.evict(tier="hbm")
            c.evict(tier="ram")
            assert c.lookup(a).tiers == ["nvme"] * 6
        m = c._shm.mapping()
        assert m is not None, "an ipc client of the daemon's user is offered shared memory"
        # a read, phase one: the 6 blocks are pinned and located, under one lease
        located = c._conn.call(Locate(ns=NS.id, tokens=a, tiers=m.tiers), idempotent=True)
        assert isinstance(located, LocateOk) and len(located.blocks) == 6
        pinned = c.stats()["store"]["pinned"]
        assert shm_leases(c) == 1
        # a commit naming that lease as its staging range: refused, nothing stored
        commit = Commit(
            ns=NS.id, tokens=b, shape=LAYOUT.shape(6 * T), dtype="float16", handle=located.handle, keep=keep
        )
        with pytest.raises(ServerError) as err:
            c._conn.call(commit, idempotent=False)
        assert err.value.code == "invalid_argument"
        assert c.lookup(b).matched_tokens == 0
        # the read is as it was: its blocks pinned, readable, and its finish lets go of them
        assert c.stats()["store"]["pinned"] == pinned and shm_leases(c) == 1
        out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.float16)
        assert m.read_blocks(located.blocks, LAYOUT, out, 0, located.staging) == 6
        assert_exact(a, out, 6 * T)
        done = c._conn.call(Finish(handle=located.handle, used=6), idempotent=True)
        assert done == FinishOk(released=True)
        assert wait_until(lambda: shm_leases(c) == 0, 5)
        assert c.stats()["store"]["pinned"] == 0
        assert "not a reservation" in err.value.message, err.value.message
        # and a put through shared memory (reserve, commit) works as ever
        assert c.put(b, prefix_kv(b)).stored == 6
        got = c.get(b)
        assert got.matched_blocks == 6
        assert_exact(b, got.kv, got.matched_tokens)


def test_a_refused_commit_does_not_keep_the_read_pinned_past_its_lease(
    daemons: Any,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    # a read's lease runs from its locate: commits naming it, refused, must not start its clock again
    # (a client sending them would keep its blocks pinned for as long as it liked)
    lease = 2.0
    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": f"{lease}s"})
    daemons(cfg)
    rng = np.random.default_rng(8)
    a, b = random_tokens(rng, 4), random_tokens(rng, 4)
    with client(endpoint_of(cfg)) as c:
        assert c.put(a, prefix_kv(a)).stored == 4
        m = c._shm.mapping()
        assert m is not None
        t0 = time.monotonic()
        located = c._conn.call(Locate(ns=NS.id, tokens=a, tiers=m.tiers), idempotent=True)
        assert isinstance(located, LocateOk) and len(located.blocks) == 4
        assert c.stats()["store"]["pinned"] > 0
        commit = Commit(ns=NS.id, tokens=b, shape=LAYOUT.shape(4 * T), dtype="float16", handle=located.handle)
        while time.monotonic() - t0 < lease * 0.8:  # refused again and again, up to the lease's end
            with pytest.raises(ServerError) as err:
                c._conn.call(commit, idempotent=False)
            assert err.value.code == "invalid_argument"
            time.sleep(0.2)
        # lapsed at its own time (a sweep runs with stats), not a full lease after the last commit
        assert wait_until(lambda: shm_leases(c) == 0, lease * 0.6), "the read's lease was extended"
        assert c.stats()["store"]["pinned"] == 0
        assert time.monotonic() - t0 < lease * 1.6
