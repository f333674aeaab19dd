"""Dead clients: a client killed while holding pins leaks nothing; its pins lapse with the lease.

::

    client A (subprocess) pins P ──► SIGKILL          (never releases)
    t < lease:  evict --all leaves P (pinned)
    t > lease:  stats pinned == 0, evict --all takes P
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.wire.errors import ServerError
from tests.hardening.conftest import T, client, prefix_kv, random_tokens, wait_until, write_config

LEASE = 2.0  # [policy] pin_lease: the longest any pin lives

HOLDER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from tests.hardening.conftest import client, prefix_kv
    endpoint, mode, tokens = sys.argv[1], sys.argv[2], np.array(sys.argv[3].split(","), dtype=np.uint32)
    c = client(endpoint, timeout=30.0)
    if mode == "pin":
        handle, blocks = c.pin(tokens)
        print(f"pinned {blocks}", flush=True)
        time.sleep(3600)  # holds the pin until killed, never releases
    else:
        print("reading", flush=True)
        while True:  # streaming gets, one after another, until killed
            assert c.get(tokens).matched_tokens == len(tokens)
""")


def holder(endpoint: str, mode: str, tokens: np.ndarray) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, endpoint, mode, ",".join(map(str, tokens))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


@pytest.fixture
def daemon(daemons, tmp_path: Path):
    return daemons(write_config(tmp_path, policy={"pin_lease": f"{LEASE}s"}))


@pytest.mark.slow
def test_pins_of_a_killed_client_lapse_and_its_blocks_can_go(daemon) -> None:
    tokens = random_tokens(np.random.default_rng(1), 8)
    with client(daemon.endpoint) as c:
        assert c.put(tokens, prefix_kv(tokens)).stored == 8
        proc = holder(daemon.endpoint, "pin", tokens)
        try:
            line = proc.stdout.readline().decode()  # type: ignore[union-attr]
            pinned_at = time.monotonic()
            assert line.strip() == "pinned 8", proc.stderr.read().decode()  # type: ignore[union-attr]
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
            # while the lease runs, not even an explicit evict takes pinned blocks
            r = c.evict(all=True, dry_run=True)
            if time.monotonic() - pinned_at < LEASE - 0.5:  # (only meaningful while the lease surely runs)
                assert c.stats()["store"]["pinned"] == 8 and r.blocks == 0
        finally:
            proc.kill()
            proc.wait()
        # the lease ends on its own: nothing stays pinned, and eviction works again
        assert wait_until(lambda: c.stats()["store"]["pinned"] == 0, timeout=LEASE + 10)
        assert c.evict(all=True).blocks == 8
        assert c.lookup(tokens).matched_tokens == 0


@pytest.mark.slow
def test_a_client_killed_in_the_middle_of_streaming_gets(daemon) -> None:
    tokens = random_tokens(np.random.default_rng(2), 64)
    with client(daemon.endpoint) as c:
        assert c.put(tokens, prefix_kv(tokens)).stored == 64
        proc = holder(daemon.endpoint, "get", tokens)
        try:
            assert proc.stdout.readline().decode().strip() == "reading"  # type: ignore[union-attr]
            time.sleep(0.5)  # some gets in flight
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
            proc.wait()
        assert wait_until(lambda: c.stats()["store"]["pinned"] == 0, timeout=LEASE + 10)
        assert c.evict(all=True).blocks == 64
        assert daemon.proc.poll() is None


def test_pin_and_release_by_a_live_client(daemon) -> None:
    tokens = random_tokens(np.random.default_rng(3), 6)
    with client(daemon.endpoint) as c:
        c.put(tokens[: 4 * T], prefix_kv(tokens[: 4 * T]))
        handle, blocks = c.pin(tokens, lease=3600)  # asks for an hour: capped at the daemon's lease
        assert blocks == 4  # the held leading blocks only
        assert c.stats()["store"]["pinned"] == 4
        assert c.evict(all=True).blocks == 0
        assert c.release(handle) is True
        assert c.release(handle) is False  # released once
        assert c.release(12345) is False  # unknown handles are no error
        assert c.stats()["store"]["pinned"] == 0
        assert c.evict(all=True).blocks == 4
        with pytest.raises(ServerError) as e:
            c.pin(tokens, lease=0)
        assert e.value.code == "invalid_argument"
