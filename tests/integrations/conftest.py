"""A real ``kvstore serve`` subprocess per test, configured in tmp_path (ipc socket and LMDB under it).

``serve(**tiers)`` writes the config (once per test; a restart reuses it) and
starts the daemon; ``Served.restart(sig)`` stops it with ``sig`` (SIGTERM: a
clean stop that flushes; SIGKILL: nothing runs) and starts it again on the
same files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvstore.daemon.endpoint import probe


def kvstore_command() -> list[str]:
    """The ``kvstore`` console script of this interpreter's environment (``python -m kvstore.cli`` without it)."""
    script = Path(sys.executable).parent / "kvstore"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvstore.cli"]


class Served:
    """One daemon on ``config``; at most one process at a time."""

    def __init__(self, config: Path, endpoint: str) -> None:
        self.config = config
        self.endpoint = endpoint
        self.log = config.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> Served:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*kvstore_command(), "serve", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        ctx = zmq.Context()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.output()}")
                if probe(ctx, self.endpoint, timeout_ms=300) is not None:
                    return self
                time.sleep(0.1)
        finally:
            ctx.destroy(linger=0)
        raise AssertionError(f"daemon not ready after {timeout}s:\n{self.output()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Send ``sig`` and wait; the exit code (negative: killed by that signal)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def restart(self, sig: int = signal.SIGTERM) -> int:
        code = self.stop(sig)
        self.start()
        return code

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def write_config(
    root: Path,
    *,
    hbm: str = "4MiB",
    ram: str = "4MiB",
    ram_codec: str = "fp8",
    nvme_codec: str = "int4",
    nvme: str = "1GiB",
    max_tokens: str = "131072",
) -> tuple[Path, str]:
    """A TOML config under ``root`` (socket in root/run, LMDB in root/nvme); returns (path, endpoint)."""
    endpoint = f"ipc://{root / 'run' / 'kv.sock'}"
    path = root / "kvstore.toml"
    path.write_text(
        "\n".join(
            [
                "[server]",
                f'endpoint = "{endpoint}"',
                "workers = 2",
                f"max_tokens_per_request = {max_tokens}",
                "[hbm]",
                'device = "cpu"',
                f'capacity = "{hbm}"',
                "[ram]",
                f'capacity = "{ram}"',
                f'codec = "{ram_codec}"',
                "[nvme]",
                f'path = "{root / "nvme"}"',
                f'capacity = "{nvme}"',
                f'codec = "{nvme_codec}"',
                "[policy]",
                'page_bytes = "16KiB"',
            ]
        )
        + "\n"
    )
    return path, endpoint


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Start a daemon with the given tier settings (see write_config); killed at the end if still running."""
    started: list[Served] = []

    def start(**settings: str) -> Served:
        config, endpoint = write_config(tmp_path, **settings)
        d = Served(config, endpoint)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
