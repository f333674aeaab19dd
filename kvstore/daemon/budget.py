"""The memory the daemon lets requests hold between their arrival and their reply.

Every request handed to a worker is charged on the loop thread and released
when its reply leaves for its client's socket::

    put            its message bytes (the K/V payload, held until the store has copied it)
    get            its largest possible reply: the blocks it asks for x the layout's block bytes
    anything else  its message bytes (a header)

A request is taken when its charge fits in what is left of the daemon's
budget (``[server] max_inflight_bytes``) and of its tenant's
(``max_inflight_bytes_per_tenant``), and while fewer than
``max_queued_requests`` requests wait for or run on a worker, of which one
tenant holds at most TENANT_SHARE (the rest stays for the others: a tenant that
floods the workers with slow requests turns only itself away). A budget with
nothing charged to it takes any request, so one bigger than a budget still
goes through alone and nothing is refused for good: in flight stays within
max(budget, max_message_bytes). Otherwise the request is answered ``busy``
(the client backs off and sends it again); it is never dropped. A reply its client
does not read yet waits in the daemon (kvstore.daemon.outbox): it leaves the
worker queue then (``park``), so that unread replies hold no worker place, and
its bytes stay charged, to the daemon and its tenant, until it leaves
(``unpark``). A commit of
the same-host data plane is taken even so (its K/V is in staging, and the
next chunk's commit must not overtake it): kvstore.daemon.dispatch.

Not thread-safe: the loop thread alone charges and releases.
"""

from __future__ import annotations

from dataclasses import dataclass

TENANT_SHARE = 0.75  # of max_queued_requests one tenant's requests may hold


@dataclass(frozen=True)
class Charge:
    """What one request taken holds: ``nbytes`` against the daemon's budget and ``tenant``'s."""

    tenant: str
    nbytes: int


class InflightBudget:
    """Bytes and requests in flight, for the daemon and per tenant; see the module docstring."""

    def __init__(self, total: int, per_tenant: int, max_queued: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.max_queued = max_queued
        self.held = 0  # bytes charged, all tenants
        self.queued = 0  # requests charged
        self._tenants: dict[str, int] = {}
        self._queued_by: dict[str, int] = {}  # requests charged, per tenant

    def refusal(self, tenant: str, nbytes: int) -> str | None:
        """Why a request of ``nbytes`` from ``tenant`` must wait (a ``busy`` message), or None. Changes nothing.

        The message states the caller's own figures only, never another tenant's or the daemon's.
        """
        mine = self._tenants.get(tenant, 0)
        if mine and mine + nbytes > self.per_tenant:
            return (
                f"tenant {tenant!r} has {mine} bytes in requests not yet answered, and this one needs "
                f"{nbytes} more: over its budget of {self.per_tenant} ([server] "
                "max_inflight_bytes_per_tenant); wait for replies, then send it again"
            )
        queued = self._queued_by.get(tenant, 0)
        if queued and queued >= max(1, int(self.max_queued * TENANT_SHARE)):
            return (
                f"tenant {tenant!r} has {queued} requests waiting for or running on a worker, the most "
                "one tenant may ([server] max_queued_requests, of which a tenant takes three quarters); "
                "wait for replies, then send it again"
            )
        if self.queued >= self.max_queued or (self.held and self.held + nbytes > self.total):
            return "the daemon has as many requests in flight as it takes; send it again shortly"
        return None

    def take(self, tenant: str, nbytes: int) -> Charge:
        """Charge a request that ``refusal`` let through."""
        self.held += nbytes
        self.queued += 1
        self._queued_by[tenant] = self._queued_by.get(tenant, 0) + 1
        self._tenants[tenant] = self._tenants.get(tenant, 0) + nbytes
        return Charge(tenant, nbytes)

    def park(self, charge: Charge) -> None:
        """The request's work is done and its reply waits for its client: its queue place is free again,
        its bytes stay charged until ``unpark``."""
        self._unqueue(charge)

    def unpark(self, charge: Charge) -> None:
        """The parked reply has left (or its client is gone)."""
        self.held -= charge.nbytes
        self._untenant(charge)

    def release(self, charge: Charge) -> None:
        """The request's reply has left: its bytes are free again."""
        self.held -= charge.nbytes
        self._unqueue(charge)
        self._untenant(charge)

    def _unqueue(self, charge: Charge) -> None:
        self.queued -= 1
        left = self._queued_by[charge.tenant] - 1
        if left:
            self._queued_by[charge.tenant] = left
        else:
            del self._queued_by[charge.tenant]

    def _untenant(self, charge: Charge) -> None:
        left = self._tenants.get(charge.tenant, 0) - charge.nbytes
        if left > 0:
            self._tenants[charge.tenant] = left
        else:
            self._tenants.pop(charge.tenant, None)

    def of_tenant(self, tenant: str) -> int:
        """Bytes ``tenant``'s requests hold now."""
        return self._tenants.get(tenant, 0)
