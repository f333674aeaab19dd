"""A client dropped without close() must not hang the process that drops it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import gc
from kvstore.client import KVStoreClient
clients = []
for _ in range(20):
    c = KVStoreClient("ipc:///nonexistent/kvstore.sock", timeout=0.2, retries=0)
    c._conn._open()  # its socket exists, as after any call
    c.cycle = c  # never closed, and in a reference cycle (as an engine connector's clients can be)
    clients.append(c)
del c, clients
gc.collect()
print("collected", flush=True)
"""


def test_clients_collected_unclosed_let_go_of_their_sockets_and_the_process_goes_on() -> None:
    # pyzmq collects a context in the same cycle as its socket by ending the context first, which
    # waits for ever for the socket to close
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "collected" in p.stdout, p.stderr
