"""The worker's loads run on their own thread (kvstore.integrations.vllm_loader) under vLLM 0.33's real
Scheduler, with a real daemon: beside the step's forward pass, ended and reported with the step. See
test_connector.py for the engine these tests step."""

from __future__ import annotations

import threading
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


def test_a_load_runs_beside_its_steps_forward_pass_and_is_reported_with_the_step(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L's 128 tokens are in kvstore; its load waits on the daemon while the step's forward pass
    computes "other" (on the engine's thread), and the step's end waits for it: it is reported in
    that step, L is scheduled from token 128 the next, every loaded token where the kernels read it
    (checked by the worker), and nobody computed over its blocks meanwhile."""
    U, vcfg, ep = setup
    a = prompt(150, 71)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, filler, a)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    gate, waiting = gate_loads(e, monkeypatch)
    forward = e.worker.forward
    during: list[bool] = []

    def forward_while_loading(*args: Any, **kw: Any) -> None:
        during.append(not gate.is_set() and waiting == ["kvstore-load"])
        forward(*args, **kw)

    monkeypatch.setattr(e.worker, "forward", forward_while_loading)

    def release_later(meta: Any) -> None:
        assert wait_until(lambda: waiting == ["kvstore-load"], 10)  # on the loading thread
        threading.Timer(0.3, gate.set).start()  # the daemon answers once the forward pass ran

    e.during_load = release_later
    e.add(request(U, a, "L"))
    e.add(request(U, prompt(100, 72), "other", max_tokens=6))
    e.step()
    assert during and all(during)  # "other" computed while L's load waited
    assert e.reported[-1][0] == {"L"} and not e.worker.in_flight  # reported with its step
    e.during_load = None
    e.step()
    assert e.requests["L"].num_computed_tokens >= 128  # scheduled from its loaded tokens
    e.run()
    assert not e.over_missing and all(r.is_finished() for r in e.requests.values())
    assert e.worker.loads == [("L", 0, 128)] and e.worker.c.loaded_tokens == 128
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


def test_a_step_that_only_loads_is_not_idle(
    setup: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step whose only work is a load computes no token, and is no idle step: it does not wait for
    other requests' saves (a hit is not scheduled later for them). A step with neither is idle."""
    U, vcfg, ep = setup
    a = prompt(150, 78)
    filler = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    stored_then_forgotten(U, filler, a)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.add(request(U, a, "L"))
    meta = e.step()
    assert [t.req_id for t in meta.loads] == ["L"] and not meta.idle
    e.run()
    assert e.step().idle  # nothing left: an idle step
    e.worker.c.shutdown()
    filler.worker.c.shutdown()
