"""How the CLI tests run ``kvstore``: a parse that must fail, the command as a subprocess, and a
real daemon of a test's own (small tiers, its own socket and LMDB).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.cli.parser import parse_args


def kvstore_cmd() -> list[str]:
    script = Path(sys.executable).parent / "kvstore"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvstore.cli"]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


def run_cli(*argv: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvstore_cmd(), *argv], input=stdin, capture_output=True, text=True, env=clean_env(), timeout=timeout
    )


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


LAYOUT_SPEC = "L=2,H=1,D=8,dtype=float16,T=4"


def write_daemon_config(root: Path, **server: object) -> Path:
    """A config of small tiers, with its own socket and LMDB under ``root``."""
    extra = "".join(f"{k} = {v}\n" for k, v in server.items())
    cfg = root / "kvstore.toml"
    cfg.write_text(
        f'[server]\nendpoint = "ipc://{root}/run/kv.sock"\nworkers = 2\n{extra}'
        '[hbm]\ndevice = "cpu"\ncapacity = "8MiB"\n[ram]\ncapacity = "8MiB"\n'
        f'[nvme]\npath = "{root}/nvme"\ncapacity = "64MiB"\n[policy]\npage_bytes = "4KiB"\n'
    )
    return cfg


def serve(cfg: Path) -> subprocess.Popen[str]:
    """``kvstore serve --config cfg``, returned once it answers a ping."""
    import zmq

    from kvstore.config import load_config
    from kvstore.daemon.endpoint import probe

    endpoint = load_config(cfg, env={}).server.endpoint
    proc = subprocess.Popen(
        [*kvstore_cmd(), "serve", "--config", str(cfg)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + 120
        while probe(ctx, endpoint, timeout_ms=200) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"daemon did not start: {proc.communicate()[0]}")
            time.sleep(0.1)
    finally:
        ctx.destroy(linger=0)
    return proc


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, as an operator (or systemd) would; the daemon must flush and exit 0. Returns its output."""
    proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, out
    return out
