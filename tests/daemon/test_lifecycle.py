"""Starting, refusing to start, stopping and restarting the daemon."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.wire.errors import ServerError
from tests.daemon.conftest import LAYOUT, MODEL, Daemon, StartDaemon, write_config

T = LAYOUT.block_tokens


def kv_for(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(n), generator=g).to(torch.float16)


def client(d: Daemon, timeout: float = 10.0, retries: int = 3) -> KVStoreClient:
    return KVStoreClient(d.endpoint, model=MODEL, layout=LAYOUT, timeout=timeout, retries=retries)


@pytest.mark.slow
def test_sigterm_flushes_and_a_restart_finds_every_acknowledged_block(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    tokens = list(range(100, 100 + 12 * T))
    kv = kv_for(len(tokens))
    d = start_daemon()
    with client(d) as c:
        assert c.put(tokens, kv, session="conv-9").stored == 12
    # SIGTERM: clean stop, exit 0, and the log says why
    assert d.stop(signal.SIGTERM) == 0
    log = d.output()
    assert "serving ipc://" in log and "stopped (SIGTERM)" in log
    assert not (tmp_path / "run" / "kv.sock").exists()  # the socket file went with it
    d2 = start_daemon()
    with client(d2) as c:
        assert c.lookup(tokens).matched_tokens == 12 * T
        got = c.get(tokens)  # read back from nvme (int4): lossy, but all there and close
        assert got.matched_tokens == 12 * T and got.kv is not None
        assert (
            torch.nn.functional.cosine_similarity(got.kv.float().flatten(), kv.float().flatten(), dim=0) > 0.9
        )
        assert "conv-9" in {s.name for s in c.sessions()}


@pytest.mark.slow
def test_client_reconnects_across_a_restart_without_help(start_daemon: StartDaemon) -> None:
    tokens = list(range(500, 500 + 4 * T))
    d = start_daemon()
    c = client(d, timeout=5.0, retries=20)  # a loaded machine may take a while to restart it
    try:
        c.put(tokens, kv_for(len(tokens)))
        first_pid = c.ping()["pid"]
        assert d.stop() == 0
        # restart while the client sleeps; its next calls must just work (fresh socket, hello again)
        done = threading.Event()
        restarted: list[Daemon] = []

        def restart() -> None:
            restarted.append(start_daemon())
            done.set()

        threading.Thread(target=restart, daemon=True).start()
        assert c.lookup(tokens).matched_tokens == 4 * T  # waits through timeouts/retries until it is back
        assert done.wait(60)
        assert c.ping()["pid"] == restarted[0].proc.pid != first_pid
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.parametrize("shared_memory", [False, None])
def test_a_client_without_retries_says_hello_again_to_a_restarted_daemon(
    start_daemon: StartDaemon, shared_memory: bool | None
) -> None:
    # an engine's lookups and loads run with retries=0: a daemon that does not know their namespace
    # (restarted, or a registration it gave up) did nothing, and the client says hello again
    tokens = list(range(700, 700 + 2 * T))
    d = start_daemon()
    c = KVStoreClient(
        d.endpoint, model=MODEL, layout=LAYOUT, timeout=10.0, retries=0, shared_memory=shared_memory
    )
    try:
        assert c.put(tokens, kv_for(len(tokens))).stored == 2
        assert d.stop() == 0
        d2 = start_daemon()
        for _ in range(3):
            assert c.lookup(tokens).matched_tokens == 2 * T
            out = torch.empty(LAYOUT.shape(2 * T), dtype=torch.float16)
            assert c.get_into(tokens, out).matched_tokens == 2 * T
        assert c.ping()["pid"] == d2.proc.pid
    finally:
        c.close()


@pytest.mark.slow
def test_a_killed_daemon_leaves_a_stale_socket_that_the_next_one_replaces(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    d = start_daemon()
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    assert (tmp_path / "run" / "kv.sock").exists()  # nobody answers on it now
    d2 = start_daemon()
    with client(d2) as c:
        assert c.ping()["pid"] == d2.proc.pid


@pytest.mark.slow
def test_a_daemon_killed_by_a_fatal_signal_leaves_the_cause_in_its_log(start_daemon: StartDaemon) -> None:
    # as a damaged LMDB page read in native code would (LMDB has no page checksums): the log names
    # the signal and where each thread was, instead of ending at the last line before it
    d = start_daemon()
    assert d.stop(signal.SIGBUS) == -signal.SIGBUS
    log = d.output()
    assert "Fatal Python error: Bus error" in log and "kvstore" in log.split("Fatal Python error")[1], log


@pytest.mark.slow
def test_refuses_a_second_daemon_on_the_same_endpoint_or_store(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    first = start_daemon()
    # same endpoint (and store): refused before touching the store; the live socket is kept
    second = start_daemon(ready=False)
    assert second.wait_exit(90) == 1
    assert "already serves" in second.output()
    with client(first) as c:
        assert c.ping()["pid"] == first.proc.pid
    # another endpoint, same LMDB path: the store's lock refuses it
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    config = write_config(other, nvme=tmp_path / "nvme")
    third = start_daemon(config, endpoint=f"ipc://{other / 'run' / 'kv.sock'}", ready=False)
    assert third.wait_exit(90) == 1
    assert "refusing to start" in third.output() and str(tmp_path / "nvme") in third.output()
    assert first.stop() == 0


@pytest.mark.slow
def test_refuses_a_socket_directory_others_can_enter(start_daemon: StartDaemon, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o755)
    d = start_daemon(ready=False)
    assert d.wait_exit(90) == 1
    assert "chmod 700" in d.output()
    # the folder may be shared (/tmp, mode 1777): the first advice is a folder of the socket's own
    assert f"a folder of its own, which the daemon creates 0700 (e.g. ipc://{run / 'kvstore'}" in d.output()


@pytest.mark.slow
def test_refuses_plain_tcp_unless_allowed(start_daemon: StartDaemon, tmp_path: Path) -> None:
    d = start_daemon(endpoint="tcp://127.0.0.1:0", ready=False)
    assert d.wait_exit(90) == 1
    assert "allow_insecure_tcp" in d.output()


@pytest.mark.slow
def test_stop_waits_for_requests_in_flight(start_daemon: StartDaemon) -> None:
    d = start_daemon()
    tokens = list(range(64 * T))
    kv = kv_for(len(tokens), seed=5)
    with client(d) as c:
        result: list[object] = []

        def put() -> None:
            try:
                result.append(c.put(tokens, kv))
            except ServerError as e:  # refused as shutting_down, or no answer once the daemon is gone
                result.append(e)

        t = threading.Thread(target=put)
        t.start()
        time.sleep(0.05)
        d.proc.send_signal(signal.SIGTERM)
        t.join(60)
    assert d.wait_exit(60) == 0
    # the put was either answered in full before the stop or refused as shutting_down / timed out,
    # never half-acknowledged: whatever was acknowledged is there after a restart
    d2 = start_daemon()
    with client(d2) as c:
        stored = c.lookup(tokens).matched_blocks
    if result and hasattr(result[0], "stored"):
        assert stored >= result[0].stored


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_serves_tcp_on_loopback_when_allowed_and_exports_metrics(start_daemon: StartDaemon) -> None:
    import urllib.request

    metrics_port = free_port()
    d = start_daemon(
        endpoint=f"tcp://127.0.0.1:{free_port()}", allow_insecure_tcp=True, metrics_port=metrics_port
    )
    tokens = list(range(40, 40 + 3 * T))
    kv = kv_for(len(tokens), seed=7)
    with client(d) as c:
        assert c.put(tokens, kv).stored == 3
        got = c.get(tokens)
        assert got.kv is not None and torch.equal(got.kv, kv)
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    # every request is counted by op and result: the put and the get above among them
    assert 'kvstore_requests_total{code="ok",op="put"}' in body
    assert 'kvstore_requests_total{code="ok",op="get"}' in body
    assert f"metrics: http://127.0.0.1:{metrics_port}/metrics" in d.output()
    assert d.stop() == 0


def test_a_tcp_endpoint_on_any_free_port_says_which_port_it_took(start_daemon: StartDaemon) -> None:
    import re
    import time

    d = start_daemon(endpoint="tcp://127.0.0.1:0", allow_insecure_tcp=True, ready=False)
    deadline = time.monotonic() + 120
    while not (m := re.search(r"serving (tcp://127\.0\.0\.1:(\d+))", d.output())):
        assert d.proc.poll() is None and time.monotonic() < deadline, d.output()
        time.sleep(0.1)
    endpoint, port = m.group(1), int(m.group(2))
    assert port != 0
    with KVStoreClient(endpoint, timeout=10.0) as c:
        assert c.stats()["server"]["endpoint"] == endpoint
    assert d.stop() == 0


def test_every_error_reply_is_counted_under_its_op(start_daemon: StartDaemon) -> None:
    # a hello the daemon refused (quota, a layout over its limits) was counted as an ok hello and not
    # among the errors; a request refused by the protocol was counted under op "other"
    import urllib.request

    metrics_port = free_port()
    d = start_daemon(max_namespaces_per_tenant=1, metrics_port=metrics_port)
    with client(d) as c:
        c.ping()
        errors = c.stats()["server"]["errors"]
        c.lookup(list(range(T)))
    other = KVStoreClient(d.endpoint, model="another-model", layout=LAYOUT, timeout=10, retries=0)
    with other, pytest.raises(ServerError) as e:
        other.lookup(list(range(T)))
    assert e.value.code == "quota_exceeded"
    with client(d) as c:
        assert c.stats()["server"]["errors"] == errors + 1
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert 'kvstore_requests_total{code="quota_exceeded",op="hello"} 1.0' in body
