"""What a client sends, op by op (the shared-memory tests' witness of which path a call took)."""

from __future__ import annotations

import pytest

from kvstore.client import KVStoreClient
from kvstore.wire.messages import Message


def sent_ops(c: KVStoreClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ops ``c`` sends from now on, in order."""
    ops: list[str] = []
    send = c._conn._send

    def spy(msg: Message) -> int:
        ops.append(msg.op)
        return send(msg)

    monkeypatch.setattr(c._conn, "_send", spy)
    return ops
