"""Two steps in flight, as vLLM 0.33 runs them with async scheduling: its own AsyncScheduler, stepped
the way EngineCore.step_with_batch_queue steps it with a queue of two batches (step N+1 is
scheduled, and run by the workers, before the scheduler takes step N's output), with a real daemon.
See test_connector.py for the worker these tests use."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import pytest

from tests.engines.vllm.test_connector import (
    BS,
    NUM_BLOCKS,
    Engine,
    Worker,
    assert_holds,
    operator,
    prompt,
    request,
    setup,  # noqa: F401  (a fixture)
    stored_then_forgotten,
)
from tests.engines.vllm.test_connector_poison import half_stored_then_forgotten

SAMPLED = 0  # the token every step samples (vLLM's test helpers' model runner output)


class AsyncEngine:
    """vLLM's AsyncScheduler and one worker, stepped as EngineCore.step_with_batch_queue steps them
    with a queue of two: each call schedules a step and the worker runs it (workers run the steps
    in order), and the scheduler takes the oldest step's output only once the queue is full.

    The worker keeps track of which of vLLM's blocks hold wrong K/V (a failed load, or computed over
    one), and computes wrong K/V over them, as a real model would. ``depth=1``: vLLM's own Scheduler,
    without async scheduling (each step's output taken before the next is scheduled)."""

    def __init__(self, U: Any, vllm_config: Any, monkeypatch: pytest.MonkeyPatch, depth: int = 2) -> None:
        vllm_config.scheduler_config.async_scheduling = depth == 2
        assert vllm_config.max_concurrent_batches == depth
        self.U, self.depth = U, depth
        self.sched = U.create_scheduler(vllm_config, num_blocks=NUM_BLOCKS)
        assert (type(self.sched).__name__ == "AsyncScheduler") == (depth == 2)
        assert self.sched.connector._depth == depth
        self.worker = Worker(vllm_config, "FLASH_ATTN", monkeypatch)
        self.requests: dict[str, Any] = {}
        self.queue: deque[tuple[Any, Any]] = deque()  # (scheduler output, model runner output)
        self.wrong: set[int] = set()  # vLLM blocks holding wrong K/V
        self.over_missing: set[str] = set()  # requests that computed over wrong K/V
        self.before_load: Any = None  # a hook run between scheduling and loading

    def add(self, req: Any) -> None:
        self.requests[req.request_id] = req
        self.sched.add_request(req)

    def step(self) -> None:
        """One call of EngineCore.step_with_batch_queue."""
        if self.sched.has_requests():
            so = self.sched.schedule()
            self.queue.appendleft((so, self._execute(so)))
            if len(self.queue) < self.depth and (
                so.total_num_scheduled_tokens > 0 or self.sched.has_requests()
            ):
                return
        if self.queue:
            self.sched.update_from_output(*self.queue.pop())

    def run(self, timeout: float = 60.0) -> None:
        """Step until every request is done and its blocks are back (see Engine.run)."""
        deadline = time.monotonic() + timeout
        while self.sched.has_requests() or self.queue:
            if time.monotonic() > deadline:
                reqs = {r: (q.status, q.num_computed_tokens) for r, q in self.requests.items()}
                raise AssertionError(f"the engine did not finish its requests: {reqs}")
            self.step()
            if not self.sched.has_unfinished_requests():
                time.sleep(0.01)
        self.U.assert_scheduler_empty(self.sched)

    def _execute(self, so: Any) -> Any:
        """The workers' step: loads, the forward pass, saves; right after it was scheduled (the
        requests' num_computed_tokens already count its tokens)."""
        w = self.worker.c
        meta = so.kv_connector_metadata
        errors = self.worker.start_step(meta, self.before_load)
        for t in meta.loads:
            loaded = set(t.block_ids[t.start // BS : -(-t.end // BS)])
            self.wrong = (self.wrong - loaded) | (loaded & errors)
        batch = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            ids = list(self.sched.kv_cache_manager.get_block_ids(rid)[0])
            start = req.num_computed_tokens - n
            batch.append((req, ids, start, start + n))
        over = self._over_wrong(batch)
        for req, ids, start, end in batch:
            # a decode step's token is sampled by the step before, not given back to vLLM yet
            tokens = list(req.all_token_ids)
            tokens += [SAMPLED] * (end - len(tokens))
            wrong = req.request_id in over
            self.worker.forward(ids, tokens, start, end, wrong)
            written = set(ids[start // BS : -(-end // BS)])
            self.wrong = self.wrong | written if wrong else self.wrong - written
            if wrong:
                self.over_missing.add(req.request_id)
        w.wait_for_save()
        sending, _ = w.get_finished(so.finished_req_ids)
        w.clear_connector_metadata()
        reqs = [b[0] for b in batch]
        out = self.U.create_model_runner_output(
            reqs, finished_sending=sending, invalid_block_ids=errors or None, token_id=SAMPLED
        )
        # a step that ends inside the prompt samples nothing
        out.sampled_token_ids = [[] if r.is_prefill_chunk else [SAMPLED] for r in reqs]
        return out

    def _over_wrong(self, batch: list[tuple[Any, list[int], int, int]]) -> set[str]:
        """The requests of a step that compute over wrong K/V. Each layer writes the whole batch's K/V
        before attention reads it: a block one request computes right in this step is right for
        the others, one it computes over wrong K/V is wrong for them."""
        over: set[str] = set()
        while True:
            right: set[int] = set()
            bad: set[int] = set()
            for req, ids, start, end in batch:
                (bad if req.request_id in over else right).update(ids[start // BS : -(-end // BS)])
            more = set()
            for req, ids, start, _ in batch:
                before = ids[: start // BS]  # whole blocks before its first token
                partial = ids[start // BS] if start % BS else None  # its own earlier tokens
                if any(b in bad or (b in self.wrong and b not in right) for b in before) or (
                    partial in self.wrong
                ):
                    more.add(req.request_id)
            if more <= over:
                return over
            over |= more


@pytest.mark.parametrize(
    "sharer",
    ["new-in-the-next-step", "new-in-the-same-step"],
)
def test_a_request_that_computes_over_a_failed_load_in_a_step_in_flight_stores_nothing_from_it(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    sharer: str,
) -> None:
    """L counts on kvstore for 128 tokens of a; [64, 128) are evicted before the load, so L's vLLM
    blocks 4..7 are not loaded (step N). S (a's first 144 tokens and 40 of its own) takes L's blocks
    0..8 from vLLM's prefix cache and computes its own over them: in step N+1, scheduled before vLLM
    has step N's output, or in step N with a decode token in N+1. Step N's output rolls L back to
    block 4, and S only by what it was scheduled in step N: what S computed in step N+1 (its prompt,
    or the first of its prompt's own tokens) is kept, wrong, and never computed again.

        L   [ 0 .. 3 | 4 .. 7 failed | 8 | 9 | 10 ]    recomputed from 4: saved, right
        S   [ 0 .. 3 | 4 .. 7 failed | 8 | own 9.. ]   own blocks wrong for good: never saved

    kvstore ends up with L's recomputed blocks, and never with S's past what L stored."""
    U, vcfg, ep = setup
    a = prompt(170, 41)
    s = a[:144] + prompt(40, 42)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)  # stores [0, 64) and, under "late", [64, 128)
    check = half_stored_then_forgotten(U, filler, a)
    e = AsyncEngine(U, vcfg, monkeypatch)
    with operator(ep) as op:
        e.before_load = lambda: op.evict(session="late")  # after the scheduler counted on them
        e.add(request(U, a, "L", max_tokens=3))
        if sharer == "new-in-the-same-step":
            e.add(request(U, s, "S", max_tokens=3))
        e.step()  # step N scheduled and run: L loads; vLLM has not got its output
        assert len(e.queue) == 1 and e.worker.loads == [("L", 0, 128)]
        if sharer == "new-in-the-next-step":
            e.add(request(U, s, "S", max_tokens=3))  # step N+1 takes L's blocks from the prefix cache
        e.before_load = None
        e.run()
    assert e.worker.loads == [("L", 0, 128)] and e.over_missing >= {"L", "S"}
    assert all(r.is_finished() for r in e.requests.values())
    # L computed [64, 173) again and saved it (a's [64, 160)): right
    assert_holds(check, a, 160)
    # S shares [0, 144) with a: its own kvstore block [128, 160) holds its wrong tokens 144.., never stored
    assert_holds(check, s, 128)
    filler.worker.c.shutdown()
    e.worker.c.shutdown()


def test_blocks_computed_over_a_failed_load_in_flight_leave_vllms_prefix_cache_and_nobody_takes_them(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The story above (S in the next step): S's own blocks hold wrong K/V for good. They must not
    stay in vLLM's prefix cache, where a later request T sharing S's prompt would take them (S was
    running as the load failed: it does not compute them again)."""
    U, vcfg, ep = setup
    a = prompt(170, 41)
    s = a[:144] + prompt(40, 42)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = half_stored_then_forgotten(U, filler, a)
    e = AsyncEngine(U, vcfg, monkeypatch)
    with operator(ep) as op:
        e.before_load = lambda: op.evict(session="late")
        e.add(request(U, a, "L", max_tokens=3))
        e.step()
        e.add(request(U, s, "S", max_tokens=30))
        e.before_load = None
        for _ in range(6):
            e.step()
    pool = e.sched.kv_cache_manager.block_pool
    assert e.wrong and all(pool.blocks[b].block_hash is None for b in e.wrong)
    e.run()
    t = s[:176] + prompt(20, 45)  # S's prompt and more
    e.add(request(U, t, "T", max_tokens=2))
    e.run()
    assert e.over_missing == {"L", "S"}  # not T
    assert_holds(check, t, check.lookup(t).matched_tokens)
    filler.worker.c.shutdown()
    e.worker.c.shutdown()


def test_a_request_taking_blocks_a_rolled_back_loader_has_not_computed_again_yet_takes_none(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without async scheduling: L's load finds nothing (evicted after the lookup), vLLM rolls L back,
    and L computes its blocks again 32 tokens a step (long_prefill_token_threshold). N, added while
    it does, shares L's first 144 tokens: it must not take from vLLM's prefix cache the blocks L has
    not computed again yet."""
    U, vcfg, ep = setup
    vcfg.scheduler_config.long_prefill_token_threshold = 32
    a = prompt(150, 61)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    stored_then_forgotten(U, filler, a)  # kvstore holds a[:128]
    e = AsyncEngine(U, vcfg, monkeypatch, depth=1)
    with operator(ep) as op:
        e.before_load = lambda: op.evict(all=True)
        e.add(request(U, a, "L", max_tokens=3))
        e.add(request(U, prompt(400, 99), "other", max_tokens=3))  # two prefills: the threshold applies
        e.step()
        e.before_load = None
    e.step()  # L rolled back: computing its blocks again, a chunk a step
    e.add(request(U, a[:144] + prompt(30, 62), "N", max_tokens=3))
    e.run()
    assert e.over_missing == {"L"}  # L in the step its load failed (then rolled back), never N
    filler.worker.c.shutdown()
    e.worker.c.shutdown()


def test_a_request_vllm_sets_back_to_a_failed_block_computes_it_again_and_is_saved(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same failed load, L aborted before vLLM has step N's output: S, scheduled in step N+1 over
    L's blocks, is then the first running request holding them, and vLLM sets it back to block 4,
    not by its step-N tokens. S computes blocks 4.. again itself: right, saved, and good for a later
    request that takes them from vLLM's prefix cache.

        S   [ 0 .. 3 | 4 .. 7 failed | 8 | own 9.. ]   set back to 4, computed again: all saved"""
    from vllm.v1.request import RequestStatus

    U, vcfg, ep = setup
    a = prompt(170, 43)
    s = a[:144] + prompt(40, 44)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = half_stored_then_forgotten(U, filler, a)
    e = AsyncEngine(U, vcfg, monkeypatch)
    with operator(ep) as op:
        e.before_load = lambda: op.evict(session="late")
        e.add(request(U, a, "L", max_tokens=3))
        e.step()  # step N scheduled and run: L loads, and fails; vLLM has not got its output
        assert len(e.queue) == 1 and e.worker.loads == [("L", 0, 128)]
        e.before_load = None
        e.sched.finish_requests("L", RequestStatus.FINISHED_ABORTED)
        e.add(request(U, s, "S", max_tokens=3))  # step N+1 takes L's blocks from the prefix cache
        e.run()
    assert "S" in e.over_missing  # in step N+1, over the failed blocks
    assert not e.sched.connector._poison.tainted
    assert_holds(check, s, 160)  # all of S's whole blocks, computed again from block 4
    t = s[:176] + prompt(20, 45)  # takes S's blocks from vLLM's prefix cache: good, saved on
    e.add(request(U, t, "T"))
    e.run()
    assert_holds(check, t, 192)
    filler.worker.c.shutdown()
    e.worker.c.shutdown()
