"""The vLLM connector's clients: one per namespace variant (LoRA adapter, cache salt) and purpose,
made on first use, bounded by ``max_variants`` and the daemon's namespace quota.

    Clients.get(variant, "lookup" | "load" | "save")  ->  a connected KVStoreClient, or VariantRefused
    Clients.close()                                    ->  every client closed; later gets: ClientClosed
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.errors import ClientClosed, KVStoreError
from kvstore.integrations.backoff import LOOKUP_TIMEOUT, Backoff
from kvstore.integrations.vllm_settings import Settings, Variant, model_name, namespace_revision
from kvstore.integrations.weights import Weights, weights_id
from kvstore.layout import KVLayout
from kvstore.wire.protocol import Limits

log = logging.getLogger("kvstore.integrations.vllm")

MAX_CLIENTS = 16  # distinct (LoRA, cache salt) namespaces kept connected per process
# seconds before a new variant is tried again after the daemon's namespace quota refused one
QUOTA_RETRY = 300.0


class VariantRefused(KVStoreError):
    """A request's variant (LoRA adapter, cache salt) gets no namespace: over ``max_variants`` or the
    tenant's namespace quota. Its requests are computed as without kvstore."""

    code = "variant_refused"


class Clients:
    """Connected clients, one per namespace variant (and purpose), made on first use.

    Each variant registers a namespace per rank on the daemon, for good (the daemon never forgets
    one), against the tenant's ``max_namespaces_per_tenant``. So at most ``max_variants`` variants
    besides the plain one are used by this process, and once the daemon refuses a namespace for the
    quota no new variant is tried for QUOTA_RETRY seconds: the variants over either are neither looked
    up nor saved (logged once), never a failed request."""

    def __init__(
        self, vllm_config: Any, settings: Settings, layout: KVLayout, ranks: tuple[int, int]
    ) -> None:
        self._cfg, self._settings, self._layout, self._ranks = vllm_config, settings, layout, ranks
        # the weights vLLM loaded, named once, as the connector starts: the scheduler's is made after
        # the model is loaded, and its name reaches the workers with each transfer (a worker's
        # connector is made before: a hub model may be downloading still); files rewritten while
        # vLLM runs are not what it serves
        mc = vllm_config.model_config
        self.base = self._loaded = weights_id(str(mc.model), mc.revision)
        self.weights = Weights()  # LoRA adapters' names
        self._adapters: dict[str, str] = {}  # each LoRA adapter's name -> its variant as first seen here
        self._changed: set[str] = set()  # adapters whose files changed since: no namespace until restart
        self._clients: dict[tuple[Variant, str], KVStoreClient] = {}
        self._variants: set[Variant] = set()  # variants but the plain one whose namespace the daemon took
        self._quota_until = 0.0  # the daemon refused a namespace: no new variant until then
        self._lock = threading.Lock()
        self._closed = False
        # lookups are on the scheduler's path: a daemon that did not answer is left alone a while
        self.backoff = Backoff(log)
        self.available, self.failed = self.backoff.available, self.backoff.failed
        # saves back off on their own (a save that waited out a busy daemon leaves loads alone), and
        # whenever lookups and loads do
        self.saves = Backoff(log, under=self.backoff, held="no save sent")
        self.refused = 0  # calls of variants that got no namespace
        self.timeout = settings.timeout  # each client's, a call's wait for a reply
        self._short_limit_logged = False

    def get(self, variant: Variant, purpose: str) -> KVStoreClient:
        """The client of ``variant`` for ``purpose`` ("lookup" and "load" never wait on a busy
        daemon). Raises VariantRefused for a variant that gets no namespace (see the class), or what
        the first call of a new client raises.

        A new client says hello outside the lock: a save client's hello may take three timeouts
        (its retries), and meanwhile the engine's own thread must still get its cached clients at
        once. Two threads making the same client at once both get the one made first; the other is closed."""
        key = (variant, purpose)
        with self._lock:
            if self._closed:
                raise ClientClosed("kvstore's clients are closed (the connector shut down)")
            if self._adapter_changed(variant):  # a client made before the change must not serve it
                raise VariantRefused(f"LoRA adapter {variant.adapter!r} changed since it was loaded")
            c = self._clients.pop(key, None)
            if c is not None:
                self._clients[key] = c  # most recently used last
                return c
            self._admit(variant)
        c = self._connect(variant, purpose)
        with self._lock:
            if self._closed:  # closed while this one said hello: it would be left open for good
                spare, kept = c, None
            else:
                spare, kept = self._keep(key, c)
        if spare is c:  # this thread's own, never used: closed at once
            c.close()
        elif spare is not None:  # the least recently used, which another thread may be running a
            _close_aside(spare)  # call on (a save, for its retries): never waited for here
        if kept is None:
            raise ClientClosed("kvstore's clients are closed (the connector shut down)")
        return kept

    def _keep(self, key: tuple[Variant, str], c: KVStoreClient) -> tuple[KVStoreClient | None, KVStoreClient]:
        """(Lock held.) Keep ``c`` as ``key``'s client unless another thread's came first; returns (the
        client to close, if any, the one kept)."""
        kept = self._clients.pop(key, None)  # another thread's, made meanwhile
        spare = c if kept is not None else None
        if kept is None:
            kept = c
            if len(self._clients) >= MAX_CLIENTS:
                # the least recently used: closed after the call another thread may be running on it
                # (a client's calls and its close take turns), on a thread of its own; a later call
                # on it is a miss there
                spare = self._clients.pop(next(iter(self._clients)))
        self._clients[key] = kept
        return spare, kept

    def _connect(self, variant: Variant, purpose: str) -> KVStoreClient:
        """A new client of ``variant`` for ``purpose`` that the daemon said hello to: the namespace is
        taken or refused now, and the daemon's limits known. A quota refusal raises VariantRefused
        and keeps new variants out for QUOTA_RETRY seconds."""
        s = self._settings
        c = KVStoreClient(
            s.endpoint,
            model=model_name(self._cfg, s),
            layout=self._layout,
            tenant=s.tenant,
            # the scheduler waits on a lookup: a daemon that stopped answering holds it up for
            # LOOKUP_TIMEOUT at most (then not asked for a while: Backoff)
            timeout=min(s.timeout, LOOKUP_TIMEOUT) if purpose == "lookup" else s.timeout,
            revision=namespace_revision(self._cfg, self._ranks, variant),
            shared_memory=s.shared_memory,
            # on the scheduler's and workers' critical path a busy daemon is a miss (recomputed),
            # not a wait; saves run on their own thread and may wait, within the timeout
            retries=2 if purpose == "save" else 0,
            wait_when_busy=purpose == "save",
        )
        try:
            c.ping()
        except BaseException as e:
            c.close()
            if getattr(e, "code", None) == "quota_exceeded":
                with self._lock:
                    self._quota_until = time.monotonic() + QUOTA_RETRY
                    self._variants.discard(variant)
                log.warning(
                    "kvstore refused a namespace for a LoRA/cache-salt variant (%s); requests of "
                    "new variants are computed without kvstore for %.0f s. Raise the daemon's "
                    "[server] max_namespaces_per_tenant or lower max_variants",
                    e,
                    QUOTA_RETRY,
                )
                raise VariantRefused(str(e)) from e
            raise
        return c

    def reset(self) -> None:
        """vLLM's weights changed in place (an RL weight sync resets its caches): the K/V of the
        weights named so far must never be found again. The weights' name gets a new generation:
        every variant's namespace is a new one from now on, and the old blocks age out of kvstore.
        The generation is random, not a count: a count starts again with each process, and an
        engine restarted from the same files and synced once (or another engine on the daemon)
        would name other weights as this one named its first sync's."""
        with self._lock:
            self.base = f"{self._loaded}+reset-{uuid.uuid4().hex}"

    def named_by_reset(self, base: str) -> bool:
        """Whether ``base`` is a name ``reset`` gave (this engine's alone), not the loaded files'."""
        return base.startswith(f"{self._loaded}+reset-")

    def retire(self, bases: list[str]) -> None:
        """Weights named by earlier resets, replaced since: this process's clients of them are taken
        out of use, the blocks of their namespaces evicted through them, and they are closed, on a
        thread of their own (no other engine has these names: the blocks would take room until they
        aged out, and keep their registrations on the daemon). A load of them still to come makes a
        client anew and misses. Best effort: logged when the daemon refuses."""
        gone = set(bases)
        with self._lock:
            old = {k: self._clients.pop(k) for k in [k for k in self._clients if k[0].base in gone]}
        if old:
            threading.Thread(
                target=_evict_all, args=(list(old.values()),), name="kvstore-retire", daemon=True
            ).start()

    def stale(self, variant: Variant) -> bool:
        """Whether ``variant`` names weights from before a reset: what a request computed then (its
        blocks were computed by the old weights, or on top of them) is not saved."""
        with self._lock:
            return variant.base != self.base

    def variant(self, request: Any) -> Variant:
        """``request``'s variant, on the base weights this process named (the scheduler's: see
        ``base``). Never raises."""
        return Variant.of(request, self.weights, self.base)

    def adapter_changed(self, variant: Variant) -> bool:
        """Whether ``variant``'s LoRA adapter is one whose files changed since this process first saw
        it: vLLM serves the weights it loaded until it reloads them (in place, or after a restart),
        and nothing here says when it did, so neither set of files may name what it computes. Such
        an adapter's requests are computed without kvstore until a restart (logged once)."""
        with self._lock:
            return self._adapter_changed(variant)

    def _adapter_changed(self, variant: Variant) -> bool:
        """(Lock held.) ``adapter_changed``."""
        name = variant.adapter
        if not name:
            return False
        if name in self._changed:
            return True
        if self._adapters.setdefault(name, variant.lora) == variant.lora:
            return False
        self._changed.add(name)
        log.warning(
            "kvstore: the files of LoRA adapter %r changed while vLLM serves it; its requests are "
            "computed without kvstore until vLLM restarts (its K/V is named by the files it loads)",
            name,
        )
        return True

    def _admit(self, variant: Variant) -> None:
        """(Lock held.) Take ``variant`` into the variants this process uses, or raise VariantRefused."""
        if variant.plain or variant in self._variants:
            return
        over = len(self._variants) >= self._settings.max_variants
        if over or time.monotonic() < self._quota_until:
            self.refused += 1
            if self.refused == 1:
                log.warning(
                    "kvstore: more LoRA/cache-salt variants than max_variants (%d) or the tenant's "
                    "namespace quota; requests of the others are computed without kvstore",
                    self._settings.max_variants,
                )
            raise VariantRefused(
                f"no namespace for another variant ({len(self._variants)} in use, max_variants "
                f"{self._settings.max_variants}); raise max_variants in kv_connector_extra_config"
            )
        self._variants.add(variant)

    def token_limit(self, client: KVStoreClient) -> int:
        """The daemon's max_tokens_per_request, as its hello to ``client`` said (get() says hello).
        One below a block of the namespace (nothing could ever be stored or found) is logged once."""
        n = client.max_tokens
        limit = n if n is not None else Limits().max_tokens
        T = self._layout.block_tokens
        if limit < T and not self._short_limit_logged:
            self._short_limit_logged = True
            log.warning(
                "the kvstore daemon takes %d token ids a request, fewer than one block of %d "
                "(block_tokens): nothing is saved or loaded; raise its [server] "
                "max_tokens_per_request or lower block_tokens in kv_connector_extra_config",
                limit,
                T,
            )
        return limit

    def close(self) -> None:
        """Close every client, ending a call one runs on another thread (a save waiting on the
        daemon: shutdown does not wait out its time-outs); a client made after this is closed at
        once, and ``get`` raises ClientClosed."""
        with self._lock:
            self._closed = True
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:  # outside the lock
            c.close(abort=True)


