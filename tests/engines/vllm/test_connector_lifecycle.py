"""The connector's hold on a request's blocks over its whole life under vLLM 0.33's real Scheduler:
preempted and resumed, finished while loads it shares are not settled, with a real daemon. See
test_connector.py for the engine these tests step."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.integrations.vllm_saver import Transfer
from kvstore.integrations.vllm_settings import Variant
from tests.engines.vllm.test_connector import (
    Engine,
    assert_holds,
    check_client,
    prompt,
    request,
    setup,  # noqa: F401  (a fixture)
)
from tests.hardening.conftest import wait_until


def test_a_request_resumed_among_the_new_ones_keeps_its_blocks_until_the_workers_report_its_saves(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's model runner V2 (0.33's default) gets a request resumed after a preemption among the
    new requests. "a" saved [0, 96) before it was preempted; resumed, it saves nothing more. The
    workers still count that save as "a"'s and report "a" finished: vLLM must have kept its blocks
    for that report (it asserts the request is there, and frees its blocks again)."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.sched.use_v2_model_runner = True  # resumed requests come back in scheduled_new_reqs
    a = prompt(100, 21)
    e.add(request(U, a, "a"))
    meta = e.step()  # 96 of 100 computed, [0, 96) saved
    assert [(t.req_id, t.start, t.end) for t in meta.saves] == [("a", 0, 96)]
    check = check_client(e)
    assert wait_until(lambda: check.lookup(a).matched_tokens == 96, 10)
    assert e.sched.reset_prefix_cache(reset_running_requests=True)  # "a" preempted
    e.run()  # resumed: 96 loaded from kvstore, 4 + 2 computed, nothing more to save
    assert e.worker.loads == [("a", 0, 96)] and e.requests["a"].is_finished()
    assert_holds(check, a, 96)
    e.worker.c.shutdown()


def test_a_preemption_drops_the_preempted_request_s_queued_saves_and_waits_for_no_other_request(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM hands a preempted request's blocks to others once handle_preemptions returns: its queued
    save is dropped, and the one running is waited for. Saves of other requests are not: one still
    waiting for its forward pass (a CUDA event here stands for it) does not hold up the step."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    w, saver = e.worker, e.worker.c._saver
    assert saver is not None
    a, b, c = prompt(64, 41), prompt(64, 42), prompt(64, 43)
    jobs = {}
    for i, (rid, tokens) in enumerate([("a", a), ("b", b), ("c", c)]):
        blocks = list(range(4 * i, 4 * i + 4))
        w.forward(blocks, tokens, 0, 64)
        jobs[rid] = Transfer(rid, Variant(base=w.c._clients.base), tokens, blocks, 0, 64)
    forwards = {rid: threading.Event() for rid in "bc"}

    def after(rid: str) -> Any:  # an event recorded after the forward of ``rid``, not done yet
        return SimpleNamespace(synchronize=lambda: forwards[rid].wait(30))

    saver.submit(jobs["b"], w.c._paged(jobs["b"]), after("b"))
    saver.submit(jobs["a"], w.c._paged(jobs["a"]))
    t0 = time.monotonic()
    w.c.handle_preemptions(SimpleNamespace(preempted=["a"]))
    assert time.monotonic() - t0 < 1.0
    assert saver.pending("a") == 0 and saver.pending("b") == 1 and saver.cancelled_saves == 1
    forwards["b"].set()
    check = check_client(e)
    assert_holds(check, b, 64)
    assert check.lookup(a).matched_tokens == 0

    # preempted while its own save runs: that save still reads its blocks, and is waited for
    saver.submit(jobs["c"], w.c._paged(jobs["c"]), after("c"))
    assert wait_until(lambda: saver._running == "c", 10)
    handled = threading.Thread(target=w.c.handle_preemptions, args=(SimpleNamespace(preempted=["c"]),))
    handled.start()
    handled.join(0.5)
    assert handled.is_alive()
    forwards["c"].set()
    handled.join(10)
    assert not handled.is_alive() and saver.pending("c") == 0
    assert_holds(check, c, 64)
    w.c.shutdown()
