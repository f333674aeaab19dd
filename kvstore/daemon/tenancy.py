"""What a client authenticated as one tenant may see and do.

Over ipc (a socket in a directory only the daemon's user can enter) and over
plain tcp (``allow_insecure_tcp``: a network the operator trusts) every client
is trusted: the hello's tenant is taken as written, and evict, inspect, stats
and prefetch span every tenant. So does a CURVE key listed with tenant ``*``
(an operator key). A CURVE connection whose key the allow-list maps to tenant
T is confined to T, whatever its messages say::

    hello                     the namespace's tenant must be T, else error "forbidden"
    lookup get put pin,       only namespaces of T resolve: another tenant's ns id is answered
    inspect of tokens         "unknown_namespace", exactly as a namespace never registered
    session names             live in T's own space: stored as "T/name", shown to T as "name"; a
                              session a trusted client stored there for another tenant is not T's
    evict                     always AND tenant = T (--all: every block of T); a tenant filter
                              naming another tenant: "forbidden"
    inspect                   T's sessions only
    stats                     T's blocks and bytes per tier and T's sessions; no store-wide counters
    ping flush release        as for anyone (pin handles are random 63-bit numbers)
    any other op              "forbidden" until it is confined here (fail closed)

Another tenant's blocks have other keys (the tenant is hashed into every
key), so a lookup of tenant A's tokens by B walks B's own chain and misses on
the same code path as any miss: there is no hit to time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from kvstore.errors import Forbidden
from kvstore.keys import Namespace
from kvstore.results import SessionInfo
from kvstore.wire.errors import ProtocolError
from kvstore.wire.messages import (
    Commit,
    DataOk,
    ErrorReply,
    Evict,
    Finish,
    Flush,
    Get,
    Hello,
    Inspect,
    Locate,
    Lookup,
    Message,
    Pin,
    Ping,
    Prefetch,
    Put,
    Release,
    Reserve,
    Stats,
)

if TYPE_CHECKING:
    from kvstore.store.engine import Store

# ops a confined client may send; Evict, Inspect, Stats, Prefetch and Put are rewritten or answered below
CONFINED_OPS: frozenset[type[Message]] = frozenset(
    {Hello, Ping, Lookup, Get, Put, Pin, Release, Flush, Evict, Inspect, Stats, Prefetch}
)
SERVER_FIELDS = ("endpoint", "pid", "protocol", "uptime", "limits")  # server info a tenant may see
SHARED_OPS = (Locate, Finish, Reserve, Commit)  # the same-host data plane: ipc clients only


def qualify(tenant: str, session: str) -> str:
    """The store's name for ``tenant``'s session ``session``."""
    return f"{tenant}/{session}"


def unqualify(tenant: str, name: str) -> str | None:
    """``tenant``'s own name for the store's session ``name``; None when it is not one of ``tenant``'s."""
    prefix = f"{tenant}/"
    return name[len(prefix) :] if name.startswith(prefix) else None


def admit(msg: Message, namespace: Namespace | None, tenant: str) -> ErrorReply | None:
    """Why a request of a client confined to ``tenant`` must not run (an error reply), or None. No I/O."""
    if isinstance(msg, SHARED_OPS):  # a confined client is a tcp one
        return ErrorReply(
            code="no_shared_memory",
            message=f"{msg.op}: shared memory is for clients of the daemon's ipc socket; use get and put",
        )
    if type(msg) not in CONFINED_OPS:
        return ErrorReply(
            code="forbidden",
            message=f"{msg.op} is for operators; connect over the daemon's ipc "
            "socket or with an operator key (tenant * in curve_allowed_keys)",
        )
    if isinstance(msg, Hello) and msg.namespace.tenant != tenant:
        return ErrorReply(
            code="forbidden",
            message=f"this connection's CURVE key belongs to tenant {tenant!r} "
            f"(curve_allowed_keys); a hello for tenant {msg.namespace.tenant!r} is refused. Pass "
            f"tenant={tenant!r} to KVStoreClient",
        )
    if namespace is not None and namespace.tenant != tenant:
        # word for word what an unregistered namespace gets: whether another tenant uses it stays unknown
        return ErrorReply(
            code="unknown_namespace",
            message=f"namespace {namespace.id!r} is not registered; send hello first",
        )
    return None


