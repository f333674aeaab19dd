"""The scheduler's side of kvstore's vLLM connector (kvstore.integrations.vllm): what each request
finds in kvstore, the loads vLLM waits for, and the saves of what scheduled requests compute, handed
to the workers as each step's metadata::

    get_num_new_matched_tokens   a lookup, once per request (the last token is always computed)
    update_state_after_alloc     the blocks vLLM gave a load
    build_connector_meta         the step's loads, saves and preemptions, for the workers
    update_connector_output      a load's failed blocks cut its request's hit
    request_finished             its last save; its blocks kept until the workers have saved it
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.integrations.vllm_clients import Clients, VariantRefused
from kvstore.integrations.vllm_saver import Transfer
from kvstore.integrations.vllm_settings import Settings, Variant

log = logging.getLogger("kvstore.integrations.vllm")


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    idle: bool = False  # the step computes nothing (the engine steps only to hear of transfers)
    # weights an earlier reset named (this engine's alone) that a reset since replaced: each worker
    # evicts its namespaces of them (Clients.retire)
    retired: list[str] = field(default_factory=list)


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
    """The request's token ids so far (its prompt; a request resumed after a preemption, its output
    too: saved with ``save_outputs``, and loaded rather than computed again), or None when they do
    not name its K/V."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    tokens = getattr(request, "all_token_ids", None)
    return tokens if tokens is not None else getattr(request, "prompt_token_ids", None)


def _session(request: Any) -> str | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    s = params.get("kvstore_session") if isinstance(params, dict) else None
    return s if isinstance(s, str) and s else None


class SchedulerSide:
    """The connector's hooks on vLLM's scheduler: a part of KVStoreConnector, which sets ``settings``,
    ``_clients``, ``_T`` (kvstore's block size), ``_bs`` (vLLM's) and ``hook_seconds``."""

    settings: Settings
    _clients: Clients
    _T: int
    _bs: int
    hook_seconds: dict[str, float]

    def _init_scheduler(self) -> None:
        self._hits: dict[str, tuple[int, int]] = {}  # request -> (kvstore's tokens, vLLM's own)
        # requests vLLM allocated blocks to load into -> (start, end, their blocks): this step's loads
        self._loads: dict[str, tuple[int, int, list[int]]] = {}
        # requests waiting for their load (WAITING_FOR_REMOTE_KVS) -> the blocks it loads into
        self._loading: dict[str, list[int]] = {}
        # requests a load was planned for, not tracked yet (their load under way, or reported and not
        # scheduled since): their blocks hold K/V read under their lookup's variant
        self._loaded: set[str] = set()
        self._requests: dict[str, Any] = {}
        self._variant_of: dict[str, Variant] = {}  # request -> its variant, named at its lookup
        self._tracked: dict[str, Tracked] = {}
        self._final: list[Transfer] = []  # saves of finished requests, for the next step's workers
        self._lookup_failures = 0
        self._retired: list[str] = []  # for the next step's workers

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
                    # the last token is always computed: its logits give the next one; past the
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
        # nothing computed, nothing loaded: the engine steps only to hear of transfers
        meta.idle = not getattr(so, "total_num_scheduled_tokens", 1) and not meta.loads
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
        meta.retired, self._retired = self._retired, []
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
        self._loaded.discard(rid)
        looked_up = self._variant_of.pop(rid, None)
        # tracked already (a streaming-input session scheduled again as new, without a preemption):
        # its blocks hold what it computed under its variant (the old weights' after a reset: stale,
        # saved no more), whatever a lookup since named; and saves of its earlier part may still be
        # queued on the workers, which report it when it finishes: vLLM must keep its blocks until
        # then (one reported for a request whose blocks vLLM freed fails its check, and the engine
        # with it)
        before = self._tracked.get(rid)
        if before is not None:
            variant = before.variant
        else:
            variant = looked_up if looked_up is not None else self._clients.variant(request)
        t = Tracked(
            request,
            variant,
            block_ids,
            # what kvstore holds of it: its hit, or less where its load failed (see _finished_loads)
            saved=min(hit, computed // self._T * self._T),
            session=_session(request),
            preemptions=int(getattr(request, "num_preemptions", 0) or 0),
            saving=before is not None and before.saving,
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
        # the variant its lookup used (a reset since: the new weights'), else the one it is tracked by
        known = self._tracked.get(rid)
        variant = self._variant_of.get(rid) or (known.variant if known is not None else None)
        if variant is None:
            variant = self._variant_of[rid] = self._clients.variant(request)
        meta.loads.append(Transfer(rid, variant, list(tokens[:end]), block_ids, start, end))
        self._loading[rid] = block_ids
        self._loaded.add(rid)

    def reset_cache(self) -> bool:
        """vLLM resets its caches (``reset_prefix_cache(reset_connector=True)``: after its weights
        were updated in place, as RL weight syncs do): what kvstore holds was computed by other
        weights. Lookups and saves go to a new namespace from now on (Clients.reset). What was looked
        up is forgotten (a request still waiting is looked up again, under the new one: its old hit
        would load the old weights' K/V), and a request scheduled before, or whose load is under way,
        saves nothing more (its K/V was computed by the old weights, or on top of theirs). True: done."""
        old = self._clients.base
        self._clients.reset()
        if self._clients.named_by_reset(old):  # (the files' name is other engines' too: theirs)
            self._retired.append(old)
        # a load under way (or done, its request not scheduled since) read the old weights' K/V into
        # its blocks: its request keeps their variant, stale, so that nothing it computes on top of
        # them is saved under the new one
        self._hits = {rid: hit for rid, hit in self._hits.items() if rid in self._loaded}
        self._variant_of = {rid: v for rid, v in self._variant_of.items() if rid in self._loaded}
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
        if self._clients.stale(t.variant):  # scheduled before a reset: see reset_cache
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
        self._loaded.discard(rid)
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
