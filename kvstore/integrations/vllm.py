"""kvstore as vLLM's KV connector (the v1 connector API of vLLM 0.32 and 0.33), loaded by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "ipc:///run/kvstore/kvstore.sock"}}'

Scheduler side: ``get_num_new_matched_tokens`` asks the daemon how much of a request's prompt it
holds (a lookup: no side effects, asked once per request; the last prompt token is always left to
compute). The step's metadata then tells the workers which tokens to load into which of vLLM's
blocks, and which newly computed full blocks to save.

Loads are asynchronous in vLLM's terms (``get_num_new_matched_tokens`` says so): vLLM gives the
request its blocks and leaves it waiting (WAITING_FOR_REMOTE_KVS); each worker queues the load to
its loading thread (vllm_loader.py: off the engine's thread, on its own CUDA stream on a GPU), which
writes straight into vLLM's paged caches (``get_into`` with the request's block ids, from the first
token vLLM does not hold itself, never writing a block it shares); the step after it ends reports
the load finished (``finished_recving``) with the blocks that failed
(``get_block_ids_with_load_errors``: a block evicted since the lookup, a daemon away or busy). Only
then does vLLM schedule the request, set back to its first failed block (``kv_load_failure_policy =
"recompute"``), and put the blocks before it in its prefix cache: no request computes over a block
whose load failed, nor finds one in vLLM's prefix cache, with or without async scheduling. The
cost: a request with a hit is scheduled a step or more later than it would compute; the engine's
steps meanwhile run on.

Saves are queued after the step and run on a thread (vllm_saver.py: a copy out of vLLM's blocks
into shared staging, then the daemon stores them); a finished request's blocks are kept until its
saves are done (``request_finished`` returns True, ``get_finished`` reports it).

The namespace holds everything that changes K/V: the model and its revision, the weights'
quantization and ``hf_overrides``, the KV layout (layers, KV heads per rank, head size, dtype,
kvstore's block size), the tensor- and pipeline-parallel rank and size, the LoRA adapter and
vLLM's ``cache_salt`` (hashed). Requests
with multimodal inputs or prompt embeddings are neither looked up nor saved: their token ids do not
name their K/V.

vLLM's block size and kvstore's ``block_tokens`` are independent: loads start at any token (the
block holding it is fetched and written from that token on), saves cover whole kvstore blocks. A
backend's kernel blocks smaller than the scheduler's (FlashInfer's 64 tokens under --block-size 128)
are addressed as vLLM's own kernels address them: block b's j-th kernel block is b * ratio + j.
K and V are read out of each layer's cache by attention backend: vLLM's per-layer
``[num_blocks, H, block_size, 2*head_size]`` holds K and V side by side in the last dimension
(FlashAttention, FlashInfer, Triton, FlexAttention), or per head K transposed then V (the CPU
backend's "vec" kernels; its AMX and Arm kernels pack K otherwise and are refused); the older
``[2, num_blocks, block_size, H, head_size]`` is read as it is.

``kv_connector_extra_config`` (all optional):
    endpoint        the daemon (default: kvstore's default ipc endpoint)
    tenant          kvstore tenant (default "default")
    model           the model's name in the namespace (default: vLLM's model name or path)
    block_tokens    kvstore's block size (default 64)
    timeout         seconds per daemon call (default 5)
    load, save      false switches that direction off (default both on)
    save_outputs    also save generated tokens' blocks, for the next turn of a conversation (default true)
    shared_memory   false: always the socket (default: shared memory when the daemon offers it)
    max_variants    LoRA/cache-salt variants cached besides the plain model (default 32): each takes
                    a namespace per rank from the tenant's quota, for good; requests of variants
                    past it (or past the quota) are computed without kvstore
Flags take true/false (or "true"/"false"), numbers a number (or its text); anything else stops the
engine at start with the key named. A daemon that fails, times out or is busy is a miss (recomputed)
or a save skipped, logged, never an error in the engine.
A request's ``kv_transfer_params`` may name a kvstore session: ``{"kvstore_session": "conv-42"}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.errors import LayoutError
from kvstore.integrations import vllm_layout
from kvstore.integrations.vllm_clients import Clients, VariantRefused, worker_ranks
from kvstore.integrations.vllm_layout import check_attention, model_layout, split_kv
from kvstore.integrations.vllm_loader import Loader
from kvstore.integrations.vllm_saver import Saver, Transfer
from kvstore.integrations.vllm_settings import Settings, Variant
from kvstore.kvbuffers import PagedKV

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- metadata


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass
class Tracked:
    """A scheduled request, on the scheduler side."""

    request: Any
    variant: Variant
    block_ids: list[int]
    saved: int  # tokens [0, saved) are in kvstore, or on their way
    session: str | None
    saving: bool = False  # a save was scheduled: its blocks are freed only when the workers say
    preemptions: int = 0  # vLLM's count of its preemptions when it was last scheduled from waiting


def _token_ids(request: Any) -> list[int] | None:
    """The request's prompt token ids, or None when they do not name its K/V."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    return getattr(request, "prompt_token_ids", None)


