"""One same-host read whose answer mixes pool blocks (read where they lie) and nvme blocks (decoded by
the daemon into the client's staging): served as the socket serves them, and a client killed holding
both kinds leaks neither."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.hardening.conftest import (
    T,
    assert_exact,
    endpoint_of,
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)
from tests.shm.clients import SHM, attached, shm_stats, socket_client
from tests.shm.spy import sent_ops
from tests.shm.test_shared_daemon import CHILD, REPO

HEAD = 3  # blocks read back into a pool (ram: one tier up) before the mixed read; the rest stay on nvme


def held_in_pools_then_on_nvme(c: Any, toks: np.ndarray) -> None:
    """``toks`` (9 blocks) stored; then its first HEAD blocks in the ram pool, the rest on nvme only."""
    assert c.put(toks, prefix_kv(toks)).stored == 9
    assert c.flush(30)
    c.evict(tier="hbm")
    c.evict(tier="ram")
    assert c.lookup(toks).tiers == ["nvme"] * 9
    head = c.get(toks[: HEAD * T])  # read back, and moved up a tier (promote_on_hit)
    assert head.matched_blocks == HEAD
    assert wait_until(lambda: c.lookup(toks).tiers[:HEAD] == ["ram"] * HEAD, 5)
    assert c.lookup(toks).tiers[HEAD:] == ["nvme"] * (9 - HEAD)


def test_pool_and_nvme_blocks_in_one_answer_are_served_as_the_socket_serves_them(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, server=SHM, policy={"promote_on_hit": True})
    ep = endpoint_of(cfg)
    daemons(cfg)
    toks = random_tokens(np.random.default_rng(21), 9)
    with attached(ep) as c:
        held_in_pools_then_on_nvme(c, toks)
        ops = sent_ops(c, monkeypatch)
        got = c.get(toks)
        # one locate answered both kinds: the pool blocks where they lie, the rest through staging
        assert ops.count("locate") == 1 and "get" not in ops, ops
        assert got.tiers == ["ram"] * HEAD + ["nvme"] * (9 - HEAD)
        assert_exact(toks, got.kv, got.matched_tokens)
    with socket_client(ep) as s:
        ref = s.get(toks)
        assert ref.kv is not None and got.kv is not None and ref.matched_blocks == 9
        assert bytes(ref.kv.numpy().tobytes()) == bytes(got.kv.numpy().tobytes())


def test_a_client_killed_holding_pool_pins_and_staging_leaks_nothing(daemons: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, server=SHM, policy={"promote_on_hit": True, "pin_lease": "500ms"})
    ep = endpoint_of(cfg)
    daemons(cfg)
    toks = random_tokens(np.random.default_rng(22), 9)
    with attached(ep) as c:
        held_in_pools_then_on_nvme(c, toks)
        # its locate pins the pool blocks and decodes the nvme ones into its staging; then it dies
        p = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                ep,
                "locate",
                np.ascontiguousarray(toks, dtype="<u4").tobytes().hex(),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == -signal.SIGKILL and "ready" in p.stdout, p.stderr
        shm = shm_stats(c)
        assert shm["leases"] > 0 and shm["staging_used"] > 0 and c.stats()["store"]["pinned"] > 0, shm
        time.sleep(0.7)  # past the lease
        assert wait_until(lambda: shm_stats(c)["leases"] == 0, 5)
        shm = shm_stats(c)
        assert shm["staging_used"] == 0 and shm["lapsed"] >= 1, shm
        assert c.stats()["store"]["pinned"] == 0
        got = c.get(toks)  # and everything still reads back
        assert got.matched_blocks == 9
        assert_exact(toks, got.kv, got.matched_tokens)
