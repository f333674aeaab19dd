"""Shared pieces of the hardening tests: configs, real daemons, exact K/V, raw sockets, RSS.

Every tier here uses the raw codec (nvme: raw + zstd, still lossless), so a
block served is bit-exact what was put: any wrong byte is a test failure,
never "close enough".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from kvstore.client import KVStoreClient
from kvstore.config import Config, load_config
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.wire.messages import ErrorReply
from kvstore.wire.protocol import PROTOCOL_VERSION, encode, read_header
from tests.daemon.conftest import Daemon

# 1 KiB blocks: many of them fit small capacities, and tests stay fast.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)
MODEL = "hardening-model"
NS = Namespace(model=MODEL, layout=LAYOUT)
T = LAYOUT.block_tokens

DEFAULTS: dict[str, dict[str, Any]] = {
    "server": {"workers": 2, "log_level": "info"},
    "hbm": {"device": "cpu", "capacity": "256KiB"},
    "ram": {"capacity": "256KiB", "codec": "raw"},
    "nvme": {"capacity": "256MiB", "codec": "raw"},
    "policy": {"page_bytes": "1KiB"},
}


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(root: Path, name: str = "kvstore.toml", **sections: dict[str, Any]) -> Path:
    """A TOML config under ``root`` (ipc socket root/run/kv.sock, LMDB root/nvme) with ``sections``
    overriding DEFAULTS key by key."""
    merged = {s: dict(v) for s, v in DEFAULTS.items()}
    merged["server"]["endpoint"] = f"ipc://{root / 'run' / 'kv.sock'}"
    merged["nvme"]["path"] = str(root / "nvme")
    for s, v in sections.items():
        merged.setdefault(s, {}).update(v)
    lines: list[str] = []
    for s, v in merged.items():
        lines.append(f"[{s}]")
        lines += [f"{k} = {_toml(x)}" for k, x in v.items()]
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return path


def endpoint_of(config: Path) -> str:
    return load_config(config, env={}).server.endpoint


def loaded(config: Path) -> Config:
    return load_config(config, env={})


@pytest.fixture
def daemons() -> Iterator[Any]:
    """``daemons(config)`` starts a daemon and waits until it answers; any left running are killed."""
    started: list[Daemon] = []

    def start(config: Path, *, ready: bool = True) -> Daemon:
        d = Daemon(config, endpoint_of(config))
        started.append(d)
        return d.wait_ready() if ready else d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.wait_exit()


def client(endpoint: str, timeout: float = 10.0, retries: int = 2) -> KVStoreClient:
    return KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=timeout, retries=retries)


# ---------------------------------------------------------------- exact K/V


def block_kv(tokens: np.ndarray, i: int) -> torch.Tensor:
    """The K/V of block ``i`` of prefix ``tokens``: a function of the prefix up to that block, so two
    puts sharing a prefix agree on its blocks (as a model's K/V would)."""
    seed = zlib.crc32(np.ascontiguousarray(tokens[: (i + 1) * T], dtype="<u4").tobytes())
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(T), generator=g).to(torch.float16)


def prefix_kv(tokens: np.ndarray, blocks: int | None = None) -> torch.Tensor:
    n = len(tokens) // T if blocks is None else blocks
    return torch.cat([block_kv(tokens, i) for i in range(n)], dim=2)


def random_tokens(rng: np.random.Generator, blocks: int) -> np.ndarray:
    return rng.integers(0, 50000, size=blocks * T, dtype=np.uint32)


def assert_exact(tokens: np.ndarray, kv: torch.Tensor | None, matched_tokens: int) -> None:
    """What was served for ``tokens`` is bit-exact the K/V put for them (never a wrong block)."""
    if matched_tokens == 0:
        assert kv is None or kv.shape[2] == 0
        return
    assert kv is not None and kv.shape[2] == matched_tokens
    want = prefix_kv(tokens, matched_tokens // T)
    assert torch.equal(kv.view(torch.int16), want.view(torch.int16)), (
        "a served block differs from what was put"
    )


# ---------------------------------------------------------------- processes and sockets


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Raw:
    """A bare DEALER socket sending frames by hand (what no well-behaved client would send)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvhwm = self.sock.sndhwm = 0  # never drop: every reply is counted
        self.sock.connect(endpoint)

    def ask(self, *frames: Any, timeout_ms: int = 10000) -> dict[str, Any]:
        self.sock.send_multipart(list(frames))
        return self.recv(timeout_ms)

    def recv(self, timeout_ms: int = 10000) -> dict[str, Any]:
        assert self.sock.poll(timeout_ms), "no reply from the daemon"
        reply = self.sock.recv_multipart()
        got = msgpack.unpackb(reply[0], raw=False)
        assert isinstance(got, dict)
        return got

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def header(op: str, rid: int | None = 1, **fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields}, use_bin_type=True)


def stderr_of(proc: subprocess.Popen) -> str:
    return proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""


class Background:
    """Run ``fn(stop_event)`` on a thread; ``join`` re-raises what it raised."""

    def __init__(self, fn: Any) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None

        def run() -> None:
            try:
                self.result = fn(self.stop)
            except BaseException as e:  # noqa: B036 - handed to join()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 120.0) -> Any:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background work did not stop"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(cond: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


@contextlib.contextmanager
def mounted(where: Path, *options: str) -> Iterator[bool]:
    """A tmpfs at ``where`` (root only); yields False where mounting is not possible."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield False
        return
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True
        ).returncode
        != 0
    ):
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(fs: Path, leave: int = 0) -> Path:
    """Fill the filesystem at ``fs`` with a file until at most ``leave`` bytes are free; returns the file."""
    path = fs / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 16, 4096, 1):
            while True:
                st = os.statvfs(fs)
                if st.f_bavail * st.f_frsize <= leave:
                    return path
                try:
                    os.write(fd, b"\0" * chunk)
                except OSError:
                    break
    finally:
        os.close(fd)
    return path


class RefusingDaemon:
    """A ROUTER that answers every request with the error ``code`` (nothing done), counting them:
    ``busy`` (over a budget), ``starting`` (the store still being built)."""

    def __init__(
        self, endpoint: str, code: str = "busy", message: str = "injected: over the in-flight budget"
    ) -> None:
        self.code, self.message = code, message
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.sock.rcvtimeo = 100
        self.requests = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                peer, *frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            _, rid = read_header(frames[0], 1 << 20)
            self.requests += 1
            reply = ErrorReply(code=self.code, message=self.message)
            self.sock.send_multipart([peer, *encode(rid, reply)])

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()
