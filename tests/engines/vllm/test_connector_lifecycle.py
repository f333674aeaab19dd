"""The connector's hold on a request's blocks over its whole life under vLLM 0.33's real Scheduler:
preempted and resumed, finished while loads it shares are not settled, with a real daemon. See
test_connector.py for the engine these tests step."""

from __future__ import annotations

from typing import Any

import pytest

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
