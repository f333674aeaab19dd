"""The durable acknowledgement in every write mode, against real daemons killed with SIGKILL.

``flush`` answering durable means every block put before it is on disk and
synced: with write-through off, and with admission on second use, the blocks
that have no nvme copy yet are written by the flush itself (parents first).
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from tests.hardening.conftest import assert_exact, client, endpoint_of, prefix_kv, random_tokens, write_config


@pytest.mark.parametrize(
    "nvme", [{"write_through": False}, {"admit": "second_use"}], ids=["write-through-off", "second-use"]
)
def test_flush_makes_every_block_durable(daemons, tmp_path: Path, nvme: dict[str, object]) -> None:
    config = write_config(tmp_path, nvme=nvme)
    d = daemons(config)
    rng = np.random.default_rng(3)
    prompts = [random_tokens(rng, n) for n in (1, 5, 12)]
    with client(endpoint_of(config)) as c:
        for p in prompts:
            assert not c.put(p, prefix_kv(p), session=f"s{len(p)}").failed
        assert c.flush(60)
    d.stop(signal.SIGKILL)
    daemons(config)
    with client(endpoint_of(config)) as c:
        for p in prompts:
            got = c.get(p)
            assert got.matched_tokens == len(p)
            assert_exact(p, got.kv, got.matched_tokens)


def test_a_flush_nvme_cannot_make_durable_answers_false_and_does_not_wait_forever(
    daemons, tmp_path: Path
) -> None:
    # an nvme smaller than what memory holds: the daemon answers not durable at once, every time;
    # the client could not tell "not yet" from "cannot", and flush() without a time-out asked on
    # for ever (10 requests a second)
    import threading
    import time

    config = write_config(tmp_path, nvme={"capacity": "1MiB"})
    daemons(config)
    rng = np.random.default_rng(6)
    with client(endpoint_of(config)) as c:
        for _ in range(40):
            t = random_tokens(rng, 16)
            c.put(t, prefix_kv(t))
        done: list[bool] = []
        began = time.monotonic()
        th = threading.Thread(target=lambda: done.append(c.flush()), daemon=True)
        th.start()
        th.join(60)
        assert done == [False] and time.monotonic() - began < 30
