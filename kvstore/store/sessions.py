"""Sessions: a name a client tags its puts with (a conversation), and the prefix it last stored.

A session remembers its namespace, the key of the last block put under it
(the *tail*: the chain from the root to the tail is the conversation so
far), the tokens that chain covers, and when it was created and last used.
When the tail block goes (eviction), the tail moves up to its parent, so a
session always names the longest prefix of its own that is still cached.
The store persists every change in the nvme sessions table.

Sessions are bounded, since a client invents their names:

- a session none of whose blocks is left (block 0 of its chain went) is dead.
  It stays listed (``inspect`` shows it with no blocks) until MAX_DEAD_SESSIONS
  others died after it, its tenant needs room, or the store restarts; then it
  is forgotten, row and all. A session whose blocks are held is kept, across
  restarts, however long it is idle (its conversation can go on a day later);
- a tenant keeps at most MAX_SESSIONS_PER_TENANT sessions: a put that starts
  one more forgets one of the tenant's dead sessions, or else its least
  recently used one (whose blocks stay, found by their tokens as ever; only
  the name goes). A put never fails because of sessions.

Not thread-safe: the store holds its lock around every call.
"""

from __future__ import annotations

import math
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvstore.keys import KEY_BYTES
from kvstore.results import InvalidRequest

# A session name as a client gives it, in UTF-8 bytes (the wire refuses longer ones).
MAX_SESSION_BYTES = 200
# As the store keeps it: a confined tenant's names carry "<tenant>/" (tenants are at most 256 bytes),
# and the name is an LMDB key in the sessions db, where keys stop at 511 bytes.
MAX_STORED_SESSION_BYTES = 480
# Sessions one tenant keeps (a put past it forgets the tenant's least recently used one). Each costs
# about 0.5 KiB of memory and a row on nvme; 4096 is far more conversations than one engine keeps
# cached, and at most MAX_NAMESPACES (the wire's) tenants exist, so the total is bounded too.
MAX_SESSIONS_PER_TENANT = 4096
# Dead sessions (no block left) kept listed, all tenants together; past it the longest dead go.
MAX_DEAD_SESSIONS = 16384
# Characters a new session name must not hold: control (Cc: C0, DEL, C1) and format (Cf: bidi
# overrides, zero-width spaces) characters, and line/paragraph separators. Names are printed to
# operators' terminals. The zero-width non-joiner and joiner are ordinary text (Persian words, emoji
# sequences) and pass.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
_ALLOWED = frozenset("\u200c\u200d")


