"""An SGLang HiCache storage backend (L3), loaded by SGLang's dynamic loader.

::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "endpoint": "ipc:///run/user/1000/kvstore/kvstore.sock", "tenant": "default"}'

SGLang names each page by its own chained page hash (64 hex digits); kvstore
stores the page under that key (kvstore.chains.KeyChain), namespaced by the
model SGLang serves (its model path, not the served name, an alias) and its
weights (revision, content, quantization, config overrides: see
sglang_settings.py and kvstore.integrations.weights; its ``--lora-paths``
adapters' and draft model's too), this rank's shard (tp, pp, attention-cp and dcp rank and size), the
host pool's layout (layers, kv heads, head_dim, dtype, page size) and the
tenant. Pages move between the store and SGLang's host pool in place: the
pool's ``kv_buffer`` is viewed (sglang_pages.py) per layer as K and V pages ``[pages,
page_size, H, D]`` (``layer_first``, ``page_first``, ``page_first_direct``)
and filled or read through kvstore's shared memory (or its socket), never
through Python bytes.

``interface_v1`` must be set: without it the backend is refused at start
(SGLang would call the legacy ``batch_get`` and ``batch_set``, which raise
NotImplementedError saying so, for every hit). Weights updated at run time
(``update_weights_from_*`` naming a ``weight_version``) name their pages afresh. A page that is missing, evicted or
fails its checksum is reported False (never filled with wrong data). A daemon
that fails, times out or is busy is a miss or a page not stored, logged, never
an exception in SGLang. Lookups and loads (SGLang's prefetch) never wait on a
busy daemon: a miss at once, recomputed; stores (its backup thread) wait out
``busy`` within the timeout, and back off on their own (a store that waited it out, or timed
out, holds back stores only; a lookup or load that timed out holds back every hook). Lookups,
loads and stores each have a client of their own, so that a long transfer never holds a lookup
up, and no hook runs
past HOOK_BUDGET seconds (SGLang waits 10 s for its storage threads at a cache
flush or detach, and fails past it).
"""

from __future__ import annotations

import difflib
import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstore.chains import KeyChain
from kvstore.client import KVStoreClient
from kvstore.config import check_connect_endpoint
from kvstore.errors import ClientClosed, LayoutError
from kvstore.integrations.backoff import LOOKUP_TIMEOUT, Backoff
from kvstore.integrations.sglang_pages import HostPages
from kvstore.integrations.sglang_settings import (
    check_name,
    check_revision,
    option,
    server_args,
    short_sha,
    weight_version,
    weights_of,
)
from kvstore.integrations.vllm_settings import seconds
from kvstore.results import MISSING_PARENT

log = logging.getLogger("kvstore.integrations.sglang")

_OPTIONS = {"endpoint", "tenant", "model", "revision", "timeout"}
# seconds one hook takes at most, whatever the daemon does: SGLang joins its storage threads for 10 s
# at a cache flush, reset or detach, and raises past it (a hook stops before a call that could run over)
HOOK_BUDGET = 8.0
# seconds after SGLang's weights changed during which nothing is stored: it names the new version
# before it flushes its caches (and joins its storage threads for up to 10 s), so a backup of pages
# the old weights computed may still run
SWITCH_GRACE = 15.0
STORE_RETRIES = 1  # a store that timed out is sent once more (within HOOK_BUDGET)