def _evict_all(clients: list[KVStoreClient]) -> None:
    """Evict the blocks of each of ``clients``' namespaces (once each), then close them all."""
    done: set[str] = set()
    try:
        for c in clients:
            ns = c.namespace
            if ns is None or ns.id in done:
                continue
            done.add(ns.id)
            try:
                c.evict(namespace=ns.id)
            except Exception as e:  # noqa: BLE001 - they age out
                log.warning("kvstore: the blocks of weights replaced by a reset were not evicted (%s)", e)
    finally:
        for c in clients:
            c.close()


def _close_aside(client: KVStoreClient) -> None:
    """Close ``client`` on a thread of its own: its close waits for the call it runs, if any."""
    threading.Thread(target=client.close, name="kvstore-client-close", daemon=True).start()


def worker_ranks(vllm_config: Any = None) -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks. Where vLLM's groups cannot be read, (0, 0)
    for a single process; with several ranks that would name every rank's heads as rank 0's, and
    ranks would load each other's K/V: KVStoreError then (the connector is not made)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception as e:  # not initialised: a single process
        pc = getattr(vllm_config, "parallel_config", None)
        ranks = int(getattr(pc, "tensor_parallel_size", 1) or 1) * int(
            getattr(pc, "pipeline_parallel_size", 1) or 1
        )
        if ranks > 1:
            raise KVStoreError(
                f"kvstore: this worker's tensor/pipeline-parallel rank cannot be read ({e}), and vLLM "
                f"runs {ranks} ranks: its K/V cannot be named by its shard"
            ) from e
        return 0, 0
