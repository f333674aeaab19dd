"""The connector's hold on a request's blocks over its whole life under vLLM 0.33's real Scheduler:
preempted and resumed, finished, shut down, with a real daemon. See
test_connector.py for the engine these tests step."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.integrations import vllm_saver
from kvstore.integrations.vllm_saver import Transfer
from kvstore.integrations.vllm_settings import Variant
from tests.engines.vllm.test_connector import (
    Engine,
    assert_holds,
    check_client,
    engine_and_daemon,
    prompt,
    request,
    setup,  # noqa: F401  (a fixture)
    stored_then_forgotten,
)
from tests.hardening.conftest import wait_until


def test_a_request_resumed_among_the_new_ones_loads_what_it_saved_and_gives_its_blocks_back(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's model runner V2 (0.33's default) gets a request resumed after a preemption among the
    new requests. "a" saved [0, 96) before it was preempted; resumed, it loads that and saves
    nothing more. Its save before the preemption is not reported (vLLM waits for none: it checks a
    report against the requests it holds blocks for), and its blocks go back as it finishes."""
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


def test_a_request_resumed_after_a_preemption_loads_the_output_it_saved_not_its_prompt_alone(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "a" (a 40-token prompt) decodes past two kvstore blocks, its output saved as it goes; it is
    preempted and vLLM's prefix cache emptied. Resumed, it is looked up with its output: [0, 64) is
    loaded (prompt and output), where a lookup of its prompt alone found one block."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.sched.use_v2_model_runner = True  # resumed requests come back in scheduled_new_reqs
    e.add(request(U, prompt(40, 49), "a", max_tokens=60))
    a = e.requests["a"]
    while len(a.all_token_ids) < 72:  # 71 computed: [0, 64) saved
        e.step()
    check = check_client(e)
    assert wait_until(lambda: check.lookup(list(a.all_token_ids)).matched_tokens == 64, 10)
    assert e.sched.reset_prefix_cache(reset_running_requests=True)  # "a" preempted
    e.run()
    assert a.num_preemptions == 1 and e.worker.loads == [("a", 0, 64)]
    assert not e.over_missing and a.is_finished()
    assert_holds(check, list(a.all_token_ids), 96)
    e.worker.c.shutdown()


def test_a_request_resumed_after_its_queued_save_was_dropped_saves_from_what_kvstore_holds(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "a" computes its first 64 tokens in a chunk and is preempted: the save of that chunk, queued,
    is dropped (vLLM hands its blocks to others). Resumed, its next save, refused from 64 for its
    missing parent, is sent again from what kvstore holds (0): the prompt is stored whole."""
    U, vcfg, ep = setup
    vcfg.scheduler_config.long_prefill_token_threshold = 64
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.sched.use_v2_model_runner = False  # resumed requests come back among the cached ones
    saver = e.worker.c._saver
    assert saver is not None
    submit = saver.submit
    monkeypatch.setattr(saver, "submit", lambda *args, **kw: None)  # the first chunk's save: dropped
    a = prompt(150, 47)
    e.add(request(U, a, "a"))
    e.add(request(U, prompt(400, 48), "other", max_tokens=3))  # two prefills: the threshold applies

    def preempt(meta: Any) -> None:
        if any(t.req_id == "a" for t in meta.saves):
            req = e.requests["a"]
            e.sched.running.remove(req)
            e.sched._preempt_request(req, time.monotonic())
            monkeypatch.setattr(saver, "submit", submit)
            e.before_output = None

    e.before_output = preempt
    e.run()
    assert e.requests["a"].num_preemptions == 1
    assert_holds(check_client(e), a, 128)
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

    # preempted while its own save waits for its forward: the save reads none of its blocks after
    # that (vLLM hands them to others), and the step is not held up for it
    saver.submit(jobs["c"], w.c._paged(jobs["c"]), after("c"))
    assert wait_until(lambda: saver._running == "c", 10)
    t0 = time.monotonic()
    w.c.handle_preemptions(SimpleNamespace(preempted=["c"]))
    assert time.monotonic() - t0 < 1.0
    forwards["c"].set()
    assert wait_until(lambda: saver.pending("c") == 0, 10) and saver.cancelled_saves == 2
    assert check.lookup(c).matched_tokens == 0
    assert "a" not in saver._stored and "c" not in saver._stored  # nothing kept of them for good
    w.c.shutdown()


def test_a_preemption_waits_for_no_call_of_a_daemon_that_does_not_answer(
    daemons: Any, tmp_path: Path, vllm_utils: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of the preempted request waiting on the daemon (stopped here: SIGSTOP) has read none of
    its blocks, or read them already: handle_preemptions returned only once the whole save was
    done, its retries of a daemon that does not answer included, with the engine's step held up."""
    U, e, daemon = engine_and_daemon(daemons, tmp_path, vllm_utils, model_dir, monkeypatch)
    w, saver = e.worker, e.worker.c._saver
    assert saver is not None
    a, b = prompt(64, 51), prompt(64, 52)
    jobs = {}
    for i, (rid, tokens) in enumerate([("a", a), ("b", b)]):
        blocks = list(range(4 * i, 4 * i + 4))
        w.forward(blocks, tokens, 0, 64)
        jobs[rid] = Transfer(rid, Variant(base=w.c._clients.base), tokens, blocks, 0, 64)
    check = check_client(e)
    saver.submit(jobs["a"], w.c._paged(jobs["a"]))  # the save client says hello, and a is stored
    assert_holds(check, a, 64)
    daemon.send_signal(signal.SIGSTOP)
    try:
        saver.submit(jobs["b"], w.c._paged(jobs["b"]))
        assert wait_until(lambda: saver._running == "b", 10)
        time.sleep(0.3)  # its first call sent, unanswered
        t0 = time.monotonic()
        w.c.handle_preemptions(SimpleNamespace(preempted=["b"]))
        assert time.monotonic() - t0 < 1.0
    finally:
        daemon.send_signal(signal.SIGCONT)
    assert wait_until(lambda: saver.pending("b") == 0, 60)
    assert check.lookup(b).matched_tokens == 0  # nothing of b read after its preemption

    # the daemon stopped again: saves queue up to MAX_QUEUED (the rest are dropped, the requests'
    # blocks not held for them), and shutdown waits CLOSE_WAIT for them, not each save's time-outs
    monkeypatch.setattr(vllm_saver, "MAX_QUEUED", 2)
    monkeypatch.setattr(vllm_saver, "CLOSE_WAIT", 0.5)
    daemon.send_signal(signal.SIGSTOP)
    try:
        for i in range(5):
            t = dataclasses.replace(jobs["b"], req_id=f"q{i}")
            saver.submit(t, w.c._paged(t))
        assert saver.dropped_saves >= 2 and sum(saver.pending(f"q{i}") for i in range(5)) <= 3
        t0 = time.monotonic()
        w.c.shutdown()
        assert time.monotonic() - t0 < 3.0
    finally:
        daemon.send_signal(signal.SIGCONT)


def test_a_daemon_that_keeps_up_with_no_save_holds_finished_requests_blocks_only_for_its_timeout(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every put takes the daemon 1 s (a loaded host): six requests finish at once, their saves queue
    behind one another. Their blocks go back to vLLM within the call timeout (2 s here), their
    saves given up, not after the whole queue (6 s and more): vLLM would preempt running requests
    for want of them meanwhile."""
    from kvstore.client import KVStoreClient

    U, vcfg, ep = setup
    vcfg.kv_transfer_config.kv_connector_extra_config["timeout"] = 2.0
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    put_from = KVStoreClient.put_from

    def slow(self: Any, *args: Any, **kw: Any) -> Any:
        time.sleep(1.0)
        return put_from(self, *args, **kw)

    monkeypatch.setattr(KVStoreClient, "put_from", slow)
    for i in range(6):
        e.add(request(U, prompt(64, 80 + i), f"r{i}", max_tokens=2))
    while any(not r.is_finished() for r in e.requests.values()):
        e.step()
    e.run()  # until every block is back: before the saves queued behind one another were done
    saver = e.worker.c._saver
    assert saver is not None and saver.cancelled_saves >= 1 and e.worker.c.late_saves >= 1
    e.worker.c.shutdown()


def test_caches_put_to_sleep_are_read_by_no_save_after(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's sleep mode discards the KV caches' memory once unregister_kv_caches returns: a save
    still queued must not read them after that, nor one waiting for its forward pass."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    w, saver = e.worker, e.worker.c._saver
    assert saver is not None
    jobs = {}
    for i, (rid, tokens) in enumerate([("a", prompt(64, 51)), ("b", prompt(64, 52))]):
        blocks = list(range(4 * i, 4 * i + 4))
        w.forward(blocks, tokens, 0, 64)
        jobs[rid] = Transfer(rid, Variant(base=w.c._clients.base), tokens, blocks, 0, 64)
    forward = threading.Event()
    saver.submit(jobs["a"], w.c._paged(jobs["a"]), SimpleNamespace(synchronize=lambda: forward.wait(30)))
    saver.submit(jobs["b"], w.c._paged(jobs["b"]))
    assert wait_until(lambda: saver._running == "a", 10)
    t0 = time.monotonic()
    w.c.unregister_kv_caches()
    assert time.monotonic() - t0 < 1.0  # not held up by the forward pass, nor by the daemon
    forward.set()
    assert wait_until(lambda: saver.pending("a") == 0 and saver.pending("b") == 0, 10)
    check = check_client(e)
    assert (
        check.lookup(jobs["a"].tokens).matched_tokens == 0
        and check.lookup(jobs["b"].tokens).matched_tokens == 0
    )
    w.c.shutdown()


@pytest.mark.parametrize("hit", ["saves-done", "mid-prefill"])
def test_a_preempted_request_aborted_while_it_loads_again_takes_the_engine_down_nowhere(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    hit: str,
) -> None:
    """R saved blocks, is preempted (its blocks taken back), admitted again with a hit in kvstore
    longer than its old block table, and aborted while that load runs. vLLM frees its blocks once
    the load is reported; the connector must neither plan a save out of the blocks R held before
    (gone, and fewer than its hit), nor keep R's blocks for it, nor report R's old saves later
    (vLLM checks the report against its requests: R is gone)."""
    from vllm.v1.request import RequestStatus

    from tests.engines.vllm.test_connector import expected

    U, vcfg, ep = setup
    a = prompt(214, 5)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = check_client(e)
    L = check._ns().layout
    if hit == "saves-done":  # kvstore holds a[:128]: R loads it, computes on and saves [128, 192)
        e.add(request(U, a[:128], "first"))
        e.run()
        assert e.sched.reset_prefix_cache()
    e.add(request(U, a, "R", max_tokens=50))
    r = e.requests["R"]
    e.step()
    while hit == "saves-done" and r.num_output_tokens < 3:
        e.step()
    if hit == "mid-prefill":  # kvstore holds more of a than R computed
        check.put(a[:192], expected(a, 0, 192, L.num_layers, L.num_kv_heads, L.head_dim))
    assert wait_until(lambda: check.lookup(a).matched_tokens == 192, 10)
    e.sched.running.remove(r)
    e.sched._preempt_request(r, time.monotonic())
    e.sched.reset_prefix_cache()

    def abort(meta: Any) -> None:
        if any(t.req_id == "R" for t in meta.loads):
            e.sched.finish_requests("R", RequestStatus.FINISHED_ABORTED)
            e.before_output = None

    e.before_output = abort
    e.run()  # every block back, and no report vLLM does not expect
    for _ in range(3):  # the workers' next reports
        e.add(request(U, prompt(40, 6 + _), f"next{_}", max_tokens=1))
        e.run()
    assert r.is_finished() and "R" not in e.worker.c._saving
    assert_holds(check, a, 192)
    e.worker.c.shutdown()


def test_a_request_preempted_outside_a_schedule_and_aborted_is_not_waited_for(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """reset_prefix_cache(reset_running_requests=True) preempts "a" (its saves the workers drop when
    they hear of it), and "a" is aborted before the next schedule: vLLM must not be told to wait for
    saves nobody will report (it would keep "a" for good)."""
    from vllm.v1.request import RequestStatus

    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    a = prompt(200, 21)
    e.add(request(U, a, "a", max_tokens=20))
    e.step()  # [0, 96) computed, its save queued
    assert e.sched.reset_prefix_cache(reset_running_requests=True)  # "a" preempted
    e.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    e.run(timeout=20)  # (fails if "a" is kept: the engine never goes idle)
    assert "a" not in e.sched.requests
    e.worker.c.shutdown()


@pytest.mark.parametrize("v2", [False, True], ids=["model-runner-v1", "model-runner-v2"])
def test_a_request_preempted_outside_a_schedule_and_resumed_next_is_saved_and_reported_once(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    v2: bool,
) -> None:
    """ "a" (no kvstore hit: loads off) is preempted by reset_prefix_cache and resumed by the next
    schedule, which plans its save of what it computes again: that save is waited for and reported
    (vLLM checks a report against the requests it holds: reporting one it freed fails its check)."""
    U, vcfg, ep = setup
    vcfg.kv_transfer_config.kv_connector_extra_config["load"] = False
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.sched.use_v2_model_runner = v2
    a = prompt(100, 31)
    e.add(request(U, a, "a", max_tokens=3))
    e.step()  # 96 computed, [0, 96) saved
    assert e.sched.reset_prefix_cache(reset_running_requests=True)
    e.add(request(U, prompt(40, 77), "other", max_tokens=8))  # traffic goes on
    e.run(timeout=30)
    assert e.requests["a"].is_finished() and "a" not in e.sched.requests
    assert_holds(check_client(e), a, 96)
    e.worker.c.shutdown()


def test_a_request_preempted_and_aborted_after_its_load_was_reported_saves_nothing(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R computed and saved 96 tokens; kvstore holds 192 of its prompt (another engine's); R is
    preempted, loads 192 when admitted again, and is aborted once that load was reported, before it
    is scheduled: its last save must not be planned out of the blocks it held before the preemption
    (fewer than 192 tokens need, and freed)."""
    from vllm.v1.request import RequestStatus

    from tests.engines.vllm.test_connector import expected

    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = check_client(e)
    L = check._ns().layout
    a = prompt(214, 23)
    e.add(request(U, a, "R", max_tokens=50))
    r = e.requests["R"]
    e.step()
    check.put(a[:192], expected(a, 0, 192, L.num_layers, L.num_kv_heads, L.head_dim))
    assert wait_until(lambda: check.lookup(a).matched_tokens == 192, 10)
    e.sched.running.remove(r)
    e.sched._preempt_request(r, time.monotonic())
    e.sched.reset_prefix_cache()

    e.step()  # R admitted again: its load planned, run, and reported with this step's output
    assert e.worker.loads[-1] == ("R", 0, 192) and "R" not in e.sched.connector._loading
    e.sched.finish_requests("R", RequestStatus.FINISHED_ABORTED)  # before it is scheduled
    e.run(timeout=20)
    assert r.is_finished() and not e.sched.connector._final
    assert_holds(check, a, 192)
    e.worker.c.shutdown()


def test_a_cache_reset_after_a_weight_update_finds_none_of_the_old_k_v(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM resets its caches with the connector's after its weights changed in place (an RL weight
    sync): what kvstore holds of the old weights must not be loaded any more."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    a = prompt(150, 25)
    check = stored_then_forgotten(U, e, a)  # kvstore holds a[:128]: a new request of a loads it
    assert e.sched.reset_prefix_cache(reset_connector=True)
    e.add(request(U, a, "after"))
    e.run()
    assert e.worker.loads == []  # computed: the old weights' K/V is not found
    assert check.lookup(a).matched_tokens == 128  # (still there, under the old weights' namespace)
    e.worker.c.shutdown()


def test_a_request_looked_up_before_a_cache_reset_is_looked_up_again_after_it(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request whose lookup found the old weights' K/V, left waiting (no room for it yet) while the
    weights were updated and the caches reset: its hit was kept, and it loaded the old K/V under
    the new weights. It is looked up again, under the new weights' namespace."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    a = prompt(150, 26)
    stored_then_forgotten(U, e, a)
    waiting = request(U, a, "waiting")
    assert e.sched.connector.get_num_new_matched_tokens(waiting, 0) == (128, True)  # then not scheduled
    assert e.sched.reset_prefix_cache(reset_connector=True)
    e.add(waiting)
    e.run()
    assert e.worker.loads == []  # computed: the old weights' K/V is not loaded
    e.worker.c.shutdown()


def test_each_cache_reset_names_weights_no_other_process_named() -> None:
    """A generation counted from 0 in each process named an engine's first sync after a restart as
    the K/V of another engine's (or the same engine's, before it) first sync."""
    from types import SimpleNamespace

    from kvstore.integrations.vllm_clients import Clients
    from kvstore.integrations.vllm_settings import Settings
    from kvstore.layout import KVLayout

    config = SimpleNamespace(model_config=SimpleNamespace(model="org/model", revision="v1"))
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=64)
    a, b = (Clients(config, Settings(), layout, (0, 0)) for _ in range(2))  # two engines (or restarts)
    loaded = a.base
    assert b.base == loaded and not a.stale(Variant(base=loaded))
    a.reset()
    b.reset()
    assert a.base != b.base and a.base.startswith(f"{loaded}+reset-")
    assert a.stale(Variant(base=loaded)) and not a.stale(Variant(base=a.base))


def test_vllm_is_told_kvstore_is_a_best_effort_cache(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A save dropped at a preemption is a later miss, not a lost hand-off: vLLM need not drop and
    resample a preempted request's output in flight (it does for connectors that must deliver)."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    assert e.sched.connector.requires_kv_delivery is False and e.sched.requires_kv_delivery is False
    e.worker.c.shutdown()


def test_a_step_that_computes_nothing_waits_a_moment_for_a_finished_requests_saves(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "a" has finished; its save is under way (slow to reach the daemon). The engine, with nothing
    else to compute, steps only to hear of it: such a step waits for the save (up to IDLE_WAIT), so
    the saving thread is not left Python's lock once per switch interval by a busy loop, and "a" is
    reported done in that step. A step that computes is not held up."""
    from kvstore.integrations import vllm_worker

    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    clients = e.worker.c._clients
    saver = clients.get(Variant(base=clients.base), "save")
    put_from = saver.put_from
    slow = threading.Event()

    def slow_put(*args: Any, **kw: Any) -> Any:
        if slow.is_set():
            time.sleep(0.05)
        return put_from(*args, **kw)

    monkeypatch.setattr(saver, "put_from", slow_put)
    monkeypatch.setattr(vllm_worker, "IDLE_WAIT", 1.0)
    e.add(request(U, prompt(64, 53), "a", max_tokens=1))
    slow.set()
    while not e.requests["a"].is_finished():
        e.step()  # the step that finishes "a" computes: it does not wait for the save
    assert "a" not in e.sent[-1]
    t0 = time.monotonic()
    e.step()  # nothing to compute: waits for the save, which ends within it
    assert e.sent[-1] == {"a"} and time.monotonic() - t0 < 1.0
    e.run()
    assert_holds(check_client(e), prompt(64, 53), 64)
    e.worker.c.shutdown()


def test_a_worker_whose_rank_cannot_be_read_is_refused_where_vllm_runs_several() -> None:
    """Read as rank 0 (a single process), every tensor-parallel rank named its heads as rank 0's."""
    from types import SimpleNamespace

    from kvstore.errors import KVStoreError
    from kvstore.integrations.vllm_clients import worker_ranks

    def config(tp: int, pp: int) -> Any:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        )

    assert worker_ranks(config(1, 1)) == (0, 0)  # (no parallel groups here)
    for tp, pp in ((2, 1), (1, 2)):
        with pytest.raises(KVStoreError, match="rank cannot be read"):
            worker_ranks(config(tp, pp))


def test_a_request_scheduled_as_new_again_keeps_its_earlier_saves_owed(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streaming-input session comes back among the new requests without a preemption: the saves
    of its earlier part may be queued still, and the workers report it when it finishes. Tracked
    afresh as saving nothing, vLLM freed its blocks at its end, and the workers' report of it then
    failed vLLM's check (an assertion: the engine dies)."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    r = request(U, prompt(150, 27), "stream")
    connector = e.sched.connector
    connector._requests["stream"] = r
    first = connector._track("stream", [0, 1, 2], 0)
    assert first is not None and not first.saving
    first.saving = True  # its first part's saves went to the workers
    again = connector._track("stream", [0, 1, 2, 3], 128)
    assert again is not None and again.saving
    e.worker.c.shutdown()


def test_a_request_that_loaded_before_a_cache_reset_saves_nothing_under_the_new_weights(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its blocks hold the old weights' K/V, read before the reset (its load under way, or done and
    the request not scheduled since): what it computes on top of them was saved under the new
    weights' namespace, where requests on the new weights then loaded it."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    a = prompt(200, 28)
    stored_then_forgotten(U, e, a)
    e.add(request(U, a, "loaded", max_tokens=2))
    e.step()  # its load of [0, 128), under the old weights
    assert e.worker.loads[-1][:3] == ("loaded", 0, 128)
    assert "loaded" not in e.sched.connector._tracked
    assert e.sched.reset_prefix_cache(reset_connector=True) in (True, False)  # (vLLM's own may fail)
    e.run()
    clients = e.worker.c._clients
    new = clients.get(Variant(base=e.sched.connector._clients.base), "check")
    assert new.lookup(a).matched_tokens == 0  # nothing of it under the new weights


def test_the_blocks_of_weights_a_later_reset_replaced_are_evicted(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An RL loop syncs weights again and again: each reset's namespace is this engine's alone, and
    once the next reset replaces it its blocks only took room until they aged out, keeping their
    registrations on the daemon (whose quota then ran out: nothing of the engine was cached). The
    workers evict them; the weights loaded from the files (other engines' too) are left alone."""
    U, vcfg, ep = setup
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    clients = e.worker.c._clients
    files = e.sched.connector._clients.base
    a, b = prompt(130, 29), prompt(130, 30)
    e.add(request(U, a, "on-files", max_tokens=1))
    e.run()
    assert e.sched.reset_prefix_cache(reset_connector=True)
    first = e.sched.connector._clients.base
    e.add(request(U, b, "on-first-sync", max_tokens=1))
    e.run()
    # (clients of the test's own: those of the connector's set go with the weights they name)
    on_files, on_first = (clients._connect(Variant(base=base), "check") for base in (files, first))
    assert wait_until(lambda: on_first.lookup(b).matched_tokens > 0, 10)
    kept = on_files.lookup(a).matched_tokens
    assert kept > 0
    assert e.sched.reset_prefix_cache(reset_connector=True)
    e.add(request(U, prompt(70, 31), "on-second-sync", max_tokens=1))
    e.run()
    assert wait_until(lambda: on_first.lookup(b).matched_tokens == 0, 10)  # evicted
    assert on_files.lookup(a).matched_tokens == kept  # not this engine's alone: kept
    on_files.close()
    on_first.close()
    e.worker.c.shutdown()
