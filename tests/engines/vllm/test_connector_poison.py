"""Blocks whose load failed and that nobody recomputes, under vLLM 0.33's real Scheduler with a real
daemon: the connector drops them from vLLM's prefix cache, and never saves what is computed over
them. See test_connector.py for the engine these tests step."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvstore.client import KVStoreClient
from tests.engines.vllm.test_connector import (
    Engine,
    assert_holds,
    check_client,
    operator,
    prompt,
    request,
    setup,  # noqa: F401  (a fixture)
    stored_then_forgotten,
)
from tests.hardening.conftest import wait_until


def half_stored_then_forgotten(U: Any, e: Engine, tokens: list[int]) -> KVStoreClient:
    """kvstore holds tokens [0, 64) of ``tokens`` plainly and [64, 128) under session "late" (so those
    can be evicted alone); vLLM's prefix cache holds nothing of them. Returns check_client(e)."""
    e.add(request(U, tokens[:64], "early"))
    e.run()
    late = request(U, tokens[:128], "late")
    late.kv_transfer_params = {"kvstore_session": "late"}
    e.add(late)  # [0, 64) from vLLM's prefix cache, [64, 128) computed and saved in the session
    e.run()
    check = check_client(e)
    assert wait_until(lambda: check.lookup(tokens).matched_tokens == 128, 10)
    assert e.sched.reset_prefix_cache()
    return check


def lose_the_loader(e: Engine, fate: str) -> None:
    """Once "again" has loaded, before vLLM has that step's output: abort it, or preempt it (what
    async scheduling does when step N+1 is scheduled before step N's output)."""
    from vllm.v1.request import RequestStatus

    def lose(meta: Any) -> None:
        if not any(t.req_id == "again" for t in meta.loads):
            return
        req = e.requests["again"]
        if fate == "aborted":
            e.sched.finish_requests("again", RequestStatus.FINISHED_ABORTED)
        else:
            e.sched.running.remove(req)
            e.sched._preempt_request(req, time.monotonic())

    e.before_output = lose


@pytest.mark.parametrize("fate", ["aborted", "preempted"])
def test_blocks_of_a_failed_load_nobody_recomputes_leave_vllms_prefix_cache(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    fate: str,
) -> None:
    """ "again" counts on kvstore for 128 tokens; [64, 128) are evicted before the load, so vLLM's
    blocks 4..7 are not loaded. The loader is aborted or preempted before vLLM hears of it: vLLM
    rolls back no request, and kept those blocks (and block 8, computed over them) in its prefix
    cache, where b took them and computed over garbage. The connector drops them from there (vLLM
    0.33 lends it the cache manager): b takes [0, 64) and computes the rest itself, right, and what
    it saves is what the model computes."""
    U, vcfg, ep = setup
    a = prompt(150, 31)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = half_stored_then_forgotten(U, e, a)
    with operator(ep) as op:
        e.before_load = lambda: op.evict(session="late")  # after the scheduler counted on them
        lose_the_loader(e, fate)
        e.add(request(U, a, "again", max_tokens=5))
        e.run()
        e.before_load = e.before_output = None
    assert e.worker.loads[0] == ("again", 0, 128)
    connector = e.sched.connector
    pool = e.sched.kv_cache_manager.block_pool
    gone = set(connector._poison.blocks)
    assert gone and not any(pool.blocks[b].block_hash for b in gone)  # out of the prefix cache

    b = a[:144] + prompt(40, 32)
    e.add(request(U, b, "b"))
    e.run()
    assert not connector._poison.tainted
    assert wait_until(lambda: check.lookup(b).matched_tokens >= 128, 10)
    time.sleep(0.5)  # every save has landed by now
    assert_holds(check, b, check.lookup(b).matched_tokens)  # as the model computes it: nothing over garbage
    e.worker.c.shutdown()


def test_blocks_of_a_failed_load_the_loader_computes_again_are_saved_and_read_from_kvstore(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same failed load, the loader running: vLLM rolls it back and it computes blocks 4..7 again.
    They are good, and saved; the connector dropped them from vLLM's prefix cache as the load failed
    (a request meanwhile must not take those not computed again yet), so b, later, takes 0..3 from
    there and 4..7 from kvstore: its own blocks are saved."""
    U, vcfg, ep = setup
    a = prompt(150, 35)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = half_stored_then_forgotten(U, e, a)
    with operator(ep) as op:
        e.before_load = lambda: op.evict(session="late")
        e.add(request(U, a, "again", max_tokens=5))
        e.run()
        e.before_load = None
    assert e.worker.loads[-1] == ("again", 0, 128) and "again" in e.over_missing
    assert wait_until(lambda: check.lookup(a).matched_tokens == 128, 10)  # computed again, saved
    b = a[:144] + prompt(40, 36)
    e.add(request(U, b, "b"))  # [0, 64) from vLLM's prefix cache, [64, 128) from kvstore
    e.run()
    assert e.worker.loads[-1] == ("b", 64, 128) and "b" not in e.over_missing
    assert wait_until(lambda: check.lookup(b).matched_tokens == 160, 10)
    e.worker.c.shutdown()


def test_a_sharer_of_a_failed_load_whose_loader_goes_after_the_rollback_saves_nothing_over_it(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b shares again's first 64 tokens through vLLM's prefix cache in the step of again's load, which
    fails. vLLM rolls back again (to compute the blocks anew) and sets b back by that step's tokens
    only: b counts the failed blocks as computed, relying on again. again is then aborted: nobody
    computes them, and b goes on over garbage. kvstore never stores b's K/V from the failed block
    on; what it stores of b is b's own."""
    from vllm.v1.request import RequestStatus

    U, vcfg, ep = setup
    a = prompt(150, 37)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, e, a)
    b = a[:64] + prompt(40, 38)
    with operator(ep) as op:

        def garbage() -> None:
            op.evict(all=True)  # the load finds nothing: every block of it fails
            for c in e.worker.caches.values():
                c.fill_(99.0)  # what the failed blocks hold (nobody wrote them)

        e.before_load = garbage
        e.add(request(U, a, "again"))
        e.add(request(U, b, "b"))
        e.step()  # again's load fails; b computes over its first blocks in the same step
        e.before_load = None
    connector = e.sched.connector
    assert connector._poison.blocks  # the load failed
    e.sched.finish_requests("again", RequestStatus.FINISHED_ABORTED)  # after vLLM rolled it back
    e.step()  # b goes on over the failed blocks: tainted from the first, what it computes poisoned
    assert connector._tracked["b"].poisoned_at == 0
    e.run()
    time.sleep(0.5)  # a save would have landed by now
    # b's first two kvstore blocks are again's failed ones, its third was computed over them
    assert check.lookup(b).matched_tokens == 0
    assert check.lookup(a).matched_tokens == 0
    e.worker.c.shutdown()
