"""The daemon's namespace registry: what a hello registers, within its tenant's quota and the
daemon's table, and what an idle registration gives back.

    register(ns)      quota_exceeded (RemoteProtocolError) past the tenant's quota or the table
    get(id, tenant)   the namespace of a request; None for one not registered (or another tenant's)
    used(id, stores)  a request used it; one that stores (put, commit) keeps it for good

A registration no put went through, unused NAMESPACE_IDLE seconds, is given up when a hello finds the
table (or its tenant's quota) full: without CURVE a tenant is whatever a hello says, so hellos alone
could fill the table, and would lock real engines out for good. So is one a put went through whose
blocks are all gone (evicted, expired: ``holds`` says), unused as long: an engine that names its
weights anew at each weight sync registers namespaces without end, and the old ones empty out. A
client whose registration went says hello again on its next request (the reply "unknown_namespace"
asks it to; KVStoreClient does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvstore.keys import Namespace
from kvstore.wire.errors import RemoteProtocolError

MAX_NAMESPACES = 4096  # distinct namespaces one daemon registers; more is almost surely a bug
NAMESPACES_PER_TENANT = 256  # default share of MAX_NAMESPACES one tenant may register
NAMESPACE_IDLE = 300.0


class NamespaceRegistry:
    """Registered namespaces by id, counted per tenant. Not thread-safe (the protocol's loop owns it).
    ``clock``: seconds, for how long a registration has been idle."""

    def __init__(
        self, per_tenant: int, clock: Callable[[], float], holds: Callable[[str], bool] | None = None
    ) -> None:
        """``holds(ns_id)``: whether the store holds a block of the namespace (None: taken as yes,
        until the daemon's store is there and sets it)."""
        self.per_tenant = per_tenant
        self.holds = holds
        self._last: dict[str, float] = {}  # every registration -> when last used
        self.namespaces: dict[str, Namespace] = {}
        self._count: dict[str, int] = {}  # tenant -> namespaces registered
        # registrations no put or commit went through (they hold no block stored through them), by
        # when last used, oldest first: those that may be given up (_expire)
        self._idle: OrderedDict[str, float] = OrderedDict()
        self._clock = clock
        self.expired = 0  # registrations given up (NAMESPACE_IDLE)

    def register(self, ns: Namespace) -> None:
        """Register ``ns`` (again: it is used now). RemoteProtocolError ``quota_exceeded``, nothing
        registered, when ``ns.tenant`` has its quota or the table is full (idle ones given up first)."""
        if ns.id not in self.namespaces and (
            self._count.get(ns.tenant, 0) >= self.per_tenant or len(self.namespaces) >= MAX_NAMESPACES
        ):
            self._expire()
        if ns.id not in self.namespaces:
            # the tenant's quota first: its refusal tells the tenant only its own figures
            mine = self._count.get(ns.tenant, 0)
            if mine >= self.per_tenant:
                raise RemoteProtocolError(
                    "quota_exceeded",
                    f"tenant {ns.tenant!r} has registered {mine} namespaces, its quota "
                    f"([server] max_namespaces_per_tenant = {self.per_tenant}); use one of "
                    "them (the same model, revision and layout) or ask the operator for more",
                )
            if len(self.namespaces) >= MAX_NAMESPACES:
                raise RemoteProtocolError(
                    "quota_exceeded",
                    "the daemon's namespace table is full; a namespace that stored nothing and went "
                    f"unused for {NAMESPACE_IDLE:.0f} s makes room, so retry later, or ask the operator "
                    "to restart the daemon or to lower max_namespaces_per_tenant",
                )
            self._count[ns.tenant] = mine + 1
            self._idle[ns.id] = self._last[ns.id] = self._clock()
        else:
            self.used(ns.id, stores=False)
        self.namespaces[ns.id] = ns

    def get(self, ns_id: str, tenant: str | None = None) -> Namespace | None:
        """The namespace ``ns_id`` names; None when not registered, or another tenant's than
        ``tenant`` (a CURVE client's: it sees no other tenant's namespace, not even its layout)."""
        ns = self.namespaces.get(ns_id)
        return None if ns is None or (tenant is not None and ns.tenant != tenant) else ns

    def used(self, ns_id: str, *, stores: bool) -> None:
        """A request used ``ns_id``; one that ``stores`` blocks (put, commit) keeps it for good."""
        if ns_id in self.namespaces:
            self._last[ns_id] = self._clock()
        if stores:
            self._idle.pop(ns_id, None)  # it may hold blocks now: given up only once they are gone
        elif ns_id in self._idle:
            self._idle[ns_id] = self._clock()
            self._idle.move_to_end(ns_id)

    def _expire(self) -> None:
        """Give up the registrations no put went through that were unused for NAMESPACE_IDLE seconds
        (oldest first: O(those given up)), and those unused as long whose blocks are all gone
        (``holds``). Their clients' next requests are answered ``unknown_namespace``, and they say
        hello again."""
        now = self._clock()
        while self._idle:
            ns_id, used = next(iter(self._idle.items()))
            if now - used < NAMESPACE_IDLE:
                break
            del self._idle[ns_id]
            self._give_up(ns_id)
        holds = self.holds
        if holds is None:
            return
        # those a put went through: unused as long, and holding no block any more (O(registrations),
        # only when a hello finds the table or a quota full)
        for ns_id in [i for i in self.namespaces if i not in self._idle]:
            if now - self._last.get(ns_id, now) >= NAMESPACE_IDLE and not holds(ns_id):
                self._give_up(ns_id)

    def _give_up(self, ns_id: str) -> None:
        ns = self.namespaces.pop(ns_id)
        self._last.pop(ns_id, None)
        left = self._count.get(ns.tenant, 0) - 1
        if left > 0:
            self._count[ns.tenant] = left
        else:
            self._count.pop(ns.tenant, None)
        self.expired += 1