def _session(request: Any) -> str | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    s = params.get("kvstore_session") if isinstance(params, dict) else None
    return s if isinstance(s, str) and s else None


# ---------------------------------------------------------------------- the connector


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.settings = Settings.from_extra(extra)
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if self.settings.load and policy != "recompute":
            # a daemon away, busy or a block evicted since the lookup would fail the requests that
            # hold the block; kvstore's misses must cost a recompute, never a request
            log.warning(
                "kvstore loads nothing: kv_load_failure_policy is %r, under which a block that cannot be "
                'loaded fails its requests; set "kv_load_failure_policy": "recompute" to load (saves go on)',
                policy,
            )
            self.settings = replace(self.settings, load=False)
        check_attention(vllm_config, kv_cache_config)
        self.layout = model_layout(vllm_config, self.settings.block_tokens)
        self._worker = role == KVConnectorRole.WORKER
        # the scheduler looks up what rank 0 of the first stage holds; each worker loads and saves its own
        self._clients = Clients(
            vllm_config, self.settings, self.layout, worker_ranks() if self._worker else (0, 0)
        )
        T = self.layout.block_tokens
        self._T = T
        self._bs = int(vllm_config.cache_config.block_size)  # vLLM's block size
        # scheduler side
        self._hits: dict[str, tuple[int, int]] = {}  # request -> (kvstore's tokens, vLLM's own)
        # requests vLLM allocated blocks to load into -> (start, end, their blocks): this step's loads
        self._loads: dict[str, tuple[int, int, list[int]]] = {}
        # requests waiting for their load (WAITING_FOR_REMOTE_KVS) -> the blocks it loads into
        self._loading: dict[str, list[int]] = {}
        self._requests: dict[str, Any] = {}
        self._variant_of: dict[str, Variant] = {}  # request -> its variant, named at its lookup
        self._tracked: dict[str, Tracked] = {}
        self._final: list[Transfer] = []  # saves of finished requests, for the next step's workers
        self._lookup_failures = 0
        # worker side
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._ratio = 1  # kernel blocks of the caches per block of the scheduler (register_kv_caches)
        self._load_errors: set[int] = set()
        self._recving: set[str] = set()  # requests whose load ended with nothing to load into
        self._saving: set[str] = set()  # requests with saves queued at some point
        # finished requests whose saves are still running -> when they finished
        self._finishing: dict[str, float] = {}
        self.late_saves = 0  # finished requests whose saves were given up for holding blocks too long
        self._late = max(1.0, self.settings.timeout)  # seconds a finished request's blocks wait on saves
        self._saver: Saver | None = None
        self._loader: Loader | None = None
        # a vLLM that puts its caches to sleep without telling connectors (before 0.33: no
        # unregister_kv_caches) could discard them under a load still running: loads end in their step
        self._sync_loads = bool(
            getattr(vllm_config.model_config, "enable_sleep_mode", False)
        ) and not hasattr(KVConnectorBase_V1, "unregister_kv_caches")
        self._submitted: KVStoreMetadata | None = None  # the metadata whose saves are queued
        # seconds spent in this connector's hooks, on the engine's own thread (what it adds to a step)
        self.hook_seconds: dict[str, float] = {"lookup": 0.0, "meta": 0.0, "load": 0.0, "save": 0.0}
        log.info(
            "kvstore connector (%s): %s, namespace %s",
            "worker" if self._worker else "scheduler",
            self.settings.endpoint or "default endpoint",
            self.layout,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvstore is a best-effort cache, a save dropped at a preemption is a later miss. (vLLM
        then keeps a preempted request's output in flight under async scheduling, not resampled.)"""
        return False

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        t0 = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            self.hook_seconds["lookup"] += time.perf_counter() - t0

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._requests[rid] = request
        if not self.settings.load:
            return 0, False
        held = self._hits.get(rid)
        if held is None:  # asked once per request: the scheduler asks again while it waits
            tokens = _token_ids(request)
            hit = 0
            if tokens is not None and len(tokens) > self._T and self._clients.available():
                try:
                    # named once per request (a walk of its adapter's files): the save uses this name
                    variant = self._variant_of[rid] = self._clients.variant(request)
                    client = self._clients.get(variant, "lookup")
                    # the last prompt token is always computed: its logits start the answer; past the
                    # daemon's max_tokens_per_request only the first ones are asked for (still a hit)
                    ask = tokens[: min(len(tokens) - 1, self._clients.token_limit(client))]
                    hit = client.lookup(ask).matched_tokens
                except VariantRefused:
                    pass  # computed without kvstore; logged once by Clients
                except Exception as e:  # a store that fails is a miss, never the engine's failure
                    self._lookup_failures += 1
                    self._clients.failed("lookup", e)
            held = (hit, num_computed_tokens)
        held = (held[0], num_computed_tokens)
        self._hits[rid] = held
        n = max(0, held[0] - num_computed_tokens)
        # loaded asynchronously, in vLLM's terms (see the module's docstring): the request waits
        # until the load's outcome has reached the scheduler, and nobody reads a block it loads before
        return n, n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens > 0:  # a load vLLM waits for (finished_recving): planned, whatever else
            # vLLM's own hit, as the lookup was told it; a load vLLM deferred (0.33's HiSparse) comes
            # after the request's tokens were counted (its lookup's record may be gone by then)
            held = self._hits.get(rid)
            local = held[1] if held is not None else max(0, request.num_computed_tokens - num_external_tokens)
            self._loads[rid] = (local, local + num_external_tokens, list(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreMetadata:
        t0 = time.perf_counter()
        try:
            return self._build_meta(scheduler_output)
        finally:
            self.hook_seconds["meta"] += time.perf_counter() - t0

    def _build_meta(self, scheduler_output: Any) -> KVStoreMetadata:
        meta = KVStoreMetadata()
        so = scheduler_output
        # preempted (in this schedule, or outside it: reset_prefix_cache): vLLM took its blocks back.
        # Its saves are the workers' to drop (handle_preemptions) and nobody waits for their report;
        # it is tracked afresh, with its new blocks, once scheduled again
        meta.preempted = sorted(getattr(so, "preempted_req_ids", None) or ())
        for rid in meta.preempted:
            self._tracked.pop(rid, None)
        for rid, (start, end, block_ids) in self._loads.items():  # requests waiting for their load
            self._plan_load(meta, rid, start, end, block_ids)
        self._loads.clear()
        computed: list[tuple[Tracked, int]] = []  # scheduled requests, and their tokens after this step
        for nr in so.scheduled_new_reqs:  # (model runner V2: resumed ones too)
            t = self._track(nr.req_id, list(nr.block_ids[0]), nr.num_computed_tokens)
            if t is not None:
                computed.append((t, nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id]))
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            nc = cached.num_computed_tokens[i]
            known = self._tracked.get(rid)
            if rid in resumed or known is None:  # back from preemption: these are all its blocks now
                known = self._track(rid, list(new[0]) if new else [], nc) if rid in resumed else None
            elif new:
                known.block_ids.extend(new[0])
            if known is not None:
                computed.append((known, nc + so.num_scheduled_tokens[rid]))
        for t, n in computed:
            self._plan_save(meta.saves, t, n)
        meta.saves += self._final
        self._final = []
        for t, _ in computed:  # asked again only if it goes back to waiting
            self._hits.pop(t.request.request_id, None)
        return meta

    def _track(self, rid: str, block_ids: list[int], computed: int) -> Tracked | None:
        """Track ``rid``, scheduled from waiting (new, or resumed after a preemption) with
        ``block_ids`` and ``computed`` tokens (vLLM's own hit and what it loaded); None for a
        request this connector was not asked about."""
        request = self._requests.get(rid)
        if request is None:
            return None
        hit = self._hits.get(rid, (0, 0))[0]
        t = Tracked(
            request,
            self._variant_of.pop(rid) if rid in self._variant_of else self._clients.variant(request),
            block_ids,
            # what kvstore holds of it: its hit, or less where its load failed (see _finished_loads)
            saved=min(hit, computed // self._T * self._T),
            session=_session(request),
            preemptions=int(getattr(request, "num_preemptions", 0) or 0),
        )
        self._tracked[rid] = t
        return t

    def _plan_load(self, meta: KVStoreMetadata, rid: str, start: int, end: int, block_ids: list[int]) -> None:
        """The load of ``rid``'s tokens ``start .. end`` into ``block_ids``: vLLM does not schedule it
        until the load's outcome has reached the scheduler (``finished_recving``, and its failed
        blocks), and caches its blocks only then, those before its first failed block."""
        request = self._requests.get(rid)
        tokens = None if request is None else _token_ids(request)
        if request is None or tokens is None:  # (it was looked up: cannot be) a load of nothing
            meta.loads.append(Transfer(rid, Variant(), [], block_ids, start, start))
            return
        known = self._tracked.get(rid)  # resumed after a preemption
        variant = known.variant if known is not None else self._variant_of.get(rid)
        if variant is None:
            variant = self._variant_of[rid] = self._clients.variant(request)
        meta.loads.append(Transfer(rid, variant, list(tokens[:end]), block_ids, start, end))
        self._loading[rid] = block_ids

    def reset_cache(self) -> bool:
        """vLLM resets its caches (``reset_prefix_cache(reset_connector=True)``: after its weights
        were updated in place, as RL weight syncs do): what kvstore holds was computed by other
        weights. Lookups and saves go to a new namespace from now on (Clients.reset); the requests
        scheduled already keep theirs. True: done."""
        self._clients.reset()
        log.info("kvstore: vLLM reset its caches; its K/V is looked up and saved under a new namespace now")
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of a step, on the scheduler: the loads they finished, and the blocks
        whose load failed. vLLM (``_update_requests_with_invalid_blocks``, ``finished_recving``) sets
        each loading request back to its first failed block and schedules it from there: no request
        ever read such a block, nor found it in vLLM's prefix cache. kvstore's hit of the request is
        cut there too, so that a request set back to nothing is not sent to load it again."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        # with several workers a load's failed blocks come as the first worker reports them, its end
        # when the last one does (vLLM's aggregator): any step's failures cut the hit of a load
        known: set[int] = set()
        for rid, block_ids in self._loading.items() if invalid else ():
            first = next((i for i, b in enumerate(block_ids) if b in invalid), None)
            if first is not None and rid in self._hits:
                hit, local = self._hits[rid]
                self._hits[rid] = (min(hit, first * self._bs // self._T * self._T), local)
            known.update(block_ids)
        invalid -= known
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._loading.pop(rid, None)
        if invalid:  # a failed block of no load this connector knows (cannot be): kept out of use
            log.warning(
                "kvstore: %d failed blocks of no known load; dropped from vLLM's prefix cache", len(invalid)
            )
            self._uncache(invalid)

    def _uncache(self, block_ids: set[int]) -> None:
        """Drop ``block_ids`` from vLLM's prefix cache (their hashes; whoever holds them keeps them),
        through the KV cache manager vLLM lends the connector (``bind_kv_cache_manager``)."""
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is None:
            return
        try:
            manager.evict_blocks(block_ids)
        except Exception as e:  # a vLLM whose cache manager differs: the blocks stay
            log.warning("kvstore could not drop %d blocks from vLLM's prefix cache: %s", len(block_ids), e)

    def _save_end(self, t: Tracked, computed: int) -> int:
        """Where a save of what ``t`` computed up to token ``computed`` would end (whole blocks); not
        past ``t.saved`` when there is nothing to save."""
        if not self.settings.save or _token_ids(t.request) is None:
            return t.saved
        tokens = t.request.all_token_ids if self.settings.save_outputs else t.request.prompt_token_ids
        return min(computed, len(tokens)) // self._T * self._T

    def _plan_save(self, saves: list[Transfer], t: Tracked, computed: int) -> None:
        """Save what ``t`` computed up to token ``computed`` that is not saved yet (whole blocks)."""
        end = self._save_end(t, computed)
        if end <= t.saved or self._clients.adapter_changed(t.variant):  # see Clients.adapter_changed
            return
        tokens = t.request.all_token_ids if self.settings.save_outputs else t.request.prompt_token_ids
        rid = t.request.request_id
        saves.append(Transfer(rid, t.variant, list(tokens[:end]), list(t.block_ids), t.saved, end, t.session))
        t.saved = end
        t.saving = True

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._variant_of.pop(rid, None)
        self._hits.pop(rid, None)
        # a load planned is vLLM's to wait for (finished_recving), and it frees the blocks then: the
        # load still runs (of nothing, once the request is gone: _plan_load), and nothing is saved
        loading = rid in self._loads or rid in self._loading
        t = self._tracked.pop(rid, None)
        # preempted since it was tracked (the connector hears of it with the next schedule): its
        # blocks are gone, and with them what it could save; its queued saves the workers drop
        preempted = t is not None and int(getattr(request, "num_preemptions", 0) or 0) != t.preemptions
        if t is None or loading or preempted:
            return False, None
        self._plan_save(self._final, t, request.num_computed_tokens)  # the next step's workers save it
        # saves read the request's blocks on the workers' thread: keep them until they are done
        return t.saving, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backends = vllm_layout.attention_backends(self._vllm_config)
        names = sorted(kv_caches, key=vllm_layout.layer_index)
        L = self.layout
        k, v = [], []
        isa = ""
        if any(b.upper().startswith("CPU") for b in backends.values()):
            isa = vllm_layout.cpu_isa(self._vllm_config, kv_caches[names[0]], L.head_dim)
        for name in names:
            kk, vv = split_kv(kv_caches[name], backends.get(name, ""), L.num_kv_heads, L.head_dim, isa)
            k.append(kk)
            v.append(vv)
        if len(k) != L.num_layers or k[0].dtype != L.torch_dtype:
            raise LayoutError(
                f"vLLM registered {len(k)} KV caches of {k[0].dtype if k else None}; kvstore expects "
                f"{L.num_layers} of {L.dtype}"
            )
        # an attention backend may take smaller blocks than the scheduler's (FlashInfer's 64 under
        # --block-size 128): the caches are then views of kernel blocks, block b's j-th being
        # b * ratio + j, and the scheduler's block ids are expanded to them (_paged)
        kernel = int(k[0].shape[1])
        if self._bs % kernel:
            raise LayoutError(f"vLLM's {self._bs}-token blocks are not whole {kernel}-token kernel blocks")
        self._ratio = self._bs // kernel
        self._k, self._v = k, v
        self._saver = Saver(self._clients)
        self._loader = Loader(self._clients, self._paged, k[0].device, self._bs)
        log.info(
            "kvstore connector: %d layers, blocks of %d tokens, %s",
            len(k),
            k[0].shape[1],
            sorted(set(backends.values())) or "backend unknown",
        )

    def _paged(self, t: Transfer) -> PagedKV:
        r = self._ratio
        ids = t.block_ids if r == 1 else [b * r + j for b in t.block_ids for j in range(r)]
        return PagedKV.blocks(self._k, self._v, ids, t.end)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreMetadata) or not meta.loads:
            return
        t0 = time.perf_counter()
        ready = None
        if self._k and self._k[0].is_cuda:  # after what the engine's stream has queued (its forward)
            ready = torch.cuda.Event()
            ready.record()
        for t in meta.loads:
            if self._loader is not None and self._sync_loads:
                self._loader.run_now(t, ready)
            elif self._loader is not None:
                self._loader.submit(t, ready)
            else:  # no caches registered: nothing to load into, all of it recomputed
                self._recving.add(t.req_id)
                self._load_errors.update(t.block_ids)
        self.hook_seconds["load"] += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a loading request is not in a forward pass until its load is reported done

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved after the step, from the caches, by wait_for_save

    def wait_for_save(self) -> None:
        self._submit_saves()

    def _submit_saves(self) -> None:
        """Queue the bound step's saves, once: from wait_for_save, or from get_finished when vLLM asks
        that first (with speculative decoding it saves after the draft model, and asks before): a
        finished request's last save must be queued before it can be reported done."""
        try:
            meta = self._get_connector_metadata()
        except AssertionError:  # none bound
            return
        if not isinstance(meta, KVStoreMetadata) or self._saver is None or meta is self._submitted:
            return
        self._submitted = meta
        t0 = time.perf_counter()
        ready = None
        if meta.saves and self._k and self._k[0].is_cuda:  # the forward runs on vLLM's own stream
            ready = torch.cuda.Event()
            ready.record()
        for t in meta.saves:
            self._saving.add(t.req_id)
            self._saver.submit(t, self._paged(t), ready)
        self.hook_seconds["save"] += time.perf_counter() - t0

    def unregister_kv_caches(self) -> None:
        """vLLM puts its KV caches to sleep (their memory discarded, or lent out): no save reads them
        after this returns (those queued are given up, counted; a copy out of them under way is waited
        for). Loads and saves come again only with steps, after ``restore_kv_caches``."""
        if self._saver is not None:
            self._saver.cancel_all()
        if self._loader is not None:
            self._loader.cancel_all()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # a preempted request's blocks are free again: none of its saves may read them after this
        # (those queued are dropped, the one running waited for); other requests' saves run on
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if self._saver is not None and preempted:
            self._saver.cancel(set(preempted))
            # nor are they reported: vLLM waits for no save of a preempted request (and one finished
            # later whose saves it was told nothing of would fail its check of the report)
            self._saving.difference_update(preempted)
            for rid in preempted:
                self._finishing.pop(rid, None)
                self._saver.forget(rid)  # resumed, its next save goes from where kvstore's blocks end

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self._recving = self._recving, set()
        if self._loader is not None:  # their failed blocks go to vLLM in this step's output with them
            self._loader.drop(finished_req_ids)  # (aborted while their loads waited)
            loaded, failed = self._loader.finished()
            recving |= loaded
            self._load_errors |= failed
        if self._saver is None:
            return None, recving or None
        self._submit_saves()
        now = time.monotonic()
        for rid in finished_req_ids & self._saving:
            self._finishing.setdefault(rid, now)
        done = {rid for rid in self._finishing if self._saver.pending(rid) == 0}
        # a daemon that keeps up with none of them must not keep finished requests' blocks from vLLM
        # for long (it would preempt running requests for want of them): past the call timeout their
        # saves are given up as a preemption's are (the copy under way waited for, no daemon call)
        late = {rid for rid, since in self._finishing.items() if rid not in done and now - since > self._late}
        if late:
            self._saver.cancel(late)
            self.late_saves += len(late)
            if self.late_saves == len(late):
                log.warning(
                    "kvstore: the daemon did not take the saves of finished requests within %.0f s; they "
                    "are given up so that vLLM gets their blocks back (later ones are counted, not logged)",
                    self._late,
                )
            done |= late
        for rid in done:
            del self._finishing[rid]
            self._saver.forget(rid)
        self._saving -= done
        return (done or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def loaded_tokens(self) -> int:
        """Tokens this worker loaded into vLLM's blocks (of the loads reported done or still running)."""
        return self._loader.loaded_tokens if self._loader is not None else 0

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
        if self._saver is not None:
            self._saver.close()
            log.info(
                "kvstore connector: loaded %d tokens, saved %d blocks, %d saves failed, %d dropped "
                "for preemptions or finished requests' blocks (%d requests), %d dropped behind a daemon "
                "that did not keep up",
                self.loaded_tokens,
                self._saver.saved_blocks,
                self._saver.failed_saves,
                self._saver.cancelled_saves,
                self.late_saves,
                self._saver.dropped_saves,
            )
        self._clients.close()  # a load or save still waiting on the daemon ends with its client
        if self._loader is not None:
            self._loader.join()
        if self._saver is not None:
            self._saver.join()


__all__: Sequence[str] = ["KVStoreConnector", "KVStoreMetadata", "Settings", "Transfer", "split_kv"]
