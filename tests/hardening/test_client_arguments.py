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


@pytest.mark.parametrize("endpoint", ["foo", "tcp://127.0.0.1", "tcp://127.0.0.1:99999", "udp://h:1"])
def test_an_endpoint_zeromq_cannot_connect_to_is_refused_at_construction(endpoint: str) -> None:
    # it was taken, and the first call raised ZeroMQ's own "Invalid argument"
    with pytest.raises(ConfigError, match="is not allowed; expected 'ipc:///path/to/socket'"):
        KVStoreClient(endpoint=endpoint)


@pytest.mark.parametrize(
    ("name", "value"),
    [("retries", "2"), ("retries", None), ("retries", -1), ("retries", 1.0), ("window", "2"), ("window", 0),
     ("chunk_blocks", 0), ("chunk_blocks", 2.5)],
)  # fmt: skip
def test_counts_that_are_no_ints_are_refused(name: str, value: Any) -> None:
    # retries="2" worked until the daemon first failed to answer, then raised TypeError
    with pytest.raises(InvalidRequest, match=f"{name} must be an int of"):
        KVStoreClient(model="m", layout=LAYOUT, **{name: value})


def test_a_count_may_be_a_numpy_int() -> None:
    KVStoreClient(model="m", layout=LAYOUT, retries=np.int64(1), window=np.int32(2)).close()  # type: ignore[arg-type]


def test_positions_devices_and_ids_that_make_no_sense_are_refused(daemons: Any, tmp_path: Path) -> None:
    import torch

    from kvstore.errors import LayoutError
    from kvstore.kvbuffers import PagedKV

    d = daemons(write_config(tmp_path))
    tokens = random_tokens(np.random.default_rng(9), 2)
    kv = prefix_kv(tokens)
    out = torch.zeros_like(kv)
    with client(d.endpoint) as c:
        assert c.put(tokens, kv).stored == 2
        for start in (4.0, "4", -4, True):
            with pytest.raises(LayoutError, match="start must be a token position"):
                c.get_into(tokens, out, start=start)  # type: ignore[arg-type]
            with pytest.raises(LayoutError, match="start must be a token position"):
                c.put_from(tokens, kv, start=start)  # type: ignore[arg-type]
        # "meta" was served as a hit with no data in it; "cuda" here raised torch's own error after a lookup
        for device in ("meta", "gpu", "cuda" if not torch.cuda.is_available() else "xla"):
            with pytest.raises(InvalidRequest, match="device"):
                c.get(tokens, device=device)
        # a meta tensor (no data: it was reported filled) and one torch will not write in place
        with pytest.raises(LayoutError, match="meta device"):
            c.get_into(tokens, torch.zeros_like(kv, device="meta"))
        with pytest.raises(LayoutError, match="meta device"):
            c.put_from(tokens, torch.zeros_like(kv, device="meta"))
        with pytest.raises(LayoutError, match="requires grad"):
            c.get_into(tokens, torch.zeros(kv.shape, dtype=torch.float32).to(kv.dtype).requires_grad_())
        assert c.put_from(tokens, kv.clone().requires_grad_()).present == 2  # a source may: it is read
        k = [torch.zeros(4, T, *kv.shape[3:], dtype=kv.dtype) for _ in range(LAYOUT.num_layers)]
        with pytest.raises(LayoutError, match="block ids must be integers"):
            PagedKV.blocks(k, k, [0.0, 1.7], 2 * T)  # type: ignore[list-item]  # they were truncated to 0 and 1
        with pytest.raises(LayoutError, match="num_tokens must be an int"):
            PagedKV.blocks(k, k, [0, 1], 2.0 * T)  # type: ignore[arg-type]
        with pytest.raises(LayoutError, match="slots must be integers"):
            PagedKV([b[:, 0] for b in k], [b[:, 0] for b in k], torch.tensor([0.0, 1.0]))
        v = [torch.zeros_like(b) for b in k]
        paged = PagedKV.blocks(k, v, np.array([3, 1]), np.int64(2 * T))  # type: ignore[arg-type]
        got = c.get_into(tokens, paged, start=np.int64(0))  # type: ignore[arg-type]
        assert got.matched_tokens == 2 * T
        assert torch.equal(k[0][3], kv[0, 0, :T]) and torch.equal(v[1][1], kv[1, 1, T:])
        # one engine block named twice: the prefix's block 1 landed over block 0's page, and the get
        # said 2 blocks matched; one buffer as K and V: V over K
        with pytest.raises(LayoutError, match="block ids name 3 more than once"):
            PagedKV.blocks(k, v, [3, 3], 2 * T)
        with pytest.raises(LayoutError, match="slots name 2 more than once"):
            PagedKV([b[:, 0] for b in k], [b[:, 0] for b in v], [2, 0, 2])
        with pytest.raises(LayoutError, match="one buffer as K and as V"):
            PagedKV.blocks(k, k, [3, 1], 2 * T)
        # two layers sharing their buffers (vLLM's cross-layer KV sharing) are taken
        shared = PagedKV.blocks([k[0]] * len(k), [v[0]] * len(v), [3, 1], 2 * T)
        assert shared.num_tokens == 2 * T
        with pytest.raises(LayoutError, match="needs one KV cache per layer"):
            PagedKV.vllm([], [0], 0)
        with pytest.raises(LayoutError, match="a K and a V buffer per layer"):
            PagedKV.blocks([], [], [0], T)
        # paged buffers are held to what a tensor is held to: data, written in place, no shared elements
        with pytest.raises(LayoutError, match="meta device"):
            PagedKV.blocks([b.to("meta") for b in k], [b.to("meta") for b in v], [3, 1], 2 * T)
        with pytest.raises(LayoutError, match="require grad"):
            c.get_into(tokens, PagedKV.blocks([b.clone().requires_grad_() for b in k], v, [3, 1], 2 * T))
        one_token = torch.zeros((*kv.shape[:2], 1, *kv.shape[3:]), dtype=kv.dtype)
        with pytest.raises(LayoutError, match="share memory"):
            c.get_into(tokens, one_token.expand(kv.shape))
        # a stepped view shares nothing: taken
        wide = torch.zeros((*kv.shape[:4], 2 * kv.shape[4]), dtype=kv.dtype)
        assert c.get_into(tokens, wide[..., ::2]).matched_blocks == 2 and torch.equal(wide[..., ::2], kv)
        assert c.get_into(tokens, out).matched_blocks == 2 and torch.equal(out, kv)  # nothing else changed


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


