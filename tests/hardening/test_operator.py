"""Operator mistakes: each is refused safely, with one clear line and no traceback.

A refusal is: exit status 1, nothing served, the store on disk untouched, and
on stderr one ``ERROR`` line naming the thing at fault (and no traceback).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvstore.tiers.lmdb_env import DB_NAMES
from tests.hardening.conftest import client, fill, mounted, prefix_kv, random_tokens, write_config


def refused(config: Path, *names: str) -> str:
    """Run a daemon on ``config``; it must refuse with one ERROR line containing every one of ``names``."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_CONFIG"}
    p = subprocess.run(
        [sys.executable, "-m", "kvstore.daemon", "--config", str(config)],
        capture_output=True,
        timeout=120,
        env=env,
    )
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 1, f"exit {p.returncode}:\n{err}"
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1, err
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


@pytest.mark.slow
def test_two_daemons_on_one_lmdb_path(daemons, tmp_path: Path) -> None:
    first = daemons(write_config(tmp_path))
    # the second has its own socket but the same [nvme] path
    second = write_config(
        tmp_path, "second.toml", server={"endpoint": f"ipc://{tmp_path / 'run2' / 's.sock'}"}
    )
    line = refused(second, str(tmp_path / "nvme"), f"pid {first.proc.pid}")
    assert "in use" in line
    with client(first.endpoint) as c:  # the first one never noticed
        assert c.ping()["pid"] == first.proc.pid


def test_an_nvme_path_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    cfg = write_config(tmp_path, nvme={"path": str(tmp_path / "afile" / "nvme")})
    refused(cfg, str(tmp_path / "afile" / "nvme"), "Not a directory")


def test_a_socket_path_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    cfg = write_config(tmp_path, server={"endpoint": f"ipc://{tmp_path / 'afile' / 'run' / 'kv.sock'}"})
    refused(cfg, str(tmp_path / "afile" / "run"), "Not a directory")


def test_an_unwritable_nvme_path(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    with mounted(ro, "ro", "size=1m") as ok:
        if not ok:  # not root: a directory without write permission does the same
            ro.chmod(0o500)
        cfg = write_config(tmp_path, nvme={"path": str(ro / "nvme")})
        refused(cfg, str(ro / "nvme"))
        if not ok:
            ro.chmod(0o700)


def test_a_data_file_that_is_not_lmdb(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "data.mdb").write_bytes(os.urandom(64 * 1024))
    refused(write_config(tmp_path), str(tmp_path / "nvme"), "not a kvstore nvme store")
    assert (tmp_path / "nvme" / "data.mdb").stat().st_size == 64 * 1024  # left as it was


def test_an_lmdb_of_another_program(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data", db=env.open_db(b"users", txn=txn))
    env.close()
    refused(write_config(tmp_path), str(tmp_path / "nvme"), "not a kvstore nvme store")


@pytest.mark.slow
def test_a_store_of_another_format_version(daemons, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    d = daemons(cfg)
    with client(d.endpoint) as c:
        import numpy as np

        tokens = random_tokens(np.random.default_rng(1), 4)
        c.put(tokens, prefix_kv(tokens))
    assert d.stop() == 0
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=len(DB_NAMES))
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    line = refused(cfg, str(tmp_path / "nvme"), "format version 99")
    assert "delete this one" in line or "another directory" in line


def test_an_nvme_path_on_a_full_disk(tmp_path: Path) -> None:
    fs = tmp_path / "fs"
    with mounted(fs, "size=2m") as ok:
        if not ok:
            pytest.skip("needs root to mount a small tmpfs")
        fill(fs)
        cfg = write_config(tmp_path, nvme={"path": str(fs / "nvme")})
        # not a SIGBUS from LMDB's mapped lock file: a refusal naming the path and the cause
        line = refused(cfg, str(fs / "nvme"))
        assert "free" in line or "space" in line


def test_a_capacity_larger_than_memory(tmp_path: Path) -> None:
    # 100 TiB of host RAM: the pool cannot be allocated, and the line says which capacity to lower
    refused(write_config(tmp_path, ram={"capacity": "100TiB"}), "cannot be allocated", "capacity")
