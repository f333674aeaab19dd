"""The in-flight budget, as the daemon's loop charges and releases it: bytes per tenant and in all,
requests queued for workers, and one tenant's share of those."""

from __future__ import annotations

from kvstore.daemon.budget import InflightBudget


def test_a_tenant_flooding_the_workers_leaves_a_quarter_of_the_queue_to_the_others() -> None:
    b = InflightBudget(total=1 << 30, per_tenant=1 << 30, max_queued=8)
    mine = [b.take("a", 10) for _ in range(6)]  # three quarters of 8
    refused = b.refusal("a", 10)
    assert refused is not None and "'a' has 6 requests" in refused and "'b'" not in refused
    assert b.refusal("b", 10) is None  # another tenant is taken
    others = [b.take("b", 10) for _ in range(2)]
    assert b.refusal("c", 10) is not None  # the whole queue is full now
    b.release(mine.pop())
    assert b.refusal("a", 10) is None and b.refusal("c", 10) is None
    for c in [*mine, *others]:
        b.release(c)
    assert b.queued == 0 and b.held == 0 and b.of_tenant("a") == 0


def test_a_parked_reply_holds_its_bytes_and_no_worker_place() -> None:
    # a reply its client does not read: the worker queue is free of it, the byte budgets are not
    b = InflightBudget(total=100, per_tenant=100, max_queued=1)
    c = b.take("a", 80)
    b.park(c)
    assert b.queued == 0 and b.held == 80 and b.of_tenant("a") == 80
    assert b.refusal("b", 10) is None  # a request that fits is taken: the queue place is free
    assert b.refusal("a", 80) is not None and b.refusal("b", 80) is not None  # the bytes are not
    b.unpark(c)
    assert b.held == 0 and b.of_tenant("a") == 0 and b.refusal("a", 80) is None


def test_one_request_bigger_than_a_budget_goes_through_alone() -> None:
    b = InflightBudget(total=100, per_tenant=50, max_queued=4)
    assert b.refusal("a", 500) is None  # nothing charged: never refused for good
    c = b.take("a", 500)
    assert b.refusal("a", 1) is not None and b.refusal("b", 1) is not None
    b.release(c)
    assert b.refusal("b", 1) is None
