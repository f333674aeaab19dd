"""The worker's loads run on their own thread (kvstore.integrations.vllm_loader) under vLLM 0.33's real
Scheduler, with a real daemon: the engine steps on while a load waits on the daemon, and learns of it
when it is done. See test_connector.py for the engine these tests step."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvstore.integrations.vllm_settings import Variant
from tests.engines.vllm.test_connector import (
    BS,
    Engine,
    assert_holds,
    prompt,
    request,
    setup,  # noqa: F401  (a fixture)
    stored_then_forgotten,
)
from tests.hardening.conftest import wait_until


def gate_loads(e: Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """Every load of ``e`` waits (on the loading thread) until the returned event is set, as behind a
    daemon slow to answer; the list records each load as it starts waiting."""
    clients = e.worker.c._clients
    load = clients.get(Variant(base=clients.base), "load")
    real = load.get_into
    gate, waiting = threading.Event(), []

    def slow(*args: Any, **kw: Any) -> Any:
        waiting.append(threading.current_thread().name)
        assert gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(load, "get_into", slow)
    return gate, waiting


def test_the_engine_steps_on_while_a_load_waits_on_the_daemon_and_schedules_it_once_done(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L's 128 tokens are in kvstore, and its load waits on the daemon. Meanwhile the engine's steps
    run on (none waits for the load), "other" computes, and L waits (WAITING_FOR_REMOTE_KVS) with its
    blocks written by nobody. Once the load ends it is reported, L is scheduled from token 128 with
    every loaded token where the kernels read it (checked by the worker), and saves the rest."""
    from vllm.v1.request import RequestStatus

    U, vcfg, ep = setup
    a = prompt(150, 71)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, filler, a)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.worker.settle = False
    gate, waiting = gate_loads(e, monkeypatch)
    e.add(request(U, a, "L"))
    e.add(request(U, prompt(100, 72), "other", max_tokens=6))
    t0 = time.monotonic()
    e.step()
    assert wait_until(lambda: waiting == ["kvstore-load"], 10)  # on the loading thread, not the engine's
    for _ in range(4):
        e.step()
    assert time.monotonic() - t0 < 10  # (each step would wait 30 s for the gate otherwise)
    assert e.requests["L"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert e.requests["other"].num_computed_tokens >= 100
    assert e.worker.in_flight and not e.over_missing
    gate.set()
    e.run()
    assert not e.over_missing and all(r.is_finished() for r in e.requests.values())
    assert e.worker.loads == [("L", 0, 128)] and e.worker.c.loaded_tokens == 128
    assert not e.worker.in_flight  # reported done, its tokens checked
    assert_holds(check, a, 128)
    filler.worker.c.shutdown()
    e.worker.c.shutdown()


def test_caches_put_to_sleep_wait_for_the_load_under_way_and_the_queued_ones_end_failed(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's sleep mode discards the KV caches' memory once unregister_kv_caches returns: the load
    writing into them (L, waiting on the daemon) is waited for, and M, queued behind it, writes
    nothing. Both are reported done; all of M's blocks failed, none of L's."""
    U, vcfg, ep = setup
    a, b = prompt(150, 73), prompt(150, 74)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    stored_then_forgotten(U, filler, a)
    filler.add(request(U, b[:128], "b"))
    filler.run()
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.worker.settle = False
    gate, waiting = gate_loads(e, monkeypatch)
    slept = threading.Event()
    outcome: dict[str, Any] = {}

    def sleep_while_loading(meta: Any) -> None:
        assert [t.req_id for t in meta.loads] == ["L", "M"]
        assert wait_until(lambda: waiting, 10)

        def sleep() -> None:
            e.worker.c.unregister_kv_caches()
            slept.set()

        threading.Thread(target=sleep, daemon=True).start()
        assert not slept.wait(0.5)  # L's copies into the caches may still come
        gate.set()
        assert slept.wait(10)
        outcome["loads"] = {t.req_id: t for t in meta.loads}
        e.during_load = None

    e.during_load = sleep_while_loading
    e.add(request(U, a, "L"))
    e.add(request(U, b, "M"))
    e.step()
    assert outcome and waiting == ["kvstore-load"]  # M never reached the daemon
    l_load, m_load = outcome["loads"]["L"], outcome["loads"]["M"]
    assert e.reported[-1] == ({"L", "M"}, set(m_load.block_ids[: 128 // BS]))  # L's tokens checked
    e.run()  # M computes all of its prompt, L the rest of its
    assert not e.over_missing and all(r.is_finished() for r in e.requests.values())
    assert e.worker.c.loaded_tokens == 128 and l_load.end == 128
    e.worker.c.shutdown()
    filler.worker.c.shutdown()


def test_a_request_aborted_while_its_load_waits_in_the_queue_is_reported_without_loading(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L's load waits on the daemon, M's is queued behind it; M is aborted. M's load is ended at the
    next report without reaching the daemon (vLLM gives its blocks back then), L's runs on."""
    from vllm.v1.request import RequestStatus

    U, vcfg, ep = setup
    a, b = prompt(150, 75), prompt(150, 76)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    stored_then_forgotten(U, filler, a)
    filler.add(request(U, b[:128], "b"))
    filler.run()
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.worker.settle = False
    gate, waiting = gate_loads(e, monkeypatch)
    e.add(request(U, a, "L"))
    e.add(request(U, b, "M"))
    e.step()
    assert wait_until(lambda: len(waiting) == 1, 10)
    e.sched.finish_requests("M", RequestStatus.FINISHED_ABORTED)
    e.step()
    assert e.reported[-1][0] == {"M"}  # ended, nothing written: its blocks go back to vLLM
    assert "M" not in e.sched.requests
    gate.set()
    e.run()
    assert len(waiting) == 1 and e.worker.c.loaded_tokens == 128  # only L's load reached the daemon
    assert not e.over_missing and e.requests["L"].is_finished()
    e.worker.c.shutdown()
    filler.worker.c.shutdown()


def test_where_vllm_does_not_say_when_its_caches_sleep_loads_end_in_their_step(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM before 0.33 discards its caches in sleep mode without calling unregister_kv_caches: with
    sleep mode on there, each load runs within its step, on the engine's thread, and is reported in
    that step (no load outlives the step that could be the last before a sleep)."""
    U, vcfg, ep = setup
    a = prompt(150, 77)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, filler, a)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.worker.settle = False
    monkeypatch.setattr(e.worker.c, "_sync_loads", True)
    gate, waiting = gate_loads(e, monkeypatch)
    gate.set()
    e.add(request(U, a, "L"))
    e.step()
    assert waiting == ["MainThread"] and e.reported[-1][0] == {"L"}
    e.run()
    assert not e.over_missing and e.worker.c.loaded_tokens == 128
    assert_holds(check, a, 128)
    e.worker.c.shutdown()
    filler.worker.c.shutdown()
