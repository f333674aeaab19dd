"""Crash safety: SIGKILL a daemon at random points of a write-heavy load, again and again.

After every kill the LMDB store is opened in this process with kvstore.Store:

- ``check_integrity()`` finds no broken invariant;
- every block it serves is bit-exact what was put (raw codec everywhere);
- every block acknowledged as durable is still there.

The durable acknowledgement is a ``flush`` that answered ``durable: true``
(``KVStoreClient.flush() -> True``): every block whose put was answered before
that flush was sent is then in LMDB and fsynced. A put reply alone is not
durable: write-through to nvme is asynchronous, so a kill may lose blocks put
since the last flush (never the store's integrity).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore.store.engine import Store
from tests.hardening.conftest import (
    NS,
    Background,
    T,
    assert_exact,
    client,
    loaded,
    prefix_kv,
    random_tokens,
    write_config,
)

CYCLES = 10
MODES = ("fast", "balanced", "safe")  # a process kill loses nothing flushed in any of them


@dataclass
class Put:
    tokens: np.ndarray
    acked: bool = False  # the put reply came back (stored or present, nothing failed)
    durable: bool = False  # a flush sent after the reply answered durable


def load(endpoint: str, seed: int, puts: list[Put], errors: list[tuple[float, BaseException]]) -> object:
    """Put prefixes (new ones, and extensions of earlier ones) as fast as possible, flushing every few."""

    def run(stop: object) -> None:
        rng = np.random.default_rng(seed)
        mine: list[Put] = []
        with client(endpoint, timeout=3.0, retries=0) as c:
            try:
                while not stop.is_set():  # type: ignore[attr-defined]
                    if mine and rng.random() < 0.3:  # a conversation goes on: its prefix grows
                        base = mine[int(rng.integers(len(mine)))].tokens
                        tokens = np.concatenate([base, random_tokens(rng, int(rng.integers(1, 4)))])
                    else:
                        tokens = random_tokens(rng, int(rng.integers(2, 12)))
                    p = Put(tokens)
                    puts.append(p)
                    mine.append(p)
                    r = c.put(tokens, prefix_kv(tokens), session=f"s{seed}-{len(mine) % 5}")
                    p.acked = not r.failed and r.stored + r.present == len(tokens) // T
                    if len(mine) % 4 == 0:
                        acked = [q for q in mine if q.acked]
                        if c.flush(timeout=10.0):
                            for q in acked:
                                q.durable = True
            except (KVStoreError, OSError) as e:  # the daemon was killed under us
                errors.append((time.monotonic(), e))

    return run


@pytest.mark.stress
@pytest.mark.slow
def test_sigkill_during_writes_never_breaks_the_store(daemons, tmp_path: Path) -> None:
    rng = np.random.default_rng(99)
    puts: list[Put] = []
    checked_durable = 0
    for cycle in range(CYCLES):
        cfg = write_config(tmp_path, nvme={"durability": MODES[cycle % len(MODES)]})
        d = daemons(cfg)
        errors: list[tuple[float, BaseException]] = []
        before = len(puts)
        work = Background(load(d.endpoint, 1000 + cycle, puts, errors))
        time.sleep(float(rng.uniform(0.3, 2.5)))
        killed = time.monotonic()
        d.proc.kill()  # SIGKILL: no flush, no clean close, the lock file's flock simply vanishes
        d.wait_exit()
        work.join()
        # the load stopped because of the kill, not before it
        assert all(t >= killed for t, _ in errors), f"a request failed before the kill: {errors}"
        assert len(puts) > before, "no put was even sent before the kill"

        with Store.from_config(loaded(cfg)) as store:
            assert store.check_integrity() == [], f"cycle {cycle}"
            # this cycle's puts, and 60 older ones (every one after the last kill)
            older = puts[:before]
            if cycle < CYCLES - 1 and len(older) > 60:
                older = [older[int(i)] for i in rng.choice(len(older), 60, replace=False)]
            for p in older + puts[before:]:
                got = store.get(NS, p.tokens)
                assert_exact(p.tokens, got.kv, got.matched_tokens)  # whatever is served is exact
                if p.durable:
                    assert got.matched_tokens == len(p.tokens), f"cycle {cycle}: a durable prefix lost blocks"
                    checked_durable += 1
            assert store.check_integrity() == []
    durable = sum(p.durable for p in puts)
    print(
        f"\n{CYCLES} kills, {len(puts)} puts ({sum(p.acked for p in puts)} acked, {durable} durable); "
        f"{checked_durable} durable prefixes checked"
    )
    assert durable > 0 and checked_durable >= durable  # the last cycle checked every one