def test_a_closed_client_maps_no_shared_memory_again(daemons: Any, tmp_path: Path) -> None:
    # shared_memory and get mapped the daemon's pools again after close, for good: a stopped daemon's
    # /dev/shm memory stayed allocated while the client lived
    from kvstore.errors import ClientClosed

    def mapped() -> int:
        return sum("/kvs-" in line for line in open("/proc/self/maps"))

    d = daemons(write_config(tmp_path))
    tokens = random_tokens(np.random.default_rng(10), 2)
    c = client(d.endpoint)
    assert c.put(tokens, prefix_kv(tokens)).stored == 2 and c.shared_memory
    assert mapped() > 0
    c.close()
    assert mapped() == 0 and not c.shared_memory
    with pytest.raises(ClientClosed):
        c.get(tokens)
    assert mapped() == 0


def test_closing_a_client_with_abort_ends_the_call_another_thread_waits_on(
    daemons: Any, tmp_path: Path
) -> None:
    # an engine shutting down closes its clients while its save thread waits on a daemon that does
    # not answer (stopped here): close waited for that call's time-outs and retries, 30 s here
    import signal
    import threading
    import time

    from kvstore.errors import ClientClosed

    d = daemons(write_config(tmp_path))
    tokens = random_tokens(np.random.default_rng(13), 2)
    c = client(d.endpoint, timeout=10.0, retries=2)
    assert c.put(tokens, prefix_kv(tokens)).stored == 2
    raised: list[BaseException] = []

    def lookup() -> None:
        try:
            c.lookup(tokens)
        except BaseException as e:
            raised.append(e)

    d.proc.send_signal(signal.SIGSTOP)
    try:
        waiting = threading.Thread(target=lookup)
        waiting.start()
        time.sleep(0.3)  # sent, unanswered
        t0 = time.monotonic()
        c.close(abort=True)
        waiting.join(5)
        assert time.monotonic() - t0 < 2.0 and not waiting.is_alive()
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert len(raised) == 1 and isinstance(raised[0], ClientClosed)
    with client(d.endpoint) as other:  # the daemon is as it was
        assert other.lookup(tokens).matched_blocks == 2


def test_a_call_after_the_daemon_died_takes_no_longer_than_its_retries(daemons: Any, tmp_path: Path) -> None:
    """The hello a reconnect needs spends the call's retries: the first call after the daemon died took
    one timeout more than (retries + 1) x timeout (a hello with retries of its own)."""
    import os
    import signal
    import time

    from kvstore.wire.errors import RequestTimeout

    d = daemons(write_config(tmp_path))
    tokens = random_tokens(np.random.default_rng(11), 2)
    with client(d.endpoint, timeout=1.0, retries=2) as c:
        c.ping()
        assert c.lookup(tokens).matched_tokens == 0  # greeted
        os.kill(d.proc.pid, signal.SIGKILL)
        d.wait_exit()
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            c.lookup(tokens)
        assert time.monotonic() - started < 3.6


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
    wake = threading.Timer(0.8, os.kill, (d.proc.pid, signal.SIGCONT))
    wake.start()
    with pytest.raises(RequestTimeout):
        c.release(handle)
    wake.join()  # before the daemon is stopped
    c.close()