def check_session_name(
    name: object, limit: int = MAX_STORED_SESSION_BYTES, *, allow_control: bool = False
) -> str:
    """``name`` if it is a usable session name; InvalidRequest saying why otherwise.

    ``allow_control``: to name a session stored by an earlier build, which let control characters
    (but NUL and line breaks) into names; a new session's name never holds one."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"a session name must be a non-empty string, got {name!r:.60}")
    n = len(name.encode("utf-8", errors="surrogatepass"))
    if n > limit:
        raise InvalidRequest(
            f"session name of {n} bytes is longer than {limit} bytes (UTF-8): {name[:40]!r}..."
        )
    if any(c in name for c in "\x00\n\r"):
        raise InvalidRequest(f"session name {name[:40]!r} holds a NUL or line break")
    if not allow_control:
        bad = next(
            (c for c in name if unicodedata.category(c) in _REFUSED_CATEGORIES and c not in _ALLOWED), None
        )
        if bad is not None:
            raise InvalidRequest(
                f"session name {name[:40]!r} holds the control character U+{ord(bad):04X}; "
                "use printable characters only"
            )
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
        """The state a row holds; ValueError naming the field for any field missing or of another
        type (a damaged row is skipped, never taken as far as it goes: ``bytes(n)`` of a number n is
        n zero bytes)."""
        if not isinstance(d, dict):
            raise ValueError(f"the row is {type(d).__name__}, not a map")
        return cls(
            name=name,
            namespace=_field(d, "ns", str),
            tail=_key(d, "tail"),
            tokens=_field(d, "tokens", int),
            created=float(_field(d, "created", (int, float))),
            last_access=float(_field(d, "last_access", (int, float))),
            before=_key(d, "before"),
            before_tokens=_field(d, "before_tokens", int, 0),
        )


_MISSING = object()


def _field(d: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    v = d.get(name, default)
    if v is _MISSING:
        raise ValueError(f"no {name!r}")
    if isinstance(v, bool) or not isinstance(v, kind) or (isinstance(v, float) and not math.isfinite(v)):
        raise ValueError(f"{name!r} is {v!r:.40}")
    if isinstance(v, int) and v < 0:
        raise ValueError(f"{name!r} is {v}")
    return v


def _key(d: dict[str, Any], name: str) -> bytes | None:
    v = d.get(name)
    if v is None:
        return None
    if not isinstance(v, (bytes, bytearray)) or len(v) != KEY_BYTES:
        raise ValueError(f"{name!r} is {v!r:.40}, not a block key")
    return bytes(v)


class SessionTable:
    """Sessions by name, by tail key (to follow tails when blocks go), and by tenant, least recently
    used first (to keep each tenant under its cap)."""

    def __init__(
        self,
        forget: Callable[[str], object] | None = None,
        tenant_of: Callable[[str], str] | None = None,
        *,
        per_tenant: int | None = None,
        max_dead: int | None = None,
    ) -> None:
        """``forget(name)``: called for each session the table drops by itself (dead, or past its
        tenant's cap), to remove its row. ``tenant_of(ns_id)``: the tenant a namespace's sessions
        count against (default: each namespace counts as one); asked when a session is set.
        ``per_tenant``, ``max_dead``: default MAX_SESSIONS_PER_TENANT and MAX_DEAD_SESSIONS."""
        per_tenant = MAX_SESSIONS_PER_TENANT if per_tenant is None else per_tenant
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be at least 1, got {per_tenant}")
        self._forget_row = forget
        self._tenant_of = tenant_of
        self._per_tenant = per_tenant
        self._max_dead = MAX_DEAD_SESSIONS if max_dead is None else max_dead
        self._by_name: dict[str, SessionState] = {}
        self._by_tail: dict[bytes, set[str]] = {}
        self._by_ns: dict[str, set[str]] = {}  # namespace id -> names: a tenant's sessions without a scan
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}  # least recently used first
        self._tenant: dict[str, str] = {}  # name -> the tenant it counts against
        self._dead: OrderedDict[str, None] = OrderedDict()  # sessions without a block, longest dead first
        self._dead_of: dict[str, OrderedDict[str, None]] = {}  # the same, by tenant
        self.dropped_dead = 0  # dead sessions forgotten (past MAX_DEAD_SESSIONS)
        self.dropped_idle = 0  # sessions forgotten to keep their tenant under its cap

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
        """Add or replace a session. A new one past its tenant's cap makes one of the tenant's dead
        sessions, or else its least recently used one, go; a dead one past MAX_DEAD_SESSIONS makes
        the longest dead go (``forget`` is called for each that goes). The one set now stays."""
        old = self._by_name.get(state.name)
        if old is not None:
            self._unlink_all(old)
        self._by_name[state.name] = state
        self._by_ns.setdefault(state.namespace, set()).add(state.name)
        if state.tail is not None:
            self._by_tail.setdefault(state.tail, set()).add(state.name)
        tenant = self._tenant_of(state.namespace) if self._tenant_of is not None else state.namespace
        before = self._tenant.get(state.name)
        if before != tenant:
            if before is not None:
                self._leave_tenant(state.name, before)
            self._tenant[state.name] = tenant
            self._by_tenant.setdefault(tenant, OrderedDict())[state.name] = None
        elif old is not None and state.last_access != old.last_access:
            self._by_tenant[tenant].move_to_end(state.name)
        if state.tail is not None:
            self._revive(state.name, before)
        elif state.name not in self._dead or before != tenant:
            self._revive(state.name, before)
            self._dead[state.name] = None
            self._dead_of.setdefault(tenant, OrderedDict())[state.name] = None
        self._trim(tenant, state.name)
        return state

    def record_put(
        self,
        name: str,
        namespace: str,
        tail: bytes,
        tokens: int,
        now: float,
        on_disk: Callable[[bytes], bool] | None = None,
    ) -> SessionState:
        """A put under ``name`` ended at block ``tail`` covering ``tokens``: that is the session's prefix now.

        The tail it had becomes ``before`` (where a crash before this put's blocks reach the disk
        leaves it) when ``on_disk`` says that block has a disk copy, or no ``before`` is kept yet;
        else ``before`` stays: a tail not on disk is no better after a crash than the new one, and
        two puts in a row before the disk caught up would lose the one that was."""
        old = self._by_name.get(name)
        created = now if old is None else old.created
        before, before_tokens = (None, 0) if old is None else (old.before, old.before_tokens)
        if old is not None and old.tail is not None and old.tail != tail:
            if before is None or on_disk is None or on_disk(old.tail):
                before, before_tokens = old.tail, old.tokens
        return self.set(SessionState(name, namespace, tail, tokens, created, now, before, before_tokens))

    def touch(self, name: str, now: float) -> SessionState | None:
        old = self._by_name.get(name)
        return None if old is None else self.set(replace(old, last_access=now))

    def ending_at(self, key: bytes) -> frozenset[str]:
        """The sessions whose tail is block ``key``."""
        return frozenset(self._by_tail.get(key, ()))

    def tail_gone(self, key: bytes, parent: bytes | None, block_tokens: int) -> list[SessionState]:
        """Block ``key`` left the store: sessions ending there now end at ``parent`` (None: nothing
        left, the session is dead). Returns the sessions changed (their rows need writing), not those
        that went meanwhile (MAX_DEAD_SESSIONS)."""
        changed = []
        for name in sorted(self._by_tail.get(key, ())):
            s = self._by_name.get(name)
            if s is not None:
                changed.append(self.set(replace(s, tail=parent, tokens=max(0, s.tokens - block_tokens))))
        return [s for s in changed if self._by_name.get(s.name) is s]

    def remove(self, name: str) -> bool:
        """Forget ``name`` (the caller removes its row); whether it was known."""
        old = self._by_name.pop(name, None)
        if old is None:
            return False
        self._unlink_all(old)
        tenant = self._tenant.pop(name, None)
        self._revive(name, tenant)
        if tenant is not None:
            self._leave_tenant(name, tenant)
        return True

    def dead(self) -> int:
        """Sessions none of whose blocks is left, still listed."""
        return len(self._dead)

    def _drop(self, name: str) -> None:
        """Forget ``name`` on the table's own account, row and all."""
        if self.remove(name) and self._forget_row is not None:
            self._forget_row(name)

    def _trim(self, tenant: str, keep: str) -> None:
        """Forget the longest dead sessions past MAX_DEAD_SESSIONS, then ``tenant``'s first (dead,
        then least recently used) sessions past its cap; never ``keep``."""
        while len(self._dead) > self._max_dead:
            name = next(iter(self._dead))
            if name == keep:
                self._dead.move_to_end(name)
                if len(self._dead) == 1:
                    break
                continue
            self._drop(name)
            self.dropped_dead += 1
        names = self._by_tenant.get(tenant)
        while names and len(names) > self._per_tenant:
            dead = self._dead_of.get(tenant)
            victim = next((n for n in (dead or ()) if n != keep), None)  # at most the first two
            if victim is None:
                victim = next(n for n in names if n != keep)  # the least recently used, or the next
            self._drop(victim)
            self.dropped_idle += 1

    def _revive(self, name: str, tenant: str | None) -> None:
        """``name`` is not dead (any more) as a session of ``tenant``."""
        if name not in self._dead:
            return
        del self._dead[name]
        if tenant is not None:
            dead = self._dead_of.get(tenant)
            if dead is not None:
                dead.pop(name, None)
                if not dead:
                    del self._dead_of[tenant]

    def _leave_tenant(self, name: str, tenant: str) -> None:
        names = self._by_tenant.get(tenant)
        if names is not None:
            names.pop(name, None)
            if not names:
                del self._by_tenant[tenant]

    def _unlink_all(self, old: SessionState) -> None:
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
