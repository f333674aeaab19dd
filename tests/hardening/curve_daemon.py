"""A CURVE daemon on 127.0.0.1 for the auth and tenant tests: keys made by keygen, an allow-list, clients.

Keys: ``server``; ``alice`` and ``bob`` (tenants of those names); ``operator``
(tenant ``*``); ``stranger`` (made, never listed).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.daemon.auth import KeyFiles, write_keypair
from tests.daemon.conftest import Daemon
from tests.hardening.conftest import LAYOUT, MODEL, write_config

LISTED = {"alice": "alice", "bob": "bob", "operator": "*"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class CurveDaemon:
    daemon: Daemon
    endpoint: str
    keys: dict[str, KeyFiles]

    def client(
        self,
        who: str,
        tenant: str | None = None,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        namespace: bool = True,
        model: str = MODEL,
    ) -> KVStoreClient:
        """A client with ``who``'s key pair (files), in ``tenant`` (default: ``who``'s listed tenant)."""
        ns: dict[str, Any] = (
            {"model": model, "layout": LAYOUT, "tenant": tenant or LISTED.get(who, who)} if namespace else {}
        )
        return KVStoreClient(
            self.endpoint,
            timeout=timeout,
            retries=retries,
            curve_server_key=str(self.keys["server"].public_file),
            curve_secret_key=str(self.keys[who].secret_file),
            **ns,
        )


def make_keys(root: Path) -> dict[str, KeyFiles]:
    return {name: write_keypair(root / "keys", name) for name in ("server", *LISTED, "stranger")}


def start_curve_daemon(
    root: Path, keys: dict[str, KeyFiles] | None = None, server: dict[str, Any] | None = None
) -> CurveDaemon:
    """Start a daemon serving tcp://127.0.0.1:<free port> with CURVE and wait until the operator key gets a pong.

    ``server``: more [server] keys."""
    keys = keys or make_keys(root)
    allowed = root / "clients.allow"
    allowed.write_text(
        "# public key, tenant\n" + "".join(f"{keys[k].public_key} {t}\n" for k, t in LISTED.items())
    )
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        root,
        server={
            "endpoint": endpoint,
            "curve_secret_key": str(keys["server"].secret_file),
            "curve_allowed_keys": str(allowed),
            "log_level": "debug",
            **(server or {}),
        },
    )
    cd = CurveDaemon(Daemon(config, endpoint), endpoint, keys)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if cd.daemon.proc.poll() is not None:
            raise AssertionError(f"daemon exited {cd.daemon.proc.returncode}:\n{cd.daemon.output()}")
        try:
            with cd.client("operator", timeout=0.3, retries=0, namespace=False) as c:
                c.ping()
            return cd
        except TimeoutError:
            time.sleep(0.1)
    cd.daemon.proc.kill()
    raise AssertionError(f"CURVE daemon not ready after 90s:\n{cd.daemon.output()}")
