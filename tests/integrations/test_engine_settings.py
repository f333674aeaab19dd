"""What the engine connectors share, without an engine: vLLM's connector settings, namespaces and
clients (kvstore.integrations.vllm_settings, vllm_clients) against a real daemon, and a busy daemon
on an engine's critical path (kvstore.connection)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.connection import Connection
from kvstore.errors import ClientClosed, ConfigError
from kvstore.integrations.vllm_clients import Clients, VariantRefused
from kvstore.integrations.vllm_settings import Settings, Variant, namespace_revision
from kvstore.integrations.weights import Weights
from kvstore.layout import KVLayout
from kvstore.wire.errors import ServerError
from kvstore.wire.messages import Ping
from tests.hardening.conftest import RefusingDaemon, daemons, endpoint_of, wait_until, write_config  # noqa: F401 - a fixture

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)


def vllm_config(**model: Any) -> Any:
    """The parts of a VllmConfig the settings read."""
    mc = SimpleNamespace(
        **{"model": "tiny-model", "revision": None, "quantization": None, "hf_overrides": None, **model}
    )
    return SimpleNamespace(
        model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    )


# ---------------------------------------------------------------------- settings


def test_flags_and_numbers_given_as_text_mean_what_they_say() -> None:
    s = Settings.from_extra({"load": "false", "save": "true", "timeout": "2.5", "block_tokens": "32"})
    assert (s.load, s.save, s.timeout, s.block_tokens) == (False, True, 2.5, 32)
    assert Settings.from_extra({"save_outputs": False, "shared_memory": "off"}).shared_memory is False
    assert Settings.from_extra(None) == Settings()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"load": "nope"}, "'load'.*true or false"),
        ({"save": 2}, "'save'.*true or false"),
        ({"timeout": "five"}, "'timeout'.*number"),
        ({"timeout": 0}, "'timeout'.*positive"),
        ({"timeout": True}, "'timeout'.*number"),
        ({"block_tokens": 2.5}, "'block_tokens'.*positive integer"),
        ({"block_tokens": "inf"}, "'block_tokens'.*positive integer"),
        ({"max_variants": 0}, "'max_variants'.*positive integer"),
        ({"endpoint": "localhost:5555"}, "'endpoint'.*tcp://host:port"),
        ({"endpoint": "tcp://*:5555"}, "'endpoint'.*where a daemon listens \\(every interface\\)"),
        ({"endpoint": "tcp://127.0.0.1:0"}, "'endpoint'.*where a daemon listens \\(any free port\\)"),
        ({"tenant": 7}, "'tenant'.*string"),
    ],
)
def test_a_setting_of_the_wrong_kind_is_refused_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_extra(extra)


# ---------------------------------------------------------------------- namespaces


@pytest.fixture
def daemon(daemons: Any, tmp_path: Path) -> Any:  # noqa: F811 - the fixture imported above
    """A real daemon whose tenants may register 3 namespaces each."""
    return daemons(write_config(tmp_path, server={"max_namespaces_per_tenant": 3}))


def prefix(n: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 30000, (n,), generator=g).numpy().astype(np.uint32)
    return tokens, torch.randn(LAYOUT.shape(n), generator=g).to(torch.float16)


def test_quantized_weights_or_other_hf_overrides_never_share_the_models_blocks(daemon: Any) -> None:
    plain = vllm_config()
    others = [
        vllm_config(quantization="fp8"),
        vllm_config(hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ]
    revisions = {namespace_revision(c, (0, 0), Variant()) for c in [plain, *others]}
    assert len(revisions) == 3
    # the same overrides, another dict order: the same namespace
    again = vllm_config(hf_overrides={"rope_scaling": {"factor": 2.0, "rope_type": "dynamic"}})
    assert namespace_revision(again, (0, 0), Variant()) in revisions

    settings = Settings(endpoint=daemon.endpoint, timeout=10.0)
    tokens, kv = prefix(16, 1)
    writer = Clients(plain, settings, LAYOUT, (0, 0))
    try:
        assert writer.get(Variant(), "save").put(tokens, kv).stored == 4
        for cfg in others:
            reader = Clients(cfg, settings, LAYOUT, (0, 0))
            try:
                assert reader.get(Variant(), "lookup").lookup(tokens).matched_tokens == 0
            finally:
                reader.close()
        assert writer.get(Variant(), "lookup").lookup(tokens).matched_tokens == 16
    finally:
        writer.close()


def test_variants_past_max_variants_or_the_namespace_quota_are_refused_not_failed(daemon: Any) -> None:
    """Every cache salt takes a namespace from the tenant's quota for good: past max_variants the
    connector uses none, and past the daemon's quota it stops asking (each refusal is a miss)."""
    salts = [Variant(salt=f"{i:032x}") for i in range(4)]
    few = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, max_variants=1), LAYOUT, (0, 0))
    try:
        few.get(salts[0], "lookup")
        few.get(salts[0], "save")  # the same variant for another purpose: no new namespace
        with pytest.raises(VariantRefused, match="max_variants"):
            few.get(salts[1], "lookup")
        few.get(Variant(), "lookup")  # the model's own namespace is always there
    finally:
        few.close()
    # the quota is 3: the plain namespace and salts[0] took 2
    many = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, max_variants=8), LAYOUT, (0, 0))
    try:
        many.get(salts[2], "lookup")
        with pytest.raises(VariantRefused, match="quota"):
            many.get(salts[3], "lookup")
        t0 = time.perf_counter()
        with pytest.raises(VariantRefused):  # not asked again
            many.get(Variant(salt="f" * 32), "lookup")
        assert time.perf_counter() - t0 < 0.05
        tokens, kv = prefix(8, 2)
        assert many.get(salts[2], "save").put(tokens, kv).stored == 2  # the variants in use go on
    finally:
        many.close()


