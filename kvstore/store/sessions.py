"""Sessions: a name a client tags its puts with (a conversation), and the prefix it last stored.

A session remembers its namespace, the key of the last block put under it
(the *tail*: the chain from the root to the tail is the conversation so
far), the tokens that chain covers, and when it was created and last used.
When the tail block goes (eviction), the tail moves up to its parent, so a
session always names the longest prefix of its own that is still cached.
The store persists every change in the nvme sessions table.

Not thread-safe: the store holds its lock around every call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class SessionState:
    name: str
    namespace: str
    tail: bytes | None
    tokens: int
    created: float
    last_access: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "ns": self.namespace,
            "tail": self.tail,
            "tokens": self.tokens,
            "created": self.created,
            "last_access": self.last_access,
        }

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> SessionState:
        tail = d.get("tail")
        return cls(
            name=name,
            namespace=str(d["ns"]),
            tail=None if tail is None else bytes(tail),
            tokens=int(d["tokens"]),
            created=float(d["created"]),
            last_access=float(d["last_access"]),
        )


class SessionTable:
    """Sessions by name, and by tail key (to follow tails when blocks go)."""

    def __init__(self) -> None:
        self._by_name: dict[str, SessionState] = {}
        self._by_tail: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> SessionState | None:
        return self._by_name.get(name)

    def all(self) -> list[SessionState]:
        return sorted(self._by_name.values(), key=lambda s: s.name)

    def set(self, state: SessionState) -> SessionState:
        """Add or replace a session."""
        old = self._by_name.get(state.name)
        if old is not None and old.tail is not None:
            self._unlink(old.tail, old.name)
        self._by_name[state.name] = state
        if state.tail is not None:
            self._by_tail.setdefault(state.tail, set()).add(state.name)
        return state

    def record_put(self, name: str, namespace: str, tail: bytes, tokens: int, now: float) -> SessionState:
        """A put under ``name`` ended at block ``tail`` covering ``tokens``: that is the session's prefix now."""
        old = self._by_name.get(name)
        created = now if old is None else old.created
        return self.set(SessionState(name, namespace, tail, tokens, created, now))

    def touch(self, name: str, now: float) -> SessionState | None:
        old = self._by_name.get(name)
        return None if old is None else self.set(replace(old, last_access=now))

    def tail_gone(self, key: bytes, parent: bytes | None, block_tokens: int) -> list[SessionState]:
        """Block ``key`` left the store: sessions ending there now end at ``parent`` (None: nothing left)."""
        changed = []
        for name in sorted(self._by_tail.get(key, ())):
            s = self._by_name[name]
            changed.append(self.set(replace(s, tail=parent, tokens=max(0, s.tokens - block_tokens))))
        return changed

    def remove(self, name: str) -> bool:
        old = self._by_name.pop(name, None)
        if old is None:
            return False
        if old.tail is not None:
            self._unlink(old.tail, name)
        return True

    def _unlink(self, tail: bytes, name: str) -> None:
        names = self._by_tail.get(tail)
        if names is not None:
            names.discard(name)
            if not names:
                del self._by_tail[tail]
