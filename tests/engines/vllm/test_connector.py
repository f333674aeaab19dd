"""kvstore's vLLM connector under vLLM 0.33's real Scheduler, Request and ModelRunnerOutput, with a
real daemon. The "forward pass" writes known K/V into worker caches laid out the way vLLM's CPU
("vec" kernels: per head K transposed, then V) and FlashAttention backends lay them out, so every
loaded token is checked where the kernels read it, and what kvstore holds is checked as K and V."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError, LayoutError
from kvstore.integrations import vllm as connector
from kvstore.integrations import vllm_layout
from kvstore.integrations.vllm_settings import Variant
from kvstore.wire.errors import ServerError
from tests.hardening.conftest import endpoint_of, wait_until, write_config

T = 32  # kvstore's block size; vLLM's is 16 here
BS = 16
NUM_BLOCKS = 96


def expected(tokens: list[int], start: int, end: int, layers: int, heads: int, dim: int) -> torch.Tensor:
    """What the fake forward pass computes for positions start..end-1: [L, 2, n, H, D], bf16."""
    tok = torch.tensor(tokens[start:end], dtype=torch.float32)
    pos = torch.arange(start, end, dtype=torch.float32)
    layer = torch.arange(layers, dtype=torch.float32).view(-1, 1)
    base = (tok * 31 + pos * 17 + layer * 13) % 251  # [L, n]
    k = base.view(layers, -1, 1, 1) + torch.arange(heads).view(1, 1, -1, 1) * 0.5 + torch.zeros(dim)
    return torch.stack([k, -k], dim=1).to(torch.bfloat16)


class Worker:
    """The worker side of one engine: per-layer caches shaped like vLLM 0.33's, a worker connector."""

    def __init__(
        self, vllm_config: Any, backend: str, monkeypatch: pytest.MonkeyPatch, isa: str = "vec"
    ) -> None:
        kv_config = None
        self.c = connector.KVStoreConnector(vllm_config, connector.KVConnectorRole.WORKER, kv_config)
        L = self.c.layout
        self.layout = L
        self.backend = backend
        names = [f"model.layers.{i}.self_attn.attn" for i in range(L.num_layers)]
        self.caches = {
            n: torch.zeros(NUM_BLOCKS, L.num_kv_heads, BS, 2 * L.head_dim, dtype=torch.bfloat16)
            for n in names
        }
        monkeypatch.setattr(vllm_layout, "attention_backends", lambda _cfg: dict.fromkeys(names, backend))
        monkeypatch.setattr(vllm_layout, "cpu_isa", lambda *_: isa)
        self.c.register_kv_caches(self.caches)
        self.loads: list[tuple[str, int, int]] = []
        self.in_flight: dict[str, Any] = {}  # request -> its load (a Transfer) not reported done yet

    def start_step(self, meta: Any, before_load: Any = None) -> None:
        """The worker's side of a step up to its forward pass, as vLLM's model runner orders it: the
        step's metadata bound, preemptions handled, ``before_load()`` (a test's hook, when the step
        loads), the loads started. The loads are recorded."""
        self.c.bind_connector_metadata(meta)
        self.c.handle_preemptions(meta)
        if before_load is not None and meta.loads:
            before_load()
        self.c.start_load_kv(None)
        self.loads.extend((t.req_id, t.start, t.end) for t in meta.loads)
        self.in_flight.update((t.req_id, t) for t in meta.loads)

    def loading(self) -> set[int]:
        """vLLM's blocks that loads not reported done yet write into."""
        return {b for t in self.in_flight.values() for b in t.block_ids[t.start // BS : -(-t.end // BS)]}

    def finish_step(
        self, finished: set[str], finish_first: bool = False
    ) -> tuple[Any, Any, set[int], list[Any]]:
        """The worker's side of a step after its forward pass, as vLLM's model runner orders it: saves
        queued, what finished asked for (``finish_first``: in the other order, as with speculative
        decoding), then the blocks whose load failed. Returns (finished_sending, finished_recving,
        failed blocks, the loads reported done); every token of those loads not failed is checked
        where the kernels read it."""
        if finish_first:
            sending, recving = self.c.get_finished(finished)
            self.c.wait_for_save()
        else:
            self.c.wait_for_save()
            sending, recving = self.c.get_finished(finished)
        errors = set(self.c.get_block_ids_with_load_errors())
        done = [self.in_flight.pop(rid) for rid in recving or ()]
        L = self.layout
        for t in done:
            if not set(t.block_ids) & errors:
                want = expected(t.tokens, t.start, t.end, L.num_layers, L.num_kv_heads, L.head_dim)
                assert torch.equal(self.kv_at(t.block_ids, t.start, t.end), want)
        return sending, recving, errors, done

    def kv_at(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Tokens start..end-1 as the attention kernels would read them: [L, 2, n, H, D]."""
        L = self.layout
        pos = torch.arange(start, end)
        blk = torch.tensor(block_ids)[pos // BS]
        off = pos % BS
        out = []
        for name in sorted(self.caches, key=vllm_layout.layer_index):
            c = self.caches[name]
            if self.backend == "CPU_ATTN":  # per head: K transposed [D, bs], then V [bs, D]
                halves = c.view(NUM_BLOCKS, L.num_kv_heads, 2, BS * L.head_dim)
                k = halves[:, :, 0].view(NUM_BLOCKS, L.num_kv_heads, L.head_dim, BS)[blk, :, :, off]
                v = halves[:, :, 1].view(NUM_BLOCKS, L.num_kv_heads, BS, L.head_dim)[blk, :, off]
            else:  # FlashAttention: K and V side by side in the last dimension
                k, v = c[blk, :, off, : L.head_dim], c[blk, :, off, L.head_dim :]
            out.append(torch.stack([k, v]))
        return torch.stack(out)

    def forward(
        self, block_ids: list[int], tokens: list[int], start: int, end: int, over_missing: bool = False
    ) -> None:
        """Write what the model computes for positions start..end-1; ``over_missing``: computed over
        blocks whose load failed, so wrong (as a real model's would be)."""
        L = self.layout
        want = expected(tokens, start, end, L.num_layers, L.num_kv_heads, L.head_dim)
        if over_missing:
            want = want + 7
        pos = torch.arange(start, end)
        blk = torch.tensor(block_ids)[pos // BS]
        off = pos % BS
        for i, name in enumerate(sorted(self.caches, key=vllm_layout.layer_index)):
            c = self.caches[name]
            if self.backend == "CPU_ATTN":
                halves = c.view(NUM_BLOCKS, L.num_kv_heads, 2, BS * L.head_dim)
                halves[:, :, 0].view(NUM_BLOCKS, L.num_kv_heads, L.head_dim, BS)[blk, :, :, off] = want[i, 0]
                halves[:, :, 1].view(NUM_BLOCKS, L.num_kv_heads, BS, L.head_dim)[blk, :, off] = want[i, 1]
            else:
                c[blk, :, off, : L.head_dim] = want[i, 0]
                c[blk, :, off, L.head_dim :] = want[i, 1]


class Engine:
    """vLLM's scheduler and one worker, stepped the way the engine core steps them."""

    def __init__(
        self,
        U: Any,
        vllm_config: Any,
        backend: str,
        monkeypatch: pytest.MonkeyPatch,
        finish_first: bool = False,
    ) -> None:
        """``finish_first``: the workers are asked what finished before they save (vLLM's order with
        speculative decoding, which saves after the draft model)."""
        self.U = U
        self.finish_first = finish_first
        self.sched = U.create_scheduler(vllm_config, num_blocks=NUM_BLOCKS)
        self.worker = Worker(vllm_config, backend, monkeypatch)
        self.requests: dict[str, Any] = {}
        self.before_load: Any = None  # a hook run between scheduling and loading
        self.during_load: Any = None  # a hook run after the loads were started, before the forward pass
        self.reported: list[tuple[set[str], set[int]]] = []  # each step's loads done, and failed blocks
        self.sent: list[set[str]] = []  # each step's finished requests whose saves are done
        self.before_output: Any = None  # a hook run after the workers' step, before vLLM takes its output
        self.over_missing: list[str] = []  # requests that computed over a failed load, once per step

    def add(self, req: Any) -> None:
        self.requests[req.request_id] = req
        self.sched.add_request(req)

    def step(self) -> Any:
        so = self.sched.schedule()
        w = self.worker.c
        meta = so.kv_connector_metadata
        self.worker.start_step(meta, self.before_load)
        if self.during_load is not None and meta.loads:
            self.during_load(meta)
        loading = self.worker.loading()
        scheduled, forwards = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            ids = list(self.sched.kv_cache_manager.get_block_ids(rid)[0])
            start = req.num_computed_tokens - n  # the scheduler has counted this step's tokens already
            forwards.append((rid, ids, list(req.all_token_ids), start, start + n))
            scheduled.append(req)
        for rid, ids, tokens, start, end in forwards:
            # computed over blocks a load has not written yet (its own, or ones it shares)
            over_missing = bool(set(ids) & loading)
            self.worker.forward(ids, tokens, start, end, over_missing)
            if over_missing:
                self.over_missing.append(rid)
        sending, recving, errors, _ = self.worker.finish_step(so.finished_req_ids, self.finish_first)
        self.reported.append((set(recving or ()), errors))
        self.sent.append(set(sending or ()))
        for rid, ids, _, _, _ in forwards:  # or over blocks whose load failed in this step
            if set(ids) & errors and rid not in self.over_missing:
                self.over_missing.append(rid)
        w.clear_connector_metadata()
        out = self.U.create_model_runner_output(
            scheduled, finished_sending=sending, finished_recving=recving, invalid_block_ids=errors or None
        )
        if self.before_output is not None:
            self.before_output(meta)
        self.sched.update_from_output(so, out)
        return meta

    def run(self, timeout: float = 60.0) -> None:
        """Step until every request is done and its blocks are back (saves still running keep a
        finished request's blocks: the engine core keeps stepping until the workers report them)."""
        deadline = time.monotonic() + timeout
        while self.sched.has_unfinished_requests() or self.sched.has_finished_requests():
            if time.monotonic() > deadline:
                reqs = {r: (q.status, q.num_computed_tokens) for r, q in self.requests.items()}
                raise AssertionError(f"the engine did not finish its requests: {reqs}")
            if not self.step().loads and not self.sched.has_unfinished_requests():
                time.sleep(0.01)
        self.U.assert_scheduler_empty(self.sched)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def request(U: Any, tokens: list[int], rid: str, max_tokens: int = 3, salt: str | None = None) -> Any:
    """A vLLM Request for ``tokens``, made the way the helpers make theirs (its block hashes are
    vLLM's own prefix-cache keys)."""
    U.create_request(num_tokens=1)  # the helpers' one-time hashing set-up
    params = U.SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, U.EOS_TOKEN_ID)
    return U.Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=U.get_request_block_hasher(BS, U.sha256),
        cache_salt=salt,
    )


@pytest.fixture
def setup(daemons: Any, tmp_path: Path, vllm_utils: Any, model_dir: Path) -> Any:
    return engine_setup(daemons, tmp_path, vllm_utils, model_dir)


def engine_setup(daemons: Any, tmp_path: Path, vllm_utils: Any, model_dir: Path, **server: Any) -> Any:
    """A daemon (with ``server`` settings) and a vLLM config of the test model using the connector."""
    cfg = write_config(
        tmp_path,
        server=server,
        hbm={"capacity": "128MiB"},
        ram={"capacity": "64MiB", "codec": "raw"},
        nvme={"capacity": "1GiB", "codec": "raw"},
        policy={"page_bytes": "512KiB"},
    )
    daemons(cfg)
    ep = endpoint_of(cfg)
    vcfg = vllm_utils.create_vllm_config(
        model=str(model_dir),
        block_size=BS,
        max_num_batched_tokens=96,  # chunked prefill: a prompt takes several steps
        dtype="bfloat16",
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": ep, "block_tokens": T},
    )
    return vllm_utils, vcfg, ep


def engine_and_daemon(
    daemons: Any, tmp_path: Path, vllm_utils: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Engine, Any]:
    """engine_setup's daemon and an Engine (FLASH_ATTN) on it: (vllm_utils, the engine, the daemon's
    process, for a test that stops it)."""
    started: list[Any] = []

    def start(config: Path, **kw: Any) -> Any:
        started.append(daemons(config, **kw))
        return started[-1]

    U, vcfg, _ = engine_setup(start, tmp_path, vllm_utils, model_dir)
    return U, Engine(U, vcfg, "FLASH_ATTN", monkeypatch), started[0].proc


def operator(ep: str) -> KVStoreClient:
    return KVStoreClient(ep, timeout=10.0)


def check_client(e: Engine) -> KVStoreClient:
    """The connector's own client of the engine's namespace, to see what kvstore holds."""
    clients = e.worker.c._clients
    return clients.get(Variant(base=clients.base), "check")


def assert_holds(check: KVStoreClient, tokens: list[int], n: int) -> None:
    """kvstore holds exactly the first ``n`` tokens of ``tokens``, K and V as the model computed them."""
    assert wait_until(lambda: check.lookup(tokens).matched_tokens == n, 10)
    stored = check.get(tokens)
    L = check._ns().layout
    assert stored.kv is not None
    assert torch.equal(stored.kv, expected(tokens, 0, n, L.num_layers, L.num_kv_heads, L.head_dim))


def stored_then_forgotten(U: Any, e: Engine, tokens: list[int]) -> KVStoreClient:
    """``e`` computes and saves the first 128 tokens of ``tokens`` (two blocks), then drops its own
    prefix cache: the next request of ``tokens`` loads them from kvstore. Returns check_client(e)."""
    e.add(request(U, tokens[:128], "first"))
    e.run()
    check = check_client(e)
    assert wait_until(lambda: check.lookup(tokens).matched_tokens == 128, 10)
    assert e.sched.reset_prefix_cache()
    return check


def refuse_loads(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every load of ``e`` is turned away by the daemon from now on (busy); returns the list that
    records each refusal."""
    clients = e.worker.c._clients
    load = clients.get(Variant(base=clients.base), "load")
    refused: list[bool] = []

    def busy(*args: Any, **kw: Any) -> Any:
        refused.append(True)
        raise ServerError("busy", "injected: the daemon turns the load away")

    monkeypatch.setattr(load, "get_into", busy)
    return refused


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_prompts_saved_by_one_engine_load_into_another_where_the_kernels_read_them(
    setup: Any, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    U, vcfg, ep = setup
    a = prompt(150, 1)
    e1 = Engine(U, vcfg, backend, monkeypatch)
    e1.add(request(U, a, "a"))
    e1.run()
    assert not e1.worker.loads  # nothing held yet
    # prompt and the generated tokens fed back: 152 computed -> 4 blocks of 32 (kvstore's own
    # [L, 2, T, H, D], K and V as the model computed them)
    assert_holds(check_client(e1), a, 128)

    # vLLM's own prefix cache dropped: the same prompt comes back from kvstore
    assert e1.sched.reset_prefix_cache()
    e1.add(request(U, a, "a2"))
    e1.run()
    assert e1.worker.loads == [("a2", 0, 128)]

    # a second engine process shares a 100-token prefix: 3 blocks (96 tokens) come from kvstore
    e2 = Engine(U, vcfg, backend, monkeypatch)
    b = a[:100] + prompt(60, 2)
    e2.add(request(U, b, "b"))
    e2.run()
    assert e2.worker.loads == [("b", 0, 96)]

    # vLLM holds 6 blocks of 16 itself (b's prefix): kvstore adds from token 96, b's first 4 blocks
    # of 32 end at 128, so nothing more; a's 150 tokens: vLLM holds 96 of them (b), kvstore 128
    e2.add(request(U, a, "a3"))
    e2.run()
    assert e2.worker.loads == [("b", 0, 96), ("a3", 96, 128)]

    # another cache salt is another namespace: no hit, and its save is its own
    e2.add(request(U, a, "salted", salt="tenant-x"))
    e2.sched.reset_prefix_cache()
    e2.run()
    assert [x for x in e2.worker.loads if x[0] == "salted"] == []
    clients = e2.worker.c._clients
    salted = clients.get(clients.variant(request(U, a, "s", salt="tenant-x")), "check")
    assert wait_until(lambda: salted.lookup(a).matched_tokens == 128, 10)
    e1.worker.c.shutdown()
    e2.worker.c.shutdown()


def test_blocks_gone_between_lookup_and_load_are_recomputed_not_read(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    U, vcfg, ep = setup
    a = prompt(150, 3)
    e = Engine(U, vcfg, "CPU_ATTN", monkeypatch)
    e.add(request(U, a, "a"))
    e.run()
    assert e.sched.reset_prefix_cache()
    with operator(ep) as op:
        e.before_load = lambda: op.evict(all=True)  # after the scheduler counted on them
        e.add(request(U, a, "again"))
        e.run()
    assert e.worker.loads[-1] == ("again", 0, 128)
    # the scheduler was told, recomputed those tokens, and the request ran to its end
    req = e.requests["again"]
    assert req.is_finished() and req.num_computed_tokens >= 150
    e.worker.c.shutdown()


def test_a_step_whose_load_fails_stores_nothing_it_computed_over_the_missing_blocks(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that fails while kvstore still holds the blocks (the daemon busy, a short read, on any
    tensor-parallel rank): the step's forward pass computes the tokens after them over whatever the
    blocks held. vLLM learns of it after the step and recomputes; kvstore never keeps what that step
    computed (a block it holds is never written again, and would be served to every later request)."""
    U, vcfg, ep = setup
    a = prompt(300, 5)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, e, a)
    refused = refuse_loads(e, monkeypatch)
    e.add(request(U, a, "again"))
    e.run()
    assert refused and e.worker.loads[-1] == ("again", 0, 128)
    assert e.requests["again"].is_finished()
    assert_holds(check, a, 288)  # 300 + 2 fed back, recomputed: not what the failed step computed
    e.worker.c.shutdown()


@pytest.mark.parametrize("finish_first", [False, True], ids=["save-then-finished", "finished-then-save"])
def test_a_request_that_loads_and_finishes_in_one_step_saves_what_it_computed_after_the_load(
    setup: Any, monkeypatch: pytest.MonkeyPatch, finish_first: bool
) -> None:
    """Its save waits for a step after the load (a failed load must not be stored over): the request
    is gone by then, so its finish plans it, and its blocks are kept until the workers saved them."""
    U, vcfg, ep = setup
    a = prompt(200, 7)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch, finish_first)
    check = stored_then_forgotten(U, e, a)
    e.add(request(U, a, "again", max_tokens=1))  # 128 loaded, 72 computed and one token: one step
    e.run()
    assert e.worker.loads[-1] == ("again", 0, 128)
    assert_holds(check, a, 192)
    e.worker.c.shutdown()


def test_a_request_aborted_before_vllm_had_its_load_step_saves_nothing_computed_after_the_load(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling an abort (a stop string, a client gone) can come while the step that
    loaded the request is still in flight: what that step computed may stand on a failed load that
    vLLM has not heard of yet, and is not saved."""
    from vllm.v1.request import RequestStatus

    U, vcfg, ep = setup
    a = prompt(200, 9)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, e, a)
    refuse_loads(e, monkeypatch)

    def abort(meta: Any) -> None:
        if any(t.req_id == "again" for t in meta.loads):
            e.sched.finish_requests("again", RequestStatus.FINISHED_ABORTED)

    e.before_output = abort
    e.add(request(U, a, "again", max_tokens=5))
    e.run()
    assert e.worker.loads[-1] == ("again", 0, 128) and e.requests["again"].is_finished()
    time.sleep(0.5)  # a save would have landed by now
    assert check.lookup(a).matched_tokens == 128
    e.worker.c.shutdown()


def test_under_vllm_s_default_failure_policy_nothing_is_loaded_and_it_says_so(
    vllm_utils: Any, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kv_load_failure_policy "fail" (vLLM's default) fails the requests holding a block that could not
    be loaded: a daemon away or a block evicted since the lookup would cost requests, not a recompute."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.integrations.vllm import KVStoreConnector

    vcfg = vllm_utils.create_vllm_config(
        model=str(model_dir),
        block_size=BS,
        dtype="bfloat16",
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"endpoint": f"ipc://{tmp_path}/nobody.sock"},
    )
    assert vcfg.kv_transfer_config.kv_load_failure_policy == "fail"
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm"):
        c = KVStoreConnector(vcfg, KVConnectorRole.SCHEDULER)
    assert not c.settings.load and c.settings.save
    assert any('"kv_load_failure_policy": "recompute"' in r.getMessage() for r in caplog.records)
    assert c.get_num_new_matched_tokens(request(vllm_utils, prompt(100, 3), "r"), 0) == (0, False)


def test_a_daemon_that_is_not_there_costs_one_timeout_and_then_nothing(
    vllm_utils: Any, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vcfg = vllm_utils.create_vllm_config(
        model=str(model_dir),
        block_size=BS,
        max_num_batched_tokens=96,
        dtype="bfloat16",
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": f"ipc://{tmp_path}/nobody.sock", "timeout": 0.5},
    )
    e = Engine(vllm_utils, vcfg, "CPU_ATTN", monkeypatch)
    for i in range(3):
        e.add(request(vllm_utils, prompt(100, 4 + i), f"lonely-{i}"))
    e.run()
    assert e.worker.loads == [] and all(r.is_finished() for r in e.requests.values())
    scheduler = e.sched.connector
    assert scheduler._lookup_failures == 1  # the first lookup timed out once; the others were not sent
    assert scheduler.hook_seconds["lookup"] < 1.0
    e.worker.c.shutdown()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"endpiont": "ipc:///x"}, "unknown keys \\['endpiont'\\].*endpoint"),
        ({"timeout": "soon"}, "'timeout'.*number"),
        ({"load": "nope"}, "'load'.*true or false"),
        ({"endpoint": "kvstore.sock"}, "'endpoint'.*ipc://"),
    ],
)
def test_bad_settings_are_refused_at_start_naming_the_key(
    vllm_utils: Any, model_dir: Path, extra: dict[str, Any], message: str
) -> None:
    vcfg = vllm_utils.create_vllm_config(
        model=str(model_dir),
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    with pytest.raises(ConfigError, match=message):
        connector.KVStoreConnector(vcfg, connector.KVConnectorRole.SCHEDULER, None)


def test_attention_that_frees_blocks_behind_a_window_is_refused_at_start(
    vllm_utils: Any, model_dir: Path
) -> None:
    # vLLM frees a sliding window's blocks while the request runs: a save on the request's block list
    # would store whatever another request wrote there since, under this request's keys
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    vcfg = vllm_utils.create_vllm_config(
        model=str(model_dir),
        block_size=BS,
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
    )
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=4 * BS
    )
    only_windows = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], window)]
    )
    for role in (connector.KVConnectorRole.SCHEDULER, connector.KVConnectorRole.WORKER):
        with pytest.raises(LayoutError, match="SlidingWindowSpec.*not supported"):
            connector.KVStoreConnector(vcfg, role, only_windows)
    with pytest.raises(LayoutError, match="2 groups"):
        connector.KVStoreConnector(
            vcfg, connector.KVConnectorRole.SCHEDULER, vllm_utils.make_kv_cache_config(BS, swa_enabled=True)
        )
    full = vllm_utils.make_kv_cache_config(BS)  # full attention, one group: taken
    connector.KVStoreConnector(vcfg, connector.KVConnectorRole.SCHEDULER, full).shutdown()
    # B12X and ROCm's backends publish their pages as two head slots (all K heads, then all V heads)
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    packed = FullAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, num_head_slots=2,
        state_content_bytes=2 * 64 * 2,
    )  # fmt: skip
    two_slots = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], packed)]
    )
    for role in (connector.KVConnectorRole.SCHEDULER, connector.KVConnectorRole.WORKER):
        with pytest.raises(LayoutError, match="packs its KV cache pages .2 head slots of 256 bytes"):
            connector.KVStoreConnector(vcfg, role, two_slots)
    vcfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(LayoutError, match="decode-context-parallel"):
        connector.KVStoreConnector(vcfg, connector.KVConnectorRole.SCHEDULER, full)
    # a drafter's layers share the KV cache: the worker died at start on "registered 33 KV caches"
    vcfg.parallel_config.decode_context_parallel_size = 1
    vcfg.speculative_config = SimpleNamespace(method="eagle")
    for role in (connector.KVConnectorRole.SCHEDULER, connector.KVConnectorRole.WORKER):
        with pytest.raises(LayoutError, match="speculative decoding"):
            connector.KVStoreConnector(vcfg, role, full)


def test_cpu_kernels_that_pack_k_otherwise_are_refused_at_start(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    U, vcfg, _ = setup
    with pytest.raises(LayoutError, match="packs K for amx"):
        Worker(vcfg, "CPU_ATTN", monkeypatch, isa="amx")
    with pytest.raises(LayoutError, match="packs K for neon"):
        connector.split_kv(torch.zeros(4, 3, 16, 128), "CPU_ATTN", 3, 64, "neon")
    with pytest.raises(LayoutError, match="cannot find K and V"):
        connector.split_kv(torch.zeros(4, 5, 16, 128), "FLASH_ATTN", 3, 64)


@pytest.mark.parametrize("backend", ["B12X", "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"])
def test_a_cache_shaped_like_flash_attention_by_another_backend_is_refused(backend: str) -> None:
    # B12X keeps a page as [K heads | V heads]: for 2 KV heads [nb, 2, bs, 2*D], FlashAttention's
    # shape. Read by its shape, kvstore's K head 1 was the engine's V head 0
    nb, bs, H, D = 4, 16, 2, 8
    K, V = torch.randn(nb, bs, H, D), torch.randn(nb, bs, H, D)
    b12x = torch.stack([K.flatten(2), V.flatten(2)], dim=1)
    with pytest.raises(LayoutError, match="has not been checked against"):
        connector.split_kv(b12x, backend, H, D)
    flash = torch.cat([K, V], dim=-1).permute(0, 2, 1, 3)  # [nb, H, bs, 2D]: each head's K then V
    k, v = connector.split_kv(flash, "FLASH_ATTN", H, D)
    assert torch.equal(k, K) and torch.equal(v, V)


@pytest.mark.parametrize("load_fails", [False, True], ids=["load-good", "load-refused"])
@pytest.mark.parametrize("shared", [128, 64], ids=["all-of-the-load", "a-block-table-shorter-than-the-load"])
def test_a_request_sharing_a_prefix_with_a_load_never_computes_over_it_and_both_are_saved(
    setup: Any, monkeypatch: pytest.MonkeyPatch, shared: int, load_fails: bool
) -> None:
    """ "again" loads 128 tokens from kvstore; "b", added with it, shares the first ``shared`` of them
    and finishes in its first step. again's blocks are not in vLLM's prefix cache while its load is
    in flight: b loads its own. When the daemon turns the loads away, both are set back to their
    first token and compute it all: nobody computes over a block that was not loaded, and kvstore
    keeps a and b as the model computes them."""
    U, vcfg, ep = setup
    a = prompt(150, 11)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, e, a)
    refused = refuse_loads(e, monkeypatch) if load_fails else []
    b = a[:shared] + prompt(40, 12)
    e.add(request(U, a, "again"))
    e.add(request(U, b, "b", max_tokens=1))
    e.run()
    assert sorted(e.worker.loads) == [("again", 0, 128), ("b", 0, shared)]  # once each, failed or not
    assert len(refused) == (2 if load_fails else 0)
    assert not e.over_missing and e.requests["b"].is_finished()
    assert_holds(check, a, 128)
    assert_holds(check, b, (shared + 40) // 32 * 32)
    e.worker.c.shutdown()


@pytest.mark.parametrize("load_fails", [False, True], ids=["load-good", "load-refused"])
def test_a_request_aborted_while_its_load_is_in_flight_gives_its_blocks_back_and_saves_nothing(
    setup: Any, monkeypatch: pytest.MonkeyPatch, load_fails: bool
) -> None:
    """again is aborted in the step its load runs, before vLLM has that step's output: its blocks go
    back once the load is reported (finished_recving), nothing of it is saved, and a later request
    of the same prompt computes (or loads) it right."""
    from vllm.v1.request import RequestStatus

    U, vcfg, ep = setup
    a = prompt(150, 13)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    check = stored_then_forgotten(U, e, a)
    if load_fails:
        refuse_loads(e, monkeypatch)

    def abort(meta: Any) -> None:
        if any(t.req_id == "again" for t in meta.loads):
            e.sched.finish_requests("again", RequestStatus.FINISHED_ABORTED)

    e.before_output = abort
    e.add(request(U, a, "again"))
    e.run()  # returns once every block is back
    e.before_output = None
    assert e.worker.loads == [("again", 0, 128)] and e.requests["again"].is_finished()
    assert not e.sched.connector._loading and not e.sched.connector._tracked
    time.sleep(0.5)  # a save would have landed by now
    assert_holds(check, a, 128)  # what was stored before; nothing of again
    e.add(request(U, a, "later"))
    e.run()
    assert not e.over_missing
    assert_holds(check, a, 128)
    e.worker.c.shutdown()


def test_a_save_that_failed_is_sent_again_with_the_next_one(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill saves [0, 96), [96, 192), [192, 288): the second fails (the daemon turned it
    away), so the third is sent from 96, not refused for its missing parent."""
    U, vcfg, ep = setup
    a = prompt(300, 13)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    clients = e.worker.c._clients
    save = clients.get(Variant(base=clients.base), "save")
    put_from = save.put_from
    starts: list[int] = []

    def flaky(*args: Any, **kw: Any) -> Any:
        starts.append(kw["start"])
        if len(starts) == 2:
            raise ServerError("busy", "injected: the daemon turns the save away")
        return put_from(*args, **kw)

    monkeypatch.setattr(save, "put_from", flaky)
    e.add(request(U, a, "a"))
    e.run()
    assert starts[:3] == [0, 96, 96]
    assert_holds(check_client(e), a, 288)
    e.worker.c.shutdown()


def test_a_daemon_limit_below_one_block_is_said_once(
    daemons: Any,
    tmp_path: Path,
    vllm_utils: Any,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The daemon takes 16 token ids a request, kvstore's blocks are 32 tokens: nothing can be saved
    or found, and the engine ran at a 0% hit rate with nothing said."""
    U, vcfg, ep = engine_setup(daemons, tmp_path, vllm_utils, model_dir, max_tokens_per_request=16)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm"):
        for i in range(2):
            e.add(request(U, prompt(100, 60 + i), f"r{i}"))
            e.run()
    said = [r.getMessage() for r in caplog.records if "fewer than one block" in r.getMessage()]
    # once by the scheduler's connector, once by the worker's (one process each in vLLM)
    assert len(said) == 2 and "max_tokens_per_request" in said[0] and "16" in said[0]
    e.worker.c.shutdown()


def test_a_prompt_longer_than_the_daemons_limit_is_stored_and_found_up_to_it(
    daemons: Any, tmp_path: Path, vllm_utils: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon takes 64 token ids a request: the first 64 tokens of a 150-token prompt are saved,
    and found again (a hit on the first blocks is still a hit), not a failed call each time."""
    U, vcfg, ep = engine_setup(daemons, tmp_path, vllm_utils, model_dir, max_tokens_per_request=64)
    a = prompt(150, 15)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    e.add(request(U, a, "a"))
    e.run()
    check = check_client(e)
    assert wait_until(lambda: check.lookup(a[:64]).matched_tokens == 64, 10)
    assert e.sched.reset_prefix_cache()
    e.add(request(U, a, "again"))
    e.run()
    assert e.worker.loads == [("again", 0, 64)]
    assert e.sched.connector._lookup_failures == 0
    e.worker.c.shutdown()


def test_caches_in_kernel_blocks_smaller_than_the_scheduler_s_are_addressed_by_kernel_block(
    vllm_utils: Any, model_dir: Path, tmp_path: Path
) -> None:
    """FlashInfer under --block-size 128 takes 64-token kernel blocks: the caches registered are views
    of kernel blocks (block b's j-th is b * 2 + j) while the scheduler names 128-token blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.integrations.vllm import KVStoreConnector
    from kvstore.integrations.vllm_saver import Transfer
    from kvstore.integrations.vllm_settings import Variant

    vcfg = vllm_utils.create_vllm_config(
        model=str(model_dir),
        block_size=2 * BS,
        dtype="bfloat16",
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": f"ipc://{tmp_path}/nobody.sock", "block_tokens": T},
    )
    c = KVStoreConnector(vcfg, KVConnectorRole.WORKER)
    L, H, D = c.layout.num_layers, c.layout.num_kv_heads, c.layout.head_dim
    c._k = [torch.zeros(20, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]  # 10 blocks of 2*BS
    c._v = [torch.zeros(20, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
    c._ratio = 2
    t = Transfer("r", Variant(), list(range(3 * BS)), [4, 1], 0, 3 * BS)  # tokens in blocks 4 and 1
    src = torch.arange(1, 3 * BS + 1, dtype=torch.bfloat16).view(1, 1, -1, 1, 1).expand(L, 2, -1, H, D)
    c._paged(t).write(0, src.contiguous())
    k = c._k[0][:, :, 0, 0]
    assert torch.equal(k[8], src[0, 0, :BS, 0, 0]) and torch.equal(k[9], src[0, 0, BS : 2 * BS, 0, 0])
    assert torch.equal(k[2], src[0, 0, 2 * BS :, 0, 0])  # the third kernel block: block 1's first
    assert not k[[0, 1, 3, 4, 5, 6, 7]].any()


def test_saves_backing_off_from_a_busy_daemon_leave_loads_alone(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that waited out a busy daemon holds saves back a while (each would wait as long); loads,
    which a daemon over its budget turns away at once rather than keeps waiting, still go: they were
    held back too, and every hit in that while was recomputed."""
    from kvstore.integrations import backoff

    U, vcfg, ep = setup
    a = prompt(300, 17)
    e = Engine(U, vcfg, "FLASH_ATTN", monkeypatch)
    stored_then_forgotten(U, e, a)
    clients = e.worker.c._clients
    monkeypatch.setattr(backoff, "BUSY_BACKOFF", 60.0)
    monkeypatch.setattr(clients, "timeout", 0.2)
    save = clients.get(Variant(base=clients.base), "save")

    def busy(*args: Any, **kw: Any) -> Any:  # asked again and again within the time-out: busy each time
        time.sleep(0.25)
        raise ServerError("busy", "injected: the daemon is over its budget")

    monkeypatch.setattr(save, "put_from", busy)
    e.add(request(U, prompt(100, 18), "other"))
    e.run()
    assert wait_until(lambda: not clients.saves.available(), 10)
    assert clients.available()
    loaded = e.worker.c.loaded_tokens
    e.add(request(U, a, "again"))
    e.run()
    assert e.worker.loads[-1] == ("again", 0, 128) and e.worker.c.loaded_tokens == loaded + 128
    e.worker.c.shutdown()
