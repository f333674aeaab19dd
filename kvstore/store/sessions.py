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

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvstore.results import InvalidRequest

# A session name as a client gives it, in UTF-8 bytes (the wire refuses longer ones).
MAX_SESSION_BYTES = 200
# As the store keeps it: a confined tenant's names carry "<tenant>/" (tenants are at most 256 bytes),
# and the name is an LMDB key in the sessions db, where keys stop at 511 bytes.
MAX_STORED_SESSION_BYTES = 480


def check_session_name(name: object, limit: int = MAX_STORED_SESSION_BYTES) -> str:
    """``name`` if it is a usable session name; InvalidRequest saying why otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"a session name must be a non-empty string, got {name!r:.60}")
    n = len(name.encode("utf-8", errors="surrogatepass"))
    if n > limit:
        raise InvalidRequest(
            f"session name of {n} bytes is longer than {limit} bytes (UTF-8): {name[:40]!r}..."
        )
    if any(c in name for c in "\x00\n\r"):
        raise InvalidRequest(f"session name {name[:40]!r} holds a NUL or line break")
    return name


@dataclass(frozen=True)
class SessionState:
    """``before``/``before_tokens``: the tail the session had before its last put moved it, kept in
    its row: the row is journalled ahead of that put's blocks, and a crash between the two leaves a
    tail that is not on disk, where the one before it (made durable by a flush) may be."""

    name: str
    namespace: str
    tail: bytes | None
    tokens: int
    created: float
    last_access: float
    before: bytes | None = None
    before_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = {
            "ns": self.namespace,
            "tail": self.tail,
            "tokens": self.tokens,
            "created": self.created,
            "last_access": self.last_access,
        }
        if self.before is not None:
            d["before"], d["before_tokens"] = self.before, self.before_tokens
        return d

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> SessionState:
        tail, before = d.get("tail"), d.get("before")
        return cls(
            name=name,
            namespace=str(d["ns"]),
            tail=None if tail is None else bytes(tail),
            tokens=int(d["tokens"]),
            created=float(d["created"]),
            last_access=float(d["last_access"]),
            before=None if before is None else bytes(before),
            before_tokens=int(d.get("before_tokens", 0)),
        )


class SessionTable:
    """Sessions by name, and by tail key (to follow tails when blocks go)."""

    def __init__(self) -> None:
        self._by_name: dict[str, SessionState] = {}
        self._by_tail: dict[bytes, set[str]] = {}
        self._by_ns: dict[str, set[str]] = {}  # namespace id -> names: a tenant's sessions without a scan

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> SessionState | None:
        return self._by_name.get(name)

    def all(self) -> list[SessionState]:
        return sorted(self._by_name.values(), key=lambda s: s.name)

    def in_namespaces(self, ns_ids: Iterable[str]) -> list[SessionState]:
        """The sessions of the namespaces ``ns_ids``, by name (O(their sessions), not of all)."""
        names = [n for ns in ns_ids for n in self._by_ns.get(ns, ())]
        return sorted((self._by_name[n] for n in names), key=lambda s: s.name)

    def count_by_namespace(self) -> dict[str, int]:
        return {ns: len(names) for ns, names in self._by_ns.items()}

    def set(self, state: SessionState) -> SessionState:
        """Add or replace a session."""
        old = self._by_name.get(state.name)
        if old is not None:
            self._forget(old)
        self._by_name[state.name] = state
        self._by_ns.setdefault(state.namespace, set()).add(state.name)
        if state.tail is not None:
            self._by_tail.setdefault(state.tail, set()).add(state.name)
        return state

    def record_put(self, name: str, namespace: str, tail: bytes, tokens: int, now: float) -> SessionState:
        """A put under ``name`` ended at block ``tail`` covering ``tokens``: that is the session's prefix now."""
        old = self._by_name.get(name)
        created = now if old is None else old.created
        before, before_tokens = (None, 0) if old is None else (old.before, old.before_tokens)
        if old is not None and old.tail is not None and old.tail != tail:
            before, before_tokens = old.tail, old.tokens
        return self.set(SessionState(name, namespace, tail, tokens, created, now, before, before_tokens))

    def touch(self, name: str, now: float) -> SessionState | None:
        old = self._by_name.get(name)
        return None if old is None else self.set(replace(old, last_access=now))

    def ending_at(self, key: bytes) -> frozenset[str]:
        """The sessions whose tail is block ``key``."""
        return frozenset(self._by_tail.get(key, ()))

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
        self._forget(old)
        return True

    def _forget(self, old: SessionState) -> None:
        if old.tail is not None:
            self._unlink(old.tail, old.name)
        names = self._by_ns.get(old.namespace)
        if names is not None:
            names.discard(old.name)
            if not names:
                del self._by_ns[old.namespace]

    def _unlink(self, tail: bytes, name: str) -> None:
        names = self._by_tail.get(tail)
        if names is not None:
            names.discard(name)
            if not names:
                del self._by_tail[tail]