class KVStoreHiCache(HiCacheStorage):
    """SGLang's L3 in a kvstore daemon. Built by SGLang as ``cls(storage_config, kwargs)``; the host
    pool arrives through ``register_mem_pool_host``. Thread-safe: lookups (SGLang's prefetch
    thread), loads (its I/O thread) and stores (its backup thread) each have a client of their own,
    so that none waits behind another's transfer."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        """Reads ``endpoint``, ``tenant``, ``model`` (default: the model path SGLang's server args
        name, else the config's model_name), ``revision`` and ``timeout`` (seconds a call waits for
        the daemon, default 5; lookups wait LOOKUP_TIMEOUT at most, and no hook runs past
        HOOK_BUDGET) from the config's ``extra_config``. Raises ValueError for an MLA model or a setting kvstore cannot
        use (naming the key)."""
        if storage_config.is_mla_model:
            raise ValueError(
                "kvstore's SGLang backend does not support MLA models (one latent per token, replicated "
                "over tp ranks); use it with MHA/GQA models"
            )
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):  # else SGLang calls the legacy batch_get and batch_set for
            raise ValueError(_V1)  # each hit, and each raises: every hit recomputed, a trace logged
        # SGLang keeps keys of its own in extra_config too: a key close to one of ours is a typo (a
        # misspelt tenant would share the default tenant's blocks), any other is left alone
        for key in extra:
            close = difflib.get_close_matches(str(key), sorted(_OPTIONS), n=1, cutoff=0.75)
            if key not in _OPTIONS and close:
                raise ValueError(
                    f"kvstore: unknown extra_config key {key!r} (did you mean {close[0]!r}?); "
                    f"kvstore reads {', '.join(sorted(_OPTIONS))}"
                )
        # SGLang's model_name is --served-model-name: an alias an operator picks ("chat"), which names
        # no weights; two servers of other weights under one alias must not share pages
        served = server_args()
        path = str(getattr(served, "model_path", None) or "")
        model = option(extra, "model", check_name, None) or path or storage_config.model_name
        if not model:
            raise ValueError(
                "kvstore: no model name; SGLang passes model_name, or set 'model' in extra_config"
            )
        if served is None and "model" not in extra:
            log.warning(
                "kvstore: SGLang's server arguments cannot be read here; pages are namespaced by its "
                "model_name %r, which may be an alias (--served-model-name) that names no weights: "
                "set 'model' (and 'revision') in extra_config",
                model,
            )
        self.config = storage_config
        self.model = str(model) if len(str(model).encode()) <= 200 else "sha256:" + short_sha(str(model), 64)
        self.tenant: str = option(extra, "tenant", check_name, "default")
        self.endpoint: str | None = option(extra, "endpoint", check_connect_endpoint, None)
        self.timeout: float = option(extra, "timeout", seconds, 5.0)
        c = storage_config
        shard = f"tp{c.tp_rank}of{c.tp_size}/pp{c.pp_rank}of{c.pp_size}/cp{c.attn_cp_rank}of{c.attn_cp_size}"
        if c.dcp_size > 1:
            shard += f"/dcp{c.dcp_rank}of{c.dcp_size}"
        rev: str = option(extra, "revision", check_revision, "")
        weights = "" if served is None else weights_of(served, path)
        self._named = "/".join(part for part in (rev, weights, shard) if part)  # all but the version
        # SGLang's name of the weights it serves (weight_version), and a name of this process's for
        # the weights an update at run time brought (random: versions are named by their trainer,
        # "step-5" in two runs alike; "" while they are the ones loaded, named by their files)
        self._version, self._updated = weight_version(), ""
        self._switched = -math.inf  # when the weights were last named afresh (monotonic)
        self._switch_lock = threading.Lock()
        self.client: KVStoreClient | None = None  # loads: a busy daemon is a miss
        self._lookups: KVStoreClient | None = None  # lookups: the same, never behind a load
        self._saver: KVStoreClient | None = None  # stores: made on the first, waits out busy
        self._saver_lock = threading.Lock()
        self._closed = False  # no saver is made after close
        self._pages: HostPages | None = None
        self.backoff = Backoff(log)  # a daemon that does not answer is left alone a while
        self.store_backoff = Backoff(log, under=self.backoff, held="no store sent")  # and the above

    # -- the host pool ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Map the host pool's pages and connect (lazily: the first call says hello)."""
        super().register_mem_pool_host(mem_pool_host)
        self._pages = HostPages(mem_pool_host)
        first, last = getattr(mem_pool_host, "start_layer", None), getattr(mem_pool_host, "end_layer", None)
        if self.config.pp_size > 1 and first is not None and last is not None:
            # a pipeline stage's layers are set by SGLANG_PP_LAYER_PARTITION too, not by its rank
            # alone: another split gives the same rank other layers, whose K/V these pages are not
            self._named += f"/layers{int(first)}-{int(last)}"
        self.client = self._new_client(wait_when_busy=False)
        self._lookups = self._new_client(wait_when_busy=False, timeout=LOOKUP_TIMEOUT)

    @property
    def revision(self) -> str:
        """The namespace's revision: what names the weights (model files, load, quantization,
        overrides, adapters, draft), this rank's shard, and the version of weights updated at run
        time."""
        return f"{self._named}/updated-{self._updated}" if self._updated else self._named

    def _weights_now(self) -> None:
        """At each hook: when SGLang's weights were updated at run time since (its ``weight_version``
        changed, as the update named it), what it computes now is named afresh, at random: the
        clients are made again under the new name, and the old weights' pages are never found again
        (a hook of another thread under way on an old client ends as a miss, or pages not stored).
        An update that names no version is not seen here: see the README."""
        now = weight_version()
        if now == self._version or self._pages is None:
            return
        with self._switch_lock:
            if now == self._version or self._closed:
                return
            old = [c for c in (self.client, self._lookups) if c is not None]
            retired = self.revision if self._updated else None  # (the files' name is other servers' too)
            self._version, self._updated = now, secrets.token_hex(8)
            self._switched = time.monotonic()
            self.client = self._new_client(wait_when_busy=False)
            self._lookups = self._new_client(wait_when_busy=False, timeout=LOOKUP_TIMEOUT)
            with self._saver_lock:
                if self._saver is not None:
                    old.append(self._saver)
                self._saver = None
        for c in old:
            c.close(abort=True)
        log.info("kvstore: SGLang serves weights of version %r now; its pages are named afresh", now)
        if retired is not None:  # an earlier update's pages: no server finds them again
            threading.Thread(target=self._evict_retired, args=(retired,), daemon=True).start()

    def _evict_retired(self, revision: str) -> None:
        """(Its own thread.) Evict the pages named ``revision`` (an earlier update's weights: named at
        random, this process's alone), so that they take no room and their namespace's registration
        makes room on the daemon once they are gone. Best effort: they age out otherwise."""
        try:
            with self._new_client(wait_when_busy=False, revision=revision) as c:
                assert c.namespace is not None
                c.evict(namespace=c.namespace.id)
        except Exception as e:  # noqa: BLE001 - they age out
            log.warning("kvstore: the pages of weights no longer served were not evicted (%s)", e)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Pools beside the K/V (a hybrid model's SWA, Mamba or indexer state, speculative decoding's
        draft model) are refused: kvstore keeps the target model's attention K/V pages only, and a
        hit without them would serve an incomplete state. Raises ValueError, which fails SGLang's
        attach (SGLang may have started its storage threads by then: restart it without kvstore's L3
        rather than attach again)."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name != "kv":
            why = (
                "speculative decoding's draft model"
                if name == "draft"
                else "a hybrid model's SWA, Mamba or indexer state"
            )
            raise ValueError(
                f"kvstore's SGLang backend stores attention K/V pages only; this server also keeps a "
                f"{name!r} host pool ({why}), which it cannot store: run it without kvstore's L3"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _new_client(
        self, *, wait_when_busy: bool, timeout: float = math.inf, revision: str | None = None
    ) -> KVStoreClient:
        """Lookups and loads (not ``wait_when_busy``): one time-out at most (a dead daemon would cost
        three, retried); stores ask again once, off SGLang's way, as vLLM's connector's saves do.
        Either way a call's time-outs take half of HOOK_BUDGET at most: a hook's next call (pages past
        the daemon's limit of one request, a store sent again without its missing prefix) fits too.
        ``revision``: another namespace's than this backend's now (weights no longer served)."""
        assert self._pages is not None
        retries = STORE_RETRIES if wait_when_busy else 0
        # a call's worst: each try's time-out, and waiting out ``busy`` (up to one more) for a store
        tries = retries + 1 + wait_when_busy
        return KVStoreClient(
            self.endpoint,
            model=self.model,
            layout=self._pages.layout,
            tenant=self.tenant,
            revision=self.revision if revision is None else revision,
            timeout=min(self.timeout, timeout, HOOK_BUDGET / 2 / tries),
            wait_when_busy=wait_when_busy,
            retries=retries,
        )

    def close(self) -> None:
        """Close the clients at once: a call another SGLang thread has under way on a daemon that does
        not answer ends now (a miss, or pages not stored), not after its time-outs."""
        with self._switch_lock:  # no switch to new weights makes clients after this
            with self._saver_lock:
                self._closed = True
                saver, self._saver = self._saver, None
            clients = [c for c in (self.client, self._lookups, saver) if c is not None]
        for client in clients:
            client.close(abort=True)

    # -- the v1 (zero-copy) interface ---------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the store holds."""
        if not keys or not self.backoff.available():
            return 0
        self._weights_now()
        n = 0
        deadline = time.monotonic() + HOOK_BUDGET
        try:
            self._client()  # attached, or LayoutError
            client = self._lookups
            assert client is not None
            with client.within(deadline - time.monotonic()):
                for part in self._parts(client, len(keys)):  # a page held names all before it
                    if not _in_time(client, deadline):
                        break
                    got = client.lookup_keys(keys[part]).matched_blocks
                    n += got
                    if got < len(keys[part]):
                        break
        except Exception as e:  # a store that fails is a miss, never SGLang's failure
            self.backoff.failed(f"batch_exists of {len(keys)} pages", e)
        return n

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Fill the host pages at ``host_indices`` (``page_size`` token slots per key) with the leading
        held pages of ``keys``; True for each page filled. Pages after the first miss are False."""
        if not keys:
            return []
        self._weights_now()
        got = 0
        deadline = time.monotonic() + HOOK_BUDGET
        if self.backoff.available():
            try:
                host, client = self._host(), self._client()
                host.paged(host_indices, len(keys))  # whole pages, or nothing is read
                ps = host.page_size
                with client.within(deadline - time.monotonic()):
                    for part in self._parts(client, len(keys)):
                        if not _in_time(client, deadline):
                            break
                        dst = host.paged(host_indices[part.start * ps : part.stop * ps], len(keys[part]))
                        n = client.get_into(KeyChain.of(keys[part]), dst).matched_blocks
                        got += n
                        if n < len(keys[part]):
                            break
            except Exception as e:  # the pages are recomputed, never read as garbage
                self.backoff.failed(f"batch_get_v1 of {len(keys)} pages", e)
        return [i < got for i in range(len(keys))]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the host pages at ``host_indices`` under ``keys``, each the child of the one before
        (the first, of the last of ``extra_info.prefix_keys`` when SGLang passes them and the store
        holds it; else it starts a chain of its own). True for each page stored or already held."""
        if not keys:
            return []
        if not self.store_backoff.available():
            return [False] * len(keys)
        self._weights_now()
        if time.monotonic() - self._switched < SWITCH_GRACE:
            # SGLang names the new version before it flushes its caches: pages the old weights
            # computed may still be backed up meanwhile, and would be stored under the new name
            return [False] * len(keys)
        prefix = list((extra_info.prefix_keys if extra_info is not None else None) or ())
        stored = [False] * len(keys)
        began = time.monotonic()
        deadline = began + HOOK_BUDGET
        saver: KVStoreClient | None = None
        try:
            host = self._host()
            host.paged(host_indices, len(keys))  # whole pages, or nothing is stored
            ps, saver = host.page_size, self._saving_client()
            with saver.within(deadline - time.monotonic()):  # a put of many chunks included
                for part in self._parts(saver, len(keys)):
                    if not _in_time(saver, deadline):
                        break
                    src = host.paged(host_indices[part.start * ps : part.stop * ps], len(keys[part]))
                    before = [*prefix, *keys[: part.start]]
                    r = saver.put_from(KeyChain.of(keys[part], before), src)
                    missing = (
                        before and r.failed and r.failed[0].block == 0 and r.failed[0].code == MISSING_PARENT
                    )
                    if missing and _in_time(saver, deadline):
                        # the prefix pages are not in the store (evicted, or never written): the pages
                        # are still findable by their keys, which name their whole prefix; a chain
                        r = saver.put_from(KeyChain.of(keys[part]), src)
                    failed = {f.block for f in r.failed}
                    for i in range(len(keys[part])):
                        stored[part.start + i] = i not in failed
        except Exception as e:  # the pages not stored yet are simply not stored
            # a store waits on a busy daemon up to its time-out: one that waited it out backs off, or
            # every backup batch would wait as long
            waited = saver is not None and time.monotonic() - began >= saver.timeout
            self.store_backoff.failed(f"batch_set_v1 of {len(keys)} pages", e, waited=waited)
        return stored

    # -- the legacy interface ------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        raise NotImplementedError(_V1)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_V1)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError(_V1)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        raise NotImplementedError(_V1)

    def clear(self) -> None:
        """Drop every page of this namespace (this model, shard and tenant) from the store. On a client
        of its own (SGLang calls this on its scheduler's thread: it must not wait behind a load under
        way); a daemon that fails raises, and SGLang says the clear failed."""
        self._client()  # attached, or LayoutError
        with self._new_client(wait_when_busy=False) as client:
            ns = client.namespace
            if ns is not None:
                client.evict(namespace=ns.id)

    # -- internals -----------------------------------------------------------------------------
    def _parts(self, client: KVStoreClient, n: int) -> list[slice]:
        """``n`` pages in runs one call may carry: SGLang sends up to 128 pages at once, and a call
        naming more tokens than the daemon's max_tokens_per_request would be refused whole. Says
        hello first if ``client`` has not yet (the hello carries the limit)."""
        limit = client.max_tokens
        if limit is None:
            client.ping()
            limit = client.max_tokens
        per = (limit or n * self._host().page_size) // self._host().page_size
        if per < 1:
            raise LayoutError(
                f"a page of {self._host().page_size} tokens is over the daemon's max_tokens_per_request {limit}"
            )
        return [slice(i, min(i + per, n)) for i in range(0, n, per)]

    def _client(self) -> KVStoreClient:
        if self.client is None:
            raise LayoutError("kvstore: register_mem_pool_host was not called; SGLang calls it on attach")
        return self.client

    def _saving_client(self) -> KVStoreClient:
        self._client()  # attached, or LayoutError
        with self._saver_lock:
            if self._closed:
                raise ClientClosed("kvstore's backend is closed (SGLang shut it down)")
            if self._saver is None:
                self._saver = self._new_client(wait_when_busy=True)
            return self._saver

    def _host(self) -> HostPages:
        if self._pages is None:
            raise LayoutError("kvstore: register_mem_pool_host was not called; SGLang calls it on attach")
        return self._pages


def _in_time(client: KVStoreClient, deadline: float) -> bool:
    """Whether another call of ``client`` ends by ``deadline`` even if the daemon answers none of its
    tries nor stops being busy (see _new_client: two such calls fit HOOK_BUDGET, the first of a hook
    and the hello a new client says before it)."""
    return time.monotonic() + client.timeout * (client.retries + 1 + client.wait_when_busy) <= deadline


_V1 = (
    "kvstore's SGLang backend implements the zero-copy v1 calls only: "
    'set "interface_v1": 1 in --hicache-storage-backend-extra-config'
)


__all__: Sequence[str] = ["KVStoreHiCache"]
