"""A client's bad arguments: a clear KVStoreError raised before anything is sent, never a raw Python
error from deep inside (msgpack, zmq, a busy loop), and the daemon goes on serving."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError, KVStoreError
from kvstore.results import InvalidRequest
from kvstore.wire.errors import LocalProtocolError
from tests.hardening.conftest import LAYOUT, T, client, prefix_kv, random_tokens, write_config


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1, 0, "5", None, True])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_refused(timeout: Any) -> None:
    with pytest.raises(InvalidRequest, match="timeout must be a finite number of seconds"):
        KVStoreClient(timeout=timeout)


def test_an_endpoint_that_is_no_text_is_refused() -> None:
    with pytest.raises(ConfigError, match="endpoint must be a string"):
        KVStoreClient(endpoint=5)  # type: ignore[arg-type]


def test_arguments_msgpack_cannot_carry_are_refused_before_anything_is_sent(
    daemons: Any, tmp_path: Path
) -> None:
    d = daemons(write_config(tmp_path))
    with client(d.endpoint) as c:
        tokens = random_tokens(np.random.default_rng(7), 2)
        kv = prefix_kv(tokens)
        assert c.put(tokens, kv, session="s").stored == 2
        bad = [
            lambda: c.release(2**70),
            lambda: c.prefetch("s", start_block=10**30),
            lambda: c.evict(older_than=10**30),
            lambda: c.put(tokens, kv, session="\udcff"),
            lambda: c.inspect(session="\udcff"),
        ]
        for call in bad:
            with pytest.raises(KVStoreError) as e:
                call()
            assert isinstance(e.value, (LocalProtocolError, InvalidRequest)), e.value
        with pytest.raises(InvalidRequest, match="timeout"):
            c.flush(timeout=math.nan)  # it sent flush requests as fast as it could, for good
        assert c.lookup(tokens).matched_tokens == 2 * T  # the daemon, and this client, go on
        assert c.stats()["store"]["blocks"] == 2
    with pytest.raises(KVStoreError, match="not valid UTF-8"):
        KVStoreClient(d.endpoint, model="other", layout=LAYOUT, tenant="\udcff")


def test_a_client_used_after_close_says_so(daemons: Any, tmp_path: Path) -> None:
    from kvstore.errors import ClientClosed

    d = daemons(write_config(tmp_path))
    c = client(d.endpoint)
    c.ping()
    c.close()
    with pytest.raises(ClientClosed, match="was closed; make a new KVStoreClient"):
        c.ping()


def test_a_release_that_timed_out_is_not_sent_again(daemons: Any, tmp_path: Path) -> None:
    """A repeat after a time-out finds the pin its first try ended and answers False: the caller
    would take a released pin for one whose lease had lapsed. The time-out is raised instead."""
    import os
    import signal
    import threading

    from kvstore.wire.errors import RequestTimeout

    d = daemons(write_config(tmp_path))
    tokens = random_tokens(np.random.default_rng(8), 2)
    with client(d.endpoint) as setup:
        setup.put(tokens, prefix_kv(tokens))
    c = client(d.endpoint, timeout=0.5, retries=3)
    handle, _ = c.pin(tokens, lease=60)
    os.kill(d.proc.pid, signal.SIGSTOP)
    threading.Timer(0.8, os.kill, (d.proc.pid, signal.SIGCONT)).start()
    with pytest.raises(RequestTimeout):
        c.release(handle)
    c.close()