def test_a_cached_client_is_had_at_once_while_a_new_one_waits_for_a_daemon_gone_quiet(
    daemon: Any,
) -> None:
    """The save thread makes its client while the daemon does not answer: its hello waits three
    timeouts (a save's retries). The engine's thread meanwhile gets its load client, made earlier,
    at once: a load is never held up by another purpose's hello."""
    clients = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, timeout=1.0), LAYOUT, (0, 0))
    try:
        load = clients.get(Variant(), "load")
        daemon.proc.kill()  # gone: nothing answers from now on
        daemon.wait_exit()
        saving: list[BaseException] = []
        t0 = time.perf_counter()

        def save() -> None:
            try:
                clients.get(Variant(), "save")
            except Exception as e:
                saving.append(e)

        thread = threading.Thread(target=save)
        thread.start()
        time.sleep(0.2)  # the save client is saying hello by now
        waited = []
        for _ in range(5):
            t1 = time.perf_counter()
            assert clients.get(Variant(), "load") is load
            waited.append(time.perf_counter() - t1)
        assert thread.is_alive() and max(waited) < 0.05
        thread.join()
        assert saving and time.perf_counter() - t0 >= 2.5  # the save's hello did time out
    finally:
        clients.close()


def test_two_threads_making_the_same_client_at_once_get_one_and_take_one_variant(daemon: Any) -> None:
    salt = Variant(salt="e" * 32)
    clients = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, max_variants=1), LAYOUT, (0, 0))
    try:
        start = threading.Barrier(4)
        got: list[Any] = []

        def make() -> None:
            start.wait()
            got.append(clients.get(salt, "lookup"))

        threads = [threading.Thread(target=make) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 4 and all(c is got[0] for c in got)
        assert got[0].ping()  # the one kept is open: the others' were closed, not it
        with pytest.raises(VariantRefused, match="max_variants"):  # the salt counted once
            clients.get(Variant(salt="f" * 32), "lookup")
    finally:
        clients.close()


def test_the_least_recently_used_client_is_closed_without_waiting_for_its_call(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_CLIENTS the least recently used client goes: its close waits for the call another
    thread runs on it (a save and its retries), and the thread that made the new client does not."""
    import kvstore.integrations.vllm_clients as vs

    monkeypatch.setattr(vs, "MAX_CLIENTS", 2)
    clients = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, max_variants=4), LAYOUT, (0, 0))
    try:
        save = clients.get(Variant(), "save")
        clients.get(Variant(), "lookup")
        in_call, go = threading.Event(), threading.Event()
        real_ping = save.ping

        def slow_ping() -> Any:
            with save._lock:  # what a call holds while it runs
                in_call.set()
                assert go.wait(30)
                return real_ping()

        save.ping = slow_ping  # type: ignore[method-assign]
        caller = threading.Thread(target=save.ping)
        caller.start()
        assert in_call.wait(30)
        t0 = time.perf_counter()
        clients.get(Variant(salt="a" * 32), "load")  # a third client: the save client goes
        assert time.perf_counter() - t0 < 1.0
        go.set()
        caller.join(30)
        assert wait_until(lambda: save._conn.sock is None, 10)  # closed once its call was over
    finally:
        go.set()
        clients.close()


def test_a_client_made_while_the_clients_close_is_closed_not_kept(daemon: Any) -> None:
    """The save thread says hello outside the lock; the engine shuts down meanwhile: the client it
    made is closed at once, not kept open for good, and no new one is made after."""
    clients = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, timeout=2.0), LAYOUT, (0, 0))
    daemon.proc.send_signal(signal.SIGSTOP)  # the save client's hello waits
    made: list[Any] = []
    real = clients._connect

    def connect(variant: Any, purpose: str) -> Any:
        c = real(variant, purpose)
        made.append(c)
        return c

    clients._connect = connect  # type: ignore[method-assign]
    outcome: list[BaseException] = []

    def save() -> None:
        try:
            clients.get(Variant(), "save")
        except BaseException as e:  # noqa: BLE001 - looked at below
            outcome.append(e)

    thread = threading.Thread(target=save)
    try:
        thread.start()
        time.sleep(0.3)  # saying hello by now
        clients.close()  # the engine shuts down
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    thread.join(30)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ClientClosed), outcome
    assert len(made) == 1 and made[0]._conn.sock is None  # closed: its socket is gone
    assert clients._clients == {}
    with pytest.raises(ClientClosed):
        clients.get(Variant(), "lookup")


# ---------------------------------------------------------------------- busy


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[tuple[RefusingDaemon, str]]:
    endpoint = f"ipc://{tmp_path}/busy.sock"
    d = RefusingDaemon(endpoint)
    yield d, endpoint
    d.close()


def test_a_busy_daemon_is_a_miss_at_once_for_a_connection_that_does_not_wait(busy: Any) -> None:
    daemon, endpoint = busy
    conn = Connection(endpoint, timeout=2.0, retries=2, namespace=None, wait_when_busy=False)
    try:
        t0 = time.perf_counter()
        with pytest.raises(ServerError, match="over the in-flight budget"):
            conn.call(Ping(), idempotent=True)
        assert time.perf_counter() - t0 < 0.5 and daemon.requests == 1
    finally:
        conn.close()


def test_a_busy_daemon_is_asked_again_with_backoff_within_the_timeout_by_a_save(busy: Any) -> None:
    daemon, endpoint = busy
    conn = Connection(endpoint, timeout=1.0, retries=2, namespace=None)
    try:
        t0 = time.perf_counter()
        with pytest.raises(ServerError, match="over the in-flight budget"):
            conn.call(Ping(), idempotent=True)
        took = time.perf_counter() - t0
        # sent again after 0.05, 0.1, 0.2, 0.4 s ...: a handful of times, not in a tight loop
        assert 1.0 <= took < 2.5 and 3 <= daemon.requests <= 8
    finally:
        conn.close()


def lora_request(adapter: Path, int_id: int = 1, name: str = "sql") -> Any:
    lora = SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(adapter))
    return SimpleNamespace(lora_request=lora, cache_salt=None)


def retrain(adapter: Path) -> None:
    """New weights under the adapter's old path and name (a time of their own: the test is fast)."""
    (adapter / "adapter_model.safetensors").write_bytes(b"weights v2, retrained")
    os.utime(adapter / "adapter_model.safetensors", ns=(1, 1))


def test_a_lora_adapter_is_named_by_its_weights_not_its_load_order(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights v1")
    weights = Weights()
    first = Variant.of(lora_request(adapter, 1), weights).lora
    assert (
        Variant.of(lora_request(adapter, 7), weights).lora == first
    )  # loaded in another order: the same K/V
    retrain(adapter)
    assert (
        Variant.of(lora_request(adapter, 1), weights).lora != first
    )  # the same name with other weights: other K/V
    assert Variant.of(lora_request(adapter, 1), weights).lora.startswith("sql@")
    assert Variant.of(lora_request(adapter, 1), weights).adapter == "sql"


def test_an_adapter_whose_files_change_while_vllm_serves_it_gets_no_namespace(
    daemon: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM keeps the weights it loaded until it reloads them (load_inplace) or restarts, and nothing
    # says when: the new files may not name what it computes, nor the old ones what it computes next
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights v1")
    clients = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, timeout=10.0), LAYOUT, (0, 0))
    try:
        before = clients.variant(lora_request(adapter))
        tokens, kv = prefix(8, 3)
        assert clients.get(before, "save").put(tokens, kv).stored == 2
        assert not clients.adapter_changed(before)
        assert clients.get(before, "lookup").lookup(tokens).matched_tokens == 8  # a client kept for it
        retrain(adapter)
        after = clients.variant(lora_request(adapter))
        assert clients.adapter_changed(after) and clients.adapter_changed(before)
        for v in (after, before):  # the old name too: vLLM may have reloaded the new files by now
            with pytest.raises(VariantRefused, match="'sql' changed"):
                clients.get(v, "lookup")
        assert caplog.text.count("files of LoRA adapter 'sql' changed") == 1
    finally:
        clients.close()
    again = Clients(vllm_config(), Settings(endpoint=daemon.endpoint, timeout=10.0), LAYOUT, (0, 0))
    try:  # a restart loads the new files, under their own name: nothing of the old weights is found
        assert not again.adapter_changed(after)
        assert again.get(after, "lookup").lookup(tokens).matched_tokens == 0
    finally:
        again.close()


def plain(clients: Clients) -> Variant:
    """The variant of a request with no adapter and no salt, as the connector names it."""
    return clients.variant(SimpleNamespace(lora_request=None, cache_salt=None))


def test_a_local_model_rewritten_between_restarts_does_not_share_the_old_weights_blocks(
    daemon: Any, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"base weights v1")
    settings = Settings(endpoint=daemon.endpoint, timeout=10.0)
    tokens, kv = prefix(8, 4)
    old = Clients(vllm_config(model=str(model)), settings, LAYOUT, (0, 0))
    try:
        assert old.get(plain(old), "save").put(tokens, kv).stored == 2
        (model / "model.safetensors").write_bytes(b"base weights v2")  # rewritten while it serves:
        os.utime(model / "model.safetensors", ns=(1, 1))
        assert old.get(plain(old), "lookup").lookup(tokens).matched_tokens == 8  # it serves v1 still
    finally:
        old.close()
    new = Clients(vllm_config(model=str(model)), settings, LAYOUT, (0, 0))  # restarted on v2
    try:
        assert new.get(plain(new), "lookup").lookup(tokens).matched_tokens == 0
    finally:
        new.close()
