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
from tests.engines.vllm.test_connector_failed_loads import half_stored_then_forgotten

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
        self.worker.start_step(meta, self.before_load)
        self.wrong |= self.worker.loading()  # not written yet
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
        sending, recving, errors, loaded = self.worker.finish_step(so.finished_req_ids)
        for t in loaded:
            blocks = set(t.block_ids[t.start // BS : -(-t.end // BS)])
            self.wrong = (self.wrong - blocks) | (blocks & errors)
        w.clear_connector_metadata()
        reqs = [b[0] for b in batch]
        out = self.U.create_model_runner_output(
            reqs,
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=errors or None,
            token_id=SAMPLED,
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


@pytest.mark.parametrize("sharer", ["new-in-the-next-step", "new-in-the-same-step"])
def test_a_request_sharing_a_prefix_with_a_load_that_fails_in_flight_never_computes_over_it(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    sharer: str,
) -> None:
    """L counts on kvstore for 128 tokens of a; [64, 128) are evicted before the load, so L's vLLM
    blocks 4..7 are not loaded (step N). S (a's first 144 tokens and 40 of its own) is added in
    step N or N+1, scheduled before vLLM has step N's output. L waits for its load (vLLM caches none
    of its blocks meanwhile): S cannot take them from vLLM's prefix cache, and loads from kvstore
    (or computes) its own. Nobody computes over a failed block, and vLLM's prefix cache never holds
    one; kvstore ends with a and s as the model computes them.

        L   [ 0 .. 3 loaded | 4 .. 7 failed ]  waits; set back to 4; computes 4.. itself
        S   [ its own blocks, loaded or computed ]"""
    U, vcfg, ep = setup
    a = prompt(170, 41)
    s = a[:144] + prompt(40, 42)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)  # stores [0, 64) and, under "late", [64, 128)
    check = half_stored_then_forgotten(U, filler, a)
    e = AsyncEngine(U, vcfg, monkeypatch)
    pool = e.sched.kv_cache_manager.block_pool
    with operator(ep) as op:
        e.before_load = lambda: op.evict(session="late")  # after the scheduler counted on them
        e.add(request(U, a, "L", max_tokens=3))
        if sharer == "new-in-the-same-step":
            e.add(request(U, s, "S", max_tokens=3))
        e.step()  # step N scheduled and run: L loads; vLLM has not got its output
        assert len(e.queue) == 1 and e.worker.loads[0] == ("L", 0, 128)
        if sharer == "new-in-the-next-step":
            e.add(request(U, s, "S", max_tokens=3))
        e.before_load = None
        while e.sched.has_requests() or e.queue:
            e.step()
            assert not any(pool.blocks[b].block_hash is not None for b in e.wrong)  # never cached
        e.run()
    assert not e.over_missing and all(r.is_finished() for r in e.requests.values())
    assert e.worker.loads.count(("L", 0, 128)) == 1  # not sent to load what failed again
    assert_holds(check, a, 160)  # L computed [64, 173) again and saved its whole blocks
    assert_holds(check, s, check.lookup(s).matched_tokens)  # whatever S saved, as the model computes it
    assert check.lookup(s).matched_tokens >= 128
    filler.worker.c.shutdown()
    e.worker.c.shutdown()


def test_a_request_taking_blocks_of_a_prefix_whose_load_failed_takes_only_those_computed(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without async scheduling: L's load finds nothing (evicted after the lookup), so vLLM sets L
    back to its first token, and L computes its blocks 32 tokens a step (long_prefill_token_threshold).
    N, added while it does, shares L's first 144 tokens: it takes from vLLM's prefix cache only the
    blocks L has computed, and L is not sent to load again what failed."""
    U, vcfg, ep = setup
    vcfg.scheduler_config.long_prefill_token_threshold = 32
    a = prompt(150, 61)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, filler, a)  # kvstore holds a[:128]
    e = AsyncEngine(U, vcfg, monkeypatch, depth=1)
    with operator(ep) as op:
        e.before_load = lambda: op.evict(all=True)
        e.add(request(U, a, "L", max_tokens=3))
        e.add(request(U, prompt(400, 99), "other", max_tokens=3))  # two prefills: the threshold applies
        e.step()
        e.before_load = None
    e.step()
    e.step()  # L computing its blocks, a chunk a step
    e.add(request(U, a[:144] + prompt(30, 62), "N", max_tokens=3))
    e.run()
    assert not e.over_missing
    assert e.worker.loads == [("L", 0, 128)]
    assert_holds(check, a, 128)
    filler.worker.c.shutdown()
    e.worker.c.shutdown()


def test_a_request_aborted_while_its_load_is_in_flight_leaves_nothing_behind(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L aborted after its load failed, before vLLM has that step's output: its blocks go back when
    the load is reported (vLLM's part), none of them cached; S, added next, computes right."""
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
        e.add(request(U, s, "S", max_tokens=3))
        e.run()  # (checks that every block is back)
    assert not e.over_missing
    assert not e.sched.connector._loading and not e.sched.connector._tracked
    assert_holds(check, s, check.lookup(s).matched_tokens)
    assert check.lookup(s).matched_tokens >= 64
    t = s[:176] + prompt(20, 45)  # takes S's blocks from vLLM's prefix cache: good, saved on
    e.add(request(U, t, "T"))
    e.run()
    assert not e.over_missing
    assert_holds(check, t, 192)
    filler.worker.c.shutdown()
    e.worker.c.shutdown()
