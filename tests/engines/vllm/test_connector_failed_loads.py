"""Loads that fail (blocks evicted between the lookup and the load), under vLLM 0.33's real Scheduler
with a real daemon: the request waits for its load, is set back to its first failed block, and is
not sent to load it again; nobody computes over a failed block, and kvstore keeps what the model
computes. A lookup that fails is a miss within LOOKUP_TIMEOUT. See test_connector.py for the engine
these tests step."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KVStoreClient
from kvstore.integrations.backoff import LOOKUP_TIMEOUT
from tests.engines.vllm.test_connector import (
    Engine,
    assert_holds,
    check_client,
    engine_and_daemon,
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


@pytest.mark.parametrize("evicted", ["from-block-4", "all"])
def test_a_failed_load_sets_its_request_back_to_the_failed_block_once(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    evicted: str,
) -> None:
    """ "again" counts on kvstore for 128 tokens; before the load, [64, 128) (or everything) is
    evicted: vLLM's blocks 4..7 (or 0..7) are not loaded. vLLM sets again back to block 4 (or 0),
    caches only the blocks before it, and again computes the rest: it is not sent to load the
    failed blocks again. b, later, takes a's prefix from vLLM's prefix cache: all of it right."""
    U, vcfg, ep = setup
    a = prompt(150, 31)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = half_stored_then_forgotten(U, e, a)
    with operator(ep) as op:
        e.before_load = (
            (lambda: op.evict(session="late")) if evicted == "from-block-4" else (lambda: op.evict(all=True))
        )
        e.add(request(U, a, "again", max_tokens=5))
        e.run()
        e.before_load = None
    assert e.worker.loads == [("again", 0, 128)] and not e.over_missing
    assert_holds(check, a, 128)  # computed again from the failed block, saved
    b = a[:144] + prompt(40, 32)
    e.add(request(U, b, "b"))
    e.run()
    assert not e.over_missing and e.worker.loads == [("again", 0, 128)]  # all from vLLM's prefix cache
    assert wait_until(lambda: check.lookup(b).matched_tokens == 160, 10)
    assert_holds(check, b, 160)
    e.worker.c.shutdown()


def test_a_load_refused_by_a_busy_daemon_is_computed_and_saved_as_computed(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon turns the load away (busy): nothing loaded, again computes all of it, once."""
    from tests.engines.vllm.test_connector import refuse_loads

    U, vcfg, ep = setup
    a = prompt(150, 33)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, e, a)
    refused = refuse_loads(e, monkeypatch)
    e.add(request(U, a, "again", max_tokens=5))
    e.run()
    assert refused == [True] and e.worker.loads == [("again", 0, 128)] and not e.over_missing
    time.sleep(0.5)
    assert_holds(check, a, 128)
    e.worker.c.shutdown()


def test_a_load_vllm_defers_is_planned_and_reported_even_for_a_request_gone_meanwhile(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.33 may defer an async load (HiSparse): update_state_after_alloc comes after the step,
    with the request's tokens counted, when the record of its lookup may be gone. The load is
    planned all the same, and one whose request was aborted before it was planned is planned as a
    load of nothing: vLLM frees the request's blocks only once the workers report it."""
    from types import SimpleNamespace

    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    c = e.sched.connector
    none = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    step = SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=none, num_scheduled_tokens={}, preempted_req_ids=set()
    )
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(10, 18)),))
    for rid, gone in (("deferred", False), ("aborted", True)):
        r = request(U, prompt(150, 34), rid)
        c._requests[rid] = r  # (its lookup's, whose record of vLLM's own hit is gone)
        r.num_computed_tokens = 128  # vLLM's 64 and kvstore's 64, counted as the load began
        c.update_state_after_alloc(r, blocks, 64)
        if gone:
            assert c.request_finished(r, list(range(10, 18))) == (False, None)  # no save, no hold
        (load,) = c.build_connector_meta(step).loads
        assert (load.req_id, load.start, load.end) == ((rid, 64, 128) if not gone else (rid, 64, 64))
        assert load.block_ids == list(range(10, 18))
    e.worker.c.shutdown()


def test_a_rank_whose_load_failed_reporting_before_the_others_sets_the_request_back_once(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers (tensor parallel), as vLLM's aggregator joins their outputs: rank 1's load of L
    misses at once and its failed blocks reach the scheduler in step n; rank 0's load ends a step
    later, and only then is L reported done (finished_recving waits for every rank). L is set back
    to its first failed block and computes from there: it is not sent to load again and again."""
    U, vcfg, ep = setup
    a = prompt(150, 81)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    stored_then_forgotten(U, filler, a)
    sched = U.create_scheduler(vcfg, num_blocks=96)
    L = request(U, a, "L")
    sched.add_request(L)
    loads, outputs = [], []
    for _ in range(12):
        so = sched.schedule()
        loads += [(t.req_id, t.start, t.end) for t in so.kv_connector_metadata.loads]
        if "L" in so.num_scheduled_tokens:
            break
        scheduled = [sched.requests[r] for r in so.num_scheduled_tokens]
        if so.kv_connector_metadata.loads:  # rank 1: every block failed, reported at once
            (t,) = so.kv_connector_metadata.loads
            out = U.create_model_runner_output(scheduled, invalid_block_ids=set(t.block_ids))
            outputs.append("failed blocks")
        elif outputs == ["failed blocks"]:  # rank 0: done a step later; now L is done on both
            out = U.create_model_runner_output(scheduled, finished_recving={"L"})
            outputs.append("done")
        else:
            out = U.create_model_runner_output(scheduled)
        sched.update_from_output(so, out)
    assert loads == [("L", 0, 128)] and outputs == ["failed blocks", "done"]
    assert so.num_scheduled_tokens.get("L", 0) > 0 and L.num_computed_tokens <= 96  # computes it all
    filler.worker.c.shutdown()


def test_a_daemon_that_stops_answering_holds_the_scheduler_up_for_a_lookup_time_out_at_most(
    daemons: Any, tmp_path: Path, vllm_utils: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls' timeout is 5 s (the default); a lookup on a daemon that stopped (SIGSTOP) is a miss
    after LOOKUP_TIMEOUT, and the next request's lookup is not sent at all (the back-off)."""
    U, e, daemon = engine_and_daemon(daemons, tmp_path, vllm_utils, model_dir, monkeypatch)
    c = e.sched.connector
    assert c.settings.timeout == 5.0 > LOOKUP_TIMEOUT
    assert c.get_num_new_matched_tokens(request(U, prompt(100, 71), "hello"), 0) == (0, False)
    daemon.send_signal(signal.SIGSTOP)
    try:
        waited = []
        for i in range(2):
            r = request(U, prompt(100, 72 + i), f"r{i}")
            t0 = time.monotonic()
            assert c.get_num_new_matched_tokens(r, 0) == (0, False)
            waited.append(time.monotonic() - t0)
    finally:
        daemon.send_signal(signal.SIGCONT)
    assert LOOKUP_TIMEOUT - 0.1 < waited[0] < LOOKUP_TIMEOUT + 1.0 and waited[1] < 0.1
    assert c._lookup_failures == 1
    e.worker.c.shutdown()
