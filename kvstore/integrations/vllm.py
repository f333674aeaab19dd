"""kvstore as vLLM's KV connector (the v1 connector API of vLLM 0.32 and 0.33), loaded by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "ipc:///run/kvstore/kvstore.sock"}}'

Scheduler side: ``get_num_new_matched_tokens`` asks the daemon how much of a request's prompt it
holds (a lookup: no side effects, asked once per request; the last prompt token is always left to
compute). The step's metadata then tells the workers which tokens to load into which of vLLM's
blocks, and which newly computed full blocks to save.

Worker side: loads run before the forward pass, straight into vLLM's paged caches (``get_into``
with the request's block ids, from the first token vLLM does not hold itself, never writing a block
it shares). A block that vanished between the lookup and the load is reported through
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy = "recompute"`` vLLM recomputes
it, and what every running request holding it computed over it in that step (what one computed over
it in a later step scheduled before vLLM heard of it, with async scheduling, is kept: such a request
saves nothing from the block on). A loader aborted or preempted before vLLM heard of it recomputes
nothing: the connector drops the block, and those computed over it, from vLLM's prefix cache (vLLM
0.33 lends it the cache manager), so no later request computes over it; with vLLM 0.32 they stay,
and a request that takes them from there saves nothing from them on, until a request computes them
again. Saves are queued after the
step and run on a thread (vllm_saver.py: a copy out of vLLM's blocks into shared staging, then the daemon stores
them); a finished request's blocks are kept until its saves are done (``request_finished`` returns
True, ``get_finished`` reports it), and its last save may wait for a load it shares to settle.

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
from collections import deque
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
from kvstore.integrations.vllm_saver import Saver, Transfer
from kvstore.integrations.vllm_settings import Settings, Variant
from kvstore.integrations.vllm_tracking import Load, Poisoned, Tracked, Unsettled
from kvstore.kvbuffers import PagedKV

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- metadata


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # finished requests whose last save waits for a later step: the workers keep their blocks
    held: list[str] = field(default_factory=list)
    # held requests whose last save, if any, is in this step's saves: their blocks go back once it is done
    released: list[str] = field(default_factory=list)


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
        self._loads: dict[str, tuple[int, int]] = {}  # request -> (start, end) to load this step
        self._requests: dict[str, Any] = {}
        self._variant_of: dict[str, Variant] = {}  # request -> its variant, named at its lookup
        self._tracked: dict[str, Tracked] = {}
        self._final: list[Transfer] = []  # saves of finished requests, for the next step's workers
        # finished requests sharing blocks of a load not settled: (request, its tokens computed)
        self._deferred: dict[str, tuple[Tracked, int]] = {}
        self._held: list[str] = []  # requests deferred since the last step (KVStoreMetadata.held)
        self._dropped: list[str] = []  # deferred requests whose shared load failed: nothing saved
        self._step = 0  # steps scheduled (build_connector_meta calls)
        self._unsettled = Unsettled()  # loads of the last ``depth`` steps (see _shares_unsettled)
        self._poison = Poisoned(self._bs, evict=self._uncache)
        # block tables of requests that finished while a load they hold was not settled, by step: a
        # failed load poisons the blocks they computed over it (see update_connector_output)
        self._gone: deque[tuple[int, list[int]]] = deque()
        # Steps in flight at once: with async scheduling (vLLM's default) step N+1 is scheduled before
        # step N's output, its load errors included, reaches the scheduler; step N+depth only after.
        self._depth = max(1, int(getattr(vllm_config, "max_concurrent_batches", 1) or 1))
        self._lookup_failures = 0
        # worker side
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._ratio = 1  # kernel blocks of the caches per block of the scheduler (register_kv_caches)
        self._load_errors: set[int] = set()
        self._saving: set[str] = set()  # requests with saves queued at some point
        self._finishing: set[str] = set()  # finished requests whose saves are still running
        self._kept: set[str] = set()  # finished requests whose last save is not planned yet
        self._saver: Saver | None = None
        self._submitted: KVStoreMetadata | None = None  # the metadata whose saves are queued
        self.loaded_tokens = 0
        # seconds spent in this connector's hooks, on the engine's own thread (what it adds to a step)
        self.hook_seconds: dict[str, float] = {"lookup": 0.0, "meta": 0.0, "load": 0.0, "save": 0.0}
        log.info(
            "kvstore connector (%s): %s, namespace %s",
            "worker" if self._worker else "scheduler",
            self.settings.endpoint or "default endpoint",
            self.layout,
        )

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
        return max(0, held[0] - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens > 0 and rid in self._hits:
            local = self._hits[rid][1]
            self._loads[rid] = (local, local + num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreMetadata:
        t0 = time.perf_counter()
        try:
            return self._build_meta(scheduler_output)
        finally:
            self.hook_seconds["meta"] += time.perf_counter() - t0

    def _build_meta(self, scheduler_output: Any) -> KVStoreMetadata:
        meta = KVStoreMetadata()
        self._step += 1
        self._unsettled.settle(self._step - self._depth + 1)
        while self._gone and self._gone[0][0] <= self._step - self._depth:
            self._gone.popleft()
        so = scheduler_output
        # loads first, saves after: a request's save waits for every load of this step into its blocks
        computed: list[tuple[Tracked, int]] = []  # requests not loading, and their tokens after this step
        watch = self._poison.active()
        steps: list[tuple[Tracked, int, int, bool]] = []  # see Poisoned.scheduled
        bs = self._bs
        for nr in so.scheduled_new_reqs:
            rid = nr.req_id
            request = self._requests.get(rid)
            if request is None:
                continue
            after = nr.num_computed_tokens + so.num_scheduled_tokens[rid]
            if watch:  # its own blocks start after vLLM's prefix-cache hit (a load writes its own)
                local = self._loads[rid][0] if rid in self._loads else nr.num_computed_tokens
                own = -(-local // bs)
            t = Tracked(
                request,
                self._variant_of.pop(rid) if rid in self._variant_of else self._clients.variant(request),
                list(nr.block_ids[0]),
                saved=self._hits.get(rid, (0, 0))[0],
                session=_session(request),
                scheduled_at=self._step,
            )
            old = self._tracked.get(rid)
            if old is not None:
                # resumed after a preemption (vLLM's model runner V2 sends those as new requests): its
                # earlier saves are still the workers' to report (request_finished must keep its
                # blocks for that report), and a load of it not settled yet still is not settled
                t.saving, t.loaded_at = old.saving, old.loaded_at
            self._tracked[rid] = t
            if watch:
                steps.append((t, own, after, True))
            if not self._plan_load(meta, t):
                computed.append((t, after))
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            known = self._tracked.get(rid)
            if known is None:
                continue
            new = cached.new_block_ids[i]
            nc = cached.num_computed_tokens[i]
            after = nc + so.num_scheduled_tokens[rid]
            known.scheduled_at = self._step
            if watch:
                if rid in resumed:
                    local = self._loads[rid][0] if rid in self._loads else nc
                    steps.append((known, -(-local // bs), after, True))
                else:  # a block it began in an earlier step is its own too
                    steps.append((known, nc // bs, after, False))
            loading = False
            if rid in resumed:  # back from preemption: these are all its blocks now
                known.block_ids = list(new[0]) if new else []
                loading = self._plan_load(meta, known)
            elif new:
                known.block_ids.extend(new[0])
            if not loading:
                computed.append((known, after))
        if watch:
            self._poison.scheduled(steps)
        for t, n in computed:
            if self._settled(t):
                self._plan_save(meta.saves, t, n)
        meta.saves += self._final
        self._final = []
        meta.held, self._held = self._held, []
        for rid, (t, n) in list(self._deferred.items()):
            if not self._shares_unsettled(t):  # the loads it shares are good (else it was dropped)
                del self._deferred[rid]
                self._plan_save(meta.saves, t, n)
                meta.released.append(rid)
        meta.released += self._dropped
        self._dropped = []
        meta.preempted = sorted(getattr(so, "preempted_req_ids", None) or ())
        self._loads.clear()
        for rid in list(self._hits):  # asked again only if it goes back to waiting
            if rid in self._tracked:
                del self._hits[rid]
        return meta

    def _plan_load(self, meta: KVStoreMetadata, t: Tracked) -> bool:
        """Load what vLLM counted on from kvstore; True when a load is planned. The request's save
        then waits for a later step: the tokens this step computes after the load are computed over
        its blocks, and only once the workers' load errors reached vLLM (which recomputes what
        followed a failed block) are they known good. Saved now, a failed load on any rank would
        store K/V computed over missing blocks under the right keys."""
        rid = t.request.request_id
        span = self._loads.get(rid)
        tokens = _token_ids(t.request)
        if span is None or tokens is None:
            return False
        start, end = span
        meta.loads.append(Transfer(rid, t.variant, list(tokens[:end]), list(t.block_ids), start, end))
        t.loaded_at = self._step
        first, last = start // self._bs, -(-end // self._bs)
        self._unsettled.add(Load(self._step, rid, first, last, tuple(t.block_ids[first:last])))
        return True

    def _settled(self, t: Tracked) -> bool:
        """Whether the output of the step that last loaded ``t`` has reached vLLM (its load errors
        applied: the request rolled back to the first failed block) before this step was scheduled,
        and no block of ``t`` is in another request's load not settled yet."""
        return self._step - t.loaded_at >= self._depth and not self._shares_unsettled(t)

    def _shares_unsettled(self, t: Tracked) -> bool:
        """Whether ``t`` holds a block that another request loads in a step not settled yet: vLLM's
        prefix cache hands the blocks of a load to the requests scheduled after it, which compute
        over them in the same step. Had the load failed, what they computed is wrong until vLLM,
        given the step's load errors, rolls them back and they compute it again (see
        update_connector_output), so nothing of it is saved before the load is known good. Only
        the positions loads filled are looked at (see Unsettled): the cost is the loaded blocks',
        not the requests' lengths (64 requests of 8192 blocks and a load of 64 blocks: 16 ms a step
        walking every block, 0.08 ms so)."""
        return self._unsettled.shared_by(t)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of a step, on the scheduler: blocks whose load failed. vLLM (0.32 and
        0.33, ``_update_requests_with_invalid_blocks``) has rolled back every running request holding
        one among the tokens it had computed before the step, the loader and those sharing the block
        through its prefix cache alike, and dropped that step's output: they compute again over the
        recomputed blocks. So what each has in kvstore is taken to end at its first failed block
        (in kvstore's blocks), and its saves go on from there once it is settled. A finished
        request waiting for such a load (see request_finished) was not rolled back: what it computed
        over the failed blocks is never saved, and its blocks go back with the next step.

        vLLM (with ``kv_load_failure_policy = "recompute"``) leaves the failed blocks, and those
        computed over them, in its prefix cache: they are poisoned until a request computes them
        again (see Poisoned), and the connector drops every one of them from vLLM's prefix cache
        (0.33) at once, those a running request holds too: the loader rolled back recomputes them a
        chunk at a time, and a request in flight meanwhile (async scheduling) or added between two
        chunks must not take the ones not yet recomputed. (What is recomputed is not cached again:
        lost prefix-cache hits, never wrong K/V.)

        With steps in flight (async scheduling) a request sharing a failed block is not rolled back
        all the way (see _keeps_wrong_kv): it is tainted at that block, as if it had taken a
        poisoned block from the prefix cache."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        self._poison.poison(invalid)
        for t in self._tracked.values():
            first = self._poison.failed(t.block_ids, invalid)
            if first is None:
                continue
            t.saved = min(t.saved, first * self._bs // self._T * self._T)
            if t.request.num_computed_tokens <= first * self._bs:
                continue  # vLLM set it back to the block (it holds it first): it computes it again
            if self._keeps_wrong_kv(t, first):
                at = first * self._bs
                t.poisoned_at = at if t.poisoned_at is None else min(t.poisoned_at, at)
                self._poison.tainted.add(t.request.request_id)
            elif not self._loads_itself(t, first):
                # vLLM counts the block as computed for it, relying on the load's request to compute
                # it again: looked at when it is next scheduled (see Poisoned.scheduled)
                t.relies_at = first if t.relies_at is None else min(t.relies_at, first)
        for rid, (t, _) in list(self._deferred.items()):
            if self._poison.failed(t.block_ids, invalid) is not None:
                del self._deferred[rid]
                self._dropped.append(rid)
        for _, block_ids in self._gone:
            self._poison.failed(block_ids, invalid)

    def _uncache(self, block_ids: set[int]) -> None:
        """Drop ``block_ids`` from vLLM's prefix cache (their hashes; whoever holds them keeps them):
        their K/V is wrong, and no later request may take them from there. vLLM 0.33 lends the
        connector its KV cache manager for this; 0.32 does not, and they stay (see Poisoned)."""
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is None:
            return
        try:
            manager.evict_blocks(block_ids)
        except Exception as e:  # a vLLM whose cache manager differs: the blocks stay (Poisoned)
            log.warning("kvstore could not drop %d blocks from vLLM's prefix cache: %s", len(block_ids), e)

    def _keeps_wrong_kv(self, t: Tracked, first: int) -> bool:
        """Whether vLLM keeps what ``t`` computed over its failed block at position ``first``.

        vLLM recomputes a failed block with the first running request holding it (the loader, rolled
        back to it); any other holder is set back only by the tokens it was scheduled in the failed
        step (``num_computed_tokens`` less that step's), none if it was not in it. With one step in
        flight that is all it computed over the block. With more, whatever it was scheduled in the
        steps after the failed one, scheduled before vLLM had its output, is kept, computed over the
        block before it was recomputed, and never computed again::

            step N      loader L loads X: fails        sharer S in N (or not)
            step N+1    (scheduled before N's output)  S computes c over X (a chunk, or a decode)
            N's output  L rolled back to X             S back by its N tokens only: len(c) kept, wrong

        A holder other than the loader scheduled after the load's step is so taken as wrong from the
        failed block on. When the loader is gone (aborted, preempted) the first of those holders
        recomputes the block instead: vLLM set it back to the block, and it is not looked at here."""
        u = self._unsettled.load_of(t.block_ids[first], first)
        return u is not None and u.req_id != t.request.request_id and t.scheduled_at > u.step

    def _loads_itself(self, t: Tracked, first: int) -> bool:
        """Whether ``t`` is the request whose load filled its failed block at position ``first`` (the
        one vLLM rolls back to it, to compute it again); unknown loads count as another's."""
        u = self._unsettled.load_of(t.block_ids[first], first)
        return u is not None and u.req_id == t.request.request_id

    def _save_end(self, t: Tracked, computed: int) -> int:
        """Where a save of what ``t`` computed up to token ``computed`` would end (whole blocks); not
        past ``t.saved`` when there is nothing to save."""
        if not self.settings.save or _token_ids(t.request) is None:
            return t.saved
        tokens = t.request.all_token_ids if self.settings.save_outputs else t.request.prompt_token_ids
        end = min(computed, len(tokens))
        if t.poisoned_at is not None:  # computed over a poisoned block from there on
            end = min(end, t.poisoned_at)
        if self._poison.blocks and end > t.saved:  # never a block whose K/V may be wrong, whatever
            first = t.saved // self._bs  # the tracking above says of the request
            hit = next(
                (
                    first + i
                    for i, b in enumerate(t.block_ids[first : -(-end // self._bs)])
                    if b in self._poison.blocks
                ),
                None,
            )
            if hit is not None:
                end = min(end, hit * self._bs)
        return end // self._T * self._T

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
        self._loads.pop(rid, None)
        t = self._tracked.pop(rid, None)
        if t is None:
            return False, None
        self._poison.finished(t)
        aborted = getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED"
        own_settled = self._step - t.loaded_at >= self._depth
        if not own_settled or self._shares_unsettled(t):
            self._gone.append((self._step, t.block_ids))
        computed = request.num_computed_tokens
        # What it computed after its last load may not be saved yet (see _plan_load). Finished by its
        # own output, vLLM had that output's load errors and rolled it back to the first failed block:
        # what it counts as computed is sound. Aborted (a stop string, a client gone), that holds once
        # its load's step is settled; else nothing more is saved.
        if (own_settled or not aborted) and self._save_end(t, computed) > t.saved:
            if self._shares_unsettled(t):
                # vLLM asks this before it hands the step's load errors to update_connector_output:
                # the last save waits for the loads it shares to settle, in a later step's metadata
                self._deferred[rid] = (t, computed)
                self._held.append(rid)
                return True, None
            self._plan_save(self._final, t, computed)  # the next step's workers save it
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
        if not isinstance(meta, KVStoreMetadata) or not self._k or not meta.loads:
            return
        t0 = time.perf_counter()
        for t in meta.loads:
            got = t.start
            if self._clients.available():  # else the daemon did not answer lately: recomputed
                try:
                    r = self._clients.get(t.variant, "load").get_into(t.tokens, self._paged(t), start=t.start)
                    got = r.matched_tokens
                except VariantRefused:
                    pass  # recomputed; logged once by Clients
                except Exception as e:  # the blocks are recomputed, never read as garbage
                    self._clients.failed(f"load of {t.req_id}", e)
            self.loaded_tokens += max(0, min(got, t.end) - t.start)
            if got < t.end:  # in the scheduler's blocks
                first = max(got, t.start) // self._bs
                self._load_errors.update(t.block_ids[first : -(-t.end // self._bs)])
        self.hook_seconds["load"] += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

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
        self._kept.update(meta.held)
        self._finishing.update(meta.held)
        ready = None
        if meta.saves and self._k and self._k[0].is_cuda:  # the forward runs on vLLM's own stream
            ready = torch.cuda.Event()
            ready.record()
        for t in meta.saves:
            self._saving.add(t.req_id)
            self._saver.submit(t, self._paged(t), ready)
        self._kept.difference_update(meta.released)
        self.hook_seconds["save"] += time.perf_counter() - t0

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # a preempted request's blocks are free again: none of its saves may read them after this
        # (those queued are dropped, the one running waited for); other requests' saves run on
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if self._saver is not None and preempted:
            self._saver.cancel(set(preempted))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._saver is None:
            return None, None
        self._submit_saves()
        self._finishing |= finished_req_ids & self._saving
        done = {rid for rid in self._finishing if rid not in self._kept and self._saver.pending(rid) == 0}
        self._finishing -= done
        self._saving -= done
        for rid in done:
            self._saver.forget(rid)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
            log.info(
                "kvstore connector: loaded %d tokens, saved %d blocks, %d saves failed, %d dropped "
                "for preemptions, %d dropped behind a daemon that did not keep up",
                self.loaded_tokens,
                self._saver.saved_blocks,
                self._saver.failed_saves,
                self._saver.cancelled_saves,
                self._saver.dropped_saves,
            )
        self._clients.close()  # a save still waiting on the daemon ends with its client
        if self._saver is not None:
            self._saver.join()


__all__: Sequence[str] = ["KVStoreConnector", "KVStoreMetadata", "Settings", "Transfer", "split_kv"]
