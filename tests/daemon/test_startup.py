"""Start-up: one daemon per endpoint whatever the timing, and a daemon that says what it is doing.

daemon A  lock ── bind ── build the store (pools, index: seconds) ─────── serve
daemon B     lock: refused "another kvstore daemon (pid A) already serves ..."   exit 1
client          ── "starting" ── "starting" ── ... ── the reply            (waits up to its timeout)
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import zmq

from kvstore.cli.commands import main as cli_main
from kvstore.client import KVStoreClient
from kvstore.daemon.endpoint import probe
from kvstore.daemon.startup import stored_blocks
from kvstore.errors import DaemonStarting
from tests.daemon.conftest import LAYOUT, MODEL, Daemon, write_config

T = LAYOUT.block_tokens


def slow_config(root: Path, *, nvme: Path | None = None, pools: str = "384MiB") -> Path:
    """A config whose store takes seconds to build: big hbm and ram pools, allocated and zeroed."""
    root.mkdir(parents=True, exist_ok=True)
    path = write_config(root, nvme=nvme)
    text = path.read_text().replace('capacity = "16MiB"', f'capacity = "{pools}"')
    path.write_text(text)
    return path


def wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_a_second_daemon_started_while_the_first_allocates_is_refused(start_daemon, tmp_path: Path) -> None:
    # same endpoint, different nvme paths. The second starts while the first is allocating its
    # pools (seconds before its bind): before the lock both ran, and the later bind unlinked the
    # other's socket file, so one of them served nobody
    first = start_daemon(slow_config(tmp_path, nvme=tmp_path / "nvme-a", pools="1GiB"), ready=False)
    endpoint = first.endpoint
    assert wait_for(lambda: first.proc.poll() is not None or rss(first.proc.pid) > 600 * 2**20, 90)
    (tmp_path / "b").mkdir()
    other = write_config(tmp_path / "b", endpoint=endpoint, nvme=tmp_path / "nvme-b")
    os.kill(first.proc.pid, signal.SIGSTOP)  # hold the first inside its start-up window
    try:
        second = start_daemon(other, endpoint=endpoint, ready=False)
        ctx = zmq.Context()
        try:
            settled = wait_for(
                lambda: second.proc.poll() is not None or probe(ctx, endpoint, timeout_ms=200) is not None, 90
            )
        finally:
            ctx.destroy(linger=0)
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    assert settled and second.proc.poll() is not None, "the second daemon serves the first one's endpoint"
    assert second.wait_exit(10) == 1, second.output()
    refusal = second.output()
    assert f"another kvstore daemon (pid {first.proc.pid}) already serves {endpoint}" in refusal, refusal
    first.wait_ready()
    with KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=10) as c:
        assert c.ping()["pid"] == first.proc.pid  # the refused daemon left the socket alone
    assert first.stop() == 0
    assert not (tmp_path / "run" / "kv.sock").exists()


@pytest.mark.slow
def test_a_daemon_removes_only_the_socket_file_it_bound(start_daemon, tmp_path: Path) -> None:
    d = start_daemon()
    sock_path = tmp_path / "run" / "kv.sock"
    # someone replaces the socket file behind the daemon's back (an operator, a stale script)
    sock_path.unlink()
    ctx = zmq.Context()
    theirs = ctx.socket(zmq.ROUTER)
    theirs.bind(f"ipc://{sock_path}")
    try:
        assert d.stop() == 0
        assert sock_path.exists(), "the daemon removed a socket file it did not bind"
        assert "no longer the socket this daemon bound" in d.output()
    finally:
        theirs.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_a_tcp_endpoint_is_locked_too(start_daemon, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    config = slow_config(tmp_path, nvme=tmp_path / "nvme-a")
    text = config.read_text().replace(f"ipc://{tmp_path / 'run' / 'kv.sock'}", endpoint)
    text = text.replace("[server]\n", "[server]\nallow_insecure_tcp = true\n", 1)
    config.write_text(text)
    other = tmp_path / "other.toml"
    other.write_text(text.replace(str(tmp_path / "nvme-a"), str(tmp_path / "nvme-b")))
    a = start_daemon(config, endpoint=endpoint, ready=False)
    assert wait_for(lambda: "starting (pid" in a.output(), 60), a.output()
    b = start_daemon(other, endpoint=endpoint, ready=False)
    assert b.wait_exit(60) == 1
    assert f"(pid {a.proc.pid}) already serves {endpoint}" in b.output(), b.output()
    a.wait_ready()
    assert a.stop() == 0


@pytest.mark.slow
def test_start_up_is_logged_and_clients_wait_for_it(start_daemon, tmp_path: Path) -> None:
    d: Daemon = start_daemon(slow_config(tmp_path, pools="1GiB"), ready=False)
    sock_path = tmp_path / "run" / "kv.sock"
    assert wait_for(sock_path.exists, 60), d.output()  # bound before the store is built
    # a client with a short timeout is told the daemon is starting, not left to time out
    with KVStoreClient(d.endpoint, model=MODEL, layout=LAYOUT, timeout=0.3, retries=0) as quick:
        with pytest.raises(DaemonStarting, match="still starting") as e:
            quick.ping()
        assert "starting" in e.value.code
    # one with a longer timeout waits through the start and gets its answer
    with KVStoreClient(d.endpoint, model=MODEL, layout=LAYOUT, timeout=60, retries=0) as c:
        tokens = list(range(4 * T))
        assert c.lookup(tokens).matched_tokens == 0
        assert c.ping()["pid"] == d.proc.pid
    log = d.output()
    assert re.search(
        r"starting \(pid \d+\) on ipc://.*: allocating hbm 1\.0 GiB on cpu, ram 1\.0 GiB", log
    ), log
    assert "no blocks to read back from" in log and re.search(r"store ready after [\d.]+ s", log), log
    assert d.stop() == 0


@pytest.mark.slow
def test_a_restart_says_how_many_blocks_it_reads_back(start_daemon, tmp_path: Path) -> None:
    import torch

    d = start_daemon()
    tokens = list(range(1000, 1000 + 12 * T))
    with KVStoreClient(d.endpoint, model=MODEL, layout=LAYOUT, timeout=10) as c:
        kv = torch.randn(LAYOUT.shape(len(tokens))).to(torch.float16)
        assert c.put(tokens, kv).stored == 12
        assert c.flush()
    assert d.stop() == 0
    again = start_daemon()
    assert f"reading back 12 blocks from {tmp_path / 'nvme'}" in again.output(), again.output()
    assert again.stop() == 0


@pytest.mark.slow
def test_a_stop_during_start_up_waits_for_the_store_and_exits_cleanly(start_daemon, tmp_path: Path) -> None:
    d = start_daemon(slow_config(tmp_path), ready=False)
    assert wait_for(lambda: "starting (pid" in d.output(), 60), d.output()
    assert d.stop() == 0, d.output()
    assert not (tmp_path / "run" / "kv.sock").exists()


# ---- paths the daemon cannot use: one line naming the setting, never a traceback ----

LOOK_INTO = """
import logging, os, sys
from pathlib import Path
from kvstore.daemon.startup import stored_blocks
logging.basicConfig(level=logging.WARNING, format="%(message)s")
if os.getuid() == 0:  # root enters any directory: look as nobody
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
print(stored_blocks(Path(sys.argv[1])))
"""


def test_the_blocks_of_a_store_the_daemon_may_not_enter_are_unknown_not_a_crash(tmp_path: Path) -> None:
    import subprocess
    import sys

    # Path.exists raises PermissionError (it is False only for a path that is not there)
    store = tmp_path / "nvme"
    store.mkdir()
    (store / "data.mdb").write_bytes(b"")
    store.chmod(0)
    try:
        p = subprocess.run(
            [sys.executable, "-c", LOOK_INTO, str(store)], capture_output=True, text=True, timeout=60
        )
    finally:
        store.chmod(0o700)
    assert p.returncode == 0 and p.stdout.strip() == "None", p.stderr
    assert f"cannot look into {store}: Permission denied" in p.stderr and "[nvme] path" in p.stderr


def test_an_nvme_path_that_is_a_file_is_not_called_a_new_store(tmp_path: Path) -> None:
    # the store's opening refuses it with the reason; "no blocks to read back (a new store)" would mislead
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    assert stored_blocks(afile) is None
    assert stored_blocks(tmp_path / "absent") == 0 and stored_blocks(tmp_path) == 0


@pytest.mark.slow
def test_an_nvme_path_that_cannot_be_looked_into_is_refused_in_one_line(start_daemon, tmp_path: Path) -> None:
    nvme = tmp_path / ("x" * 300) / "nvme"  # a name over NAME_MAX: Path.exists raises ENAMETOOLONG
    d = start_daemon(nvme=nvme, ready=False)
    assert d.wait_exit(90) == 1, d.output()
    log = d.output()
    assert "Traceback" not in log, log
    assert re.search(
        r"refusing to start: nvme store .* cannot be opened: File name too long; .*\[nvme\] path", log
    )


@pytest.mark.slow
def test_a_shm_dir_that_cannot_be_made_is_named_in_the_refusal(start_daemon, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    d = start_daemon(shm_dir=str(tmp_path / "a-file" / "shm"), ready=False)
    assert d.wait_exit(90) == 1, d.output()
    log = d.output()
    assert "Traceback" not in log, log
    assert f"refusing to start: Not a directory: {tmp_path}/a-file/shm; check [server] shm_dir" in log, log
    assert "[nvme] path" not in log


def test_a_command_run_while_the_daemon_starts_says_so_in_one_line(tmp_path: Path, capsys) -> None:
    """A daemon answering "starting" past the command's --timeout: one line naming --timeout, and no
    hint to start a daemon that is running."""
    from tests.hardening.conftest import RefusingDaemon

    endpoint = f"ipc://{tmp_path}/kv.sock"
    starting = RefusingDaemon(
        endpoint, "starting", "the daemon is starting (allocating the pools, 3 s so far); retry shortly"
    )
    try:
        assert cli_main(["stats", "--endpoint", endpoint, "--timeout", "300ms"]) == 2
    finally:
        starting.close()
    err = capsys.readouterr().err
    assert "still starting" in err and "--timeout" in err and "kvstore serve" not in err, err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    "extra, complaint",
    [
        ("[cluster]\nenabled = true\n", "give at least one seed node"),
        (
            '[cluster]\nenabled = true\nnodes = ["redis://127.0.0.1:1"]\npassword_env = "KVSTORE_TEST_UNSET"\n',
            "that environment variable is not set",
        ),
    ],
)
def test_a_config_the_daemon_cannot_serve_is_refused_before_anything_is_allocated(
    start_daemon, tmp_path: Path, extra: str, complaint: str
) -> None:
    """Exit 2, a bad config, as `kvstore serve` says for one, and before the pools are allocated (it
    came after them, with exit 1)."""
    config = write_config(tmp_path)
    config.write_text(config.read_text() + extra)
    d = start_daemon(config, ready=False)
    assert d.wait_exit(60) == 2, d.output()
    log = d.output()
    assert complaint in log and "allocating" not in log and "Traceback" not in log, log


def test_pools_smaller_than_a_page_are_refused_as_a_bad_config(start_daemon, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    config.write_text(
        config.read_text().replace(
            '[hbm]\ndevice = "cpu"\ncapacity = "16MiB"', '[hbm]\ndevice = "cpu"\ncapacity = 1000'
        )
    )
    d = start_daemon(config, ready=False)
    assert d.wait_exit(60) == 2, d.output()
    assert "less than one page" in d.output()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_an_hbm_device_this_host_lacks_is_refused_in_one_line(start_daemon, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace('device = "cpu"', 'device = "cuda:0"'))
    d = start_daemon(config, ready=False)
    assert d.wait_exit(90) == 1, d.output()
    log = d.output()
    assert "Traceback" not in log, log
    assert "refusing to start" in log and "device 'cuda:0' needs CUDA" in log, log
