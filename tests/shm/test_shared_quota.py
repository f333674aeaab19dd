"""Same-host reads count in a tenant's pin quota: the blocks a locate pins, until its finish or its lease's
end, are pins like the pin op's.

    client (tenant "default"; quota 2 pins of 8 blocks)
    locate 6 blocks, no finish yet    located in the shared pools: 1 pin of 6 blocks held
    get of the same 6 blocks          past the quota: copied into staging, nothing more pinned; exact
    pin of 4 blocks                   busy: "holds 1 pins of 6 blocks (same-host reads' included)"
    finish of the first locate        the pin of 4 blocks is taken
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.daemon.shared_ops import STAGING
from kvstore.wire.errors import ServerError
from kvstore.wire.messages import Finish, Locate, LocateOk
from tests.hardening.conftest import (
    NS,
    T,
    assert_exact,
    endpoint_of,
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)
from tests.shm.clients import SHM, attached, shm_stats


def test_a_locate_s_pins_count_in_the_tenant_s_pin_quota(daemons: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, server={**SHM, "max_pins_per_tenant": 2, "max_pinned_blocks_per_tenant": 8})
    ep = endpoint_of(cfg)
    daemons(cfg)
    tokens = random_tokens(np.random.default_rng(21), 6)
    with attached(ep) as c:
        assert c.put(tokens, prefix_kv(tokens)).stored == 6
        m = c._shm.mapping()
        assert m is not None
        held = c._conn.call(Locate(ns=NS.id, tokens=tokens, tiers=m.tiers), idempotent=True)
        assert isinstance(held, LocateOk) and len(held.blocks) == 6
        assert all(b[0] != STAGING for b in held.blocks)  # in the shared pools, pinned
        # another read of them would pin 6 more: past the 8-block quota, so it is copied instead,
        # and counted as the one lookup of 6 blocks it is (no misses: every block was served)
        before = c.stats()["store"]
        over = c._conn.call(Locate(ns=NS.id, tokens=tokens, tiers=m.tiers), idempotent=True)
        assert isinstance(over, LocateOk) and [b[0] for b in over.blocks] == [STAGING] * 6
        c._conn.call(Finish(handle=over.handle, used=6), idempotent=True)
        after = c.stats()["store"]
        assert after["lookups"] - before["lookups"] == 1
        assert after["tokens_asked"] - before["tokens_asked"] == 6 * T
        for tier in after["tiers"]:
            assert after["tiers"][tier]["misses"] == before["tiers"][tier]["misses"], tier
        got = c.get(tokens)
        assert got.matched_blocks == 6
        assert_exact(tokens, got.kv, got.matched_tokens)
        with pytest.raises(ServerError) as e:
            c.pin(tokens[: 4 * T])
        assert e.value.code == "busy" and "holds 1 pins of 6 blocks" in e.value.message
        c._conn.call(Finish(handle=held.handle, used=6), idempotent=True)
        assert wait_until(lambda: shm_stats(c)["leases"] == 0, 5)
        handle, blocks = c.pin(tokens[: 4 * T])
        assert blocks == 4 and c.release(handle)