class TenantOps:
    """Runs the requests of confined clients: rewrites their names and filters, answers inspect and stats."""

    def __init__(self, store: Store, server_info: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self.server_info = server_info

    def handle(
        self,
        msg: Message,
        ns: Namespace | None,
        tenant: str,
        run: Callable[[Message, Namespace | None], Message],
    ) -> Message:
        """The reply to ``msg`` from a client confined to ``tenant``; ``run`` is the unconfined handler.

        Raises Forbidden for an evict that names another tenant, ProtocolError
        (not_found) for a session of another tenant or of none.
        """
        if isinstance(msg, Stats):
            return DataOk(data=self.stats(tenant))
        if isinstance(msg, Inspect) and msg.tokens is None:
            if msg.session is None:
                return DataOk(data=[asdict(s) for s in self.sessions(tenant)])
            return DataOk(data=self.session(tenant, msg.session))
        if isinstance(msg, Evict):
            msg = confine_evict(msg, tenant)
        elif isinstance(msg, (Put, Prefetch)) and msg.session is not None:
            own, msg = msg.session, replace(msg, session=qualify(tenant, msg.session))
            if isinstance(msg, Prefetch):
                try:
                    # a name in T's space that a trusted client (ipc, an operator key) gave a session
                    # of another tenant: not T's, so not there, word for word as a session of none
                    if self.store.session_tenant(msg.session) not in (tenant, None):
                        raise ProtocolError("not_found", "")
                    reply = run(msg, ns)
                except ProtocolError as e:  # its message names the session as stored: the tenant's own name
                    if e.code != "not_found":
                        raise
                    raise ProtocolError("not_found", f"no session {own!r} to prefetch") from None
                if isinstance(reply, DataOk) and isinstance(reply.data, dict):
                    reply = DataOk(data={**reply.data, "session": own})
                return reply
        return run(msg, ns)

    def sessions(self, tenant: str) -> list[SessionInfo]:
        """``tenant``'s sessions under its own names."""
        out = []
        for s in self.store.sessions(tenant):
            name = unqualify(tenant, s.name)
            if name is not None:
                out.append(replace(s, name=name))
        return out

    def session(self, tenant: str, name: str) -> dict[str, Any]:
        """One of ``tenant``'s sessions (SessionDetail as a dict); not_found for any other."""
        try:
            detail = self.store.session(qualify(tenant, name))
        except KeyError:
            detail = None
        if detail is None or detail.info.tenant != tenant:
            raise ProtocolError("not_found", f"no session {name!r}; list them with inspect")
        return asdict(replace(detail, info=replace(detail.info, name=name)))

    def stats(self, tenant: str) -> dict[str, Any]:
        """``tenant``'s share of the store: blocks, bytes per tier, sessions; tier capacities (shared).

        From counters the store keeps per namespace (no walk over blocks): a tier's bytes are the
        tenant's blocks there times what a block of their layout takes in it (NamespaceUsage), so
        that nothing another tenant stores or evicts moves the figure.
        """
        mine = self.store.usage(tenant)
        totals = self.store.stats().tiers
        tiers = {}
        for name, t in totals.items():
            held = sum(u.tiers.get(name, 0) for u in mine)
            used = sum(u.tier_bytes.get(name, 0) for u in mine)
            tiers[name] = {"name": name, "used": used, "capacity": t.capacity, "blocks": held}
        blocks = sum(u.blocks for u in mine)
        sessions = sum(u.sessions for u in mine)
        info = self.server_info()
        return {
            "tenant": tenant,
            "store": {"tiers": tiers, "blocks": blocks, "sessions": sessions},
            "server": {k: info[k] for k in SERVER_FIELDS if k in info},
        }


def confine_evict(msg: Evict, tenant: str) -> Evict:
    """``msg`` limited to ``tenant``'s blocks and sessions; Forbidden when it names another tenant."""
    if msg.tenant is not None and msg.tenant != tenant:
        raise Forbidden(
            f"this connection belongs to tenant {tenant!r}; it cannot evict tenant {msg.tenant!r}'s "
            "blocks (an operator can, over the ipc socket)"
        )
    # all=True becomes "every block of tenant": the tenant criterion alone selects exactly those
    return replace(
        msg, tenant=tenant, all=False, session=None if msg.session is None else qualify(tenant, msg.session)
    )
