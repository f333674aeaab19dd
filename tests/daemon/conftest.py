"""A real daemon process for the end-to-end tests: ``python -m kvstore.daemon --config FILE``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest
import zmq

from kvstore.daemon.endpoint import probe
from kvstore.layout import KVLayout

# A value of the config's [server] table: write_config renders strings quoted, the rest bare.
ServerValue = str | int | float | bool

# Small blocks keep the tests fast; float16 so the hbm tier's copies are exact.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
MODEL = "test-model"


def write_config(
    root: Path, *, endpoint: str | None = None, nvme: Path | None = None, **server: ServerValue
) -> Path:
    """A TOML config under ``root``: ipc socket in root/run, LMDB in root/nvme, roomy hbm (exact copies)."""
    endpoint = endpoint or f"ipc://{root / 'run' / 'kv.sock'}"
    lines = ["[server]", f'endpoint = "{endpoint}"', "workers = 2", 'log_level = "debug"']
    lines += [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {str(v).lower()}" for k, v in server.items()]
    lines += [
        "[hbm]",
        'device = "cpu"',
        'capacity = "16MiB"',
        "[ram]",
        'capacity = "16MiB"',
        "[nvme]",
        f'path = "{nvme or root / "nvme"}"',
        'capacity = "64MiB"',
        "[policy]",
        'page_bytes = "4KiB"',
    ]
    path = root / "kvstore.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    """One daemon subprocess; ``stop`` sends a signal and returns the exit code."""

    def __init__(self, config: Path, endpoint: str) -> None:
        self.config = config
        self.endpoint = endpoint
        self.log = config.with_suffix(f".{time.monotonic_ns()}.log")
        self._log_file = self.log.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KVSTORE_CONFIG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.daemon", "--config", str(config)],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, timeout: float = 90.0) -> Daemon:
        ctx = zmq.Context()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.output()}")
                if probe(ctx, self.endpoint, timeout_ms=200) is not None:
                    return self
                time.sleep(0.1)
        finally:
            ctx.destroy(linger=0)
        raise AssertionError(f"daemon not ready after {timeout}s:\n{self.output()}")

    def wait_exit(self, timeout: float = 90.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log_file.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit(timeout)

    def output(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")


class StartDaemon(Protocol):
    """The ``start_daemon`` fixture: a daemon on ``config`` (by default one written under tmp_path)."""

    def __call__(
        self,
        config: Path | None = None,
        *,
        endpoint: str | None = None,
        nvme: Path | None = None,
        ready: bool = True,
        **server: ServerValue,
    ) -> Daemon: ...


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[StartDaemon]:
    """Start daemons on demand; any still running at the end are killed."""
    started: list[Daemon] = []

    def start(
        config: Path | None = None,
        *,
        endpoint: str | None = None,
        nvme: Path | None = None,
        ready: bool = True,
        **server: ServerValue,
    ) -> Daemon:
        """``nvme`` and ``server`` go to write_config: they apply only without ``config``."""
        if config is None:
            config = write_config(tmp_path, endpoint=endpoint, nvme=nvme, **server)
        endpoint = endpoint or f"ipc://{tmp_path / 'run' / 'kv.sock'}"
        d = Daemon(config, endpoint)
        started.append(d)
        return d.wait_ready() if ready else d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.wait_exit()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that do not restart it (max_message_bytes 64KiB to test limits)."""
    root = tmp_path_factory.mktemp("daemon")
    d = Daemon(
        write_config(root, max_message_bytes="64KiB", max_tokens_per_request=4096),
        f"ipc://{root / 'run' / 'kv.sock'}",
    )
    try:
        yield d.wait_ready()
    finally:
        assert d.stop() == 0, d.output()
