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
kvstore.integrations.weights; its ``--lora-paths`` adapters' and draft model's
too), this rank's shard (tp, pp, attention-cp and dcp rank and size), the
host pool's layout (layers, kv heads, head_dim, dtype, page size) and the
tenant. Pages move between the store and SGLang's host pool in place: the
pool's ``kv_buffer`` is viewed per layer as K and V pages ``[pages,
page_size, H, D]`` (``layer_first``, ``page_first``, ``page_first_direct``)
and filled or read through kvstore's shared memory (or its socket), never
through Python bytes.

``interface_v1`` must be set: the legacy calls (``get``, ``set``,
``batch_get``, ``batch_set``) raise NotImplementedError saying so; ``exists``
and ``batch_exists`` work either way. A page that is missing, evicted or
fails its checksum is reported False (never filled with wrong data). A daemon
that fails, times out or is busy is a miss or a page not stored, logged, never
an exception in SGLang. Lookups and loads (SGLang's prefetch) never wait on a
busy daemon: a miss at once, recomputed; stores (its backup thread) wait out
``busy`` within the timeout. Lookups, loads and stores each have a client of
their own, so that a long transfer never holds a lookup up, and no hook runs
past HOOK_BUDGET seconds (SGLang waits 10 s for its storage threads at a cache
flush or detach, and fails past it).
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
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
from kvstore.errors import ClientClosed, ConfigError, LayoutError
from kvstore.integrations.backoff import LOOKUP_TIMEOUT, Backoff
from kvstore.integrations.vllm_settings import seconds
from kvstore.integrations.weights import weights_id
from kvstore.kvbuffers import PagedKV
from kvstore.layout import KVLayout, dtype_name
from kvstore.results import MISSING_PARENT

log = logging.getLogger("kvstore.integrations.sglang")

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_OPTIONS = {"endpoint", "tenant", "model", "revision", "timeout"}
# seconds one hook takes at most, whatever the daemon does: SGLang joins its storage threads for 10 s
# at a cache flush, reset or detach, and raises past it (a hook stops before a call that could run over)
HOOK_BUDGET = 8.0
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
        served = _server_args()
        path = str(getattr(served, "model_path", None) or "")
        model = _option(extra, "model", _name, None) or path or storage_config.model_name
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
        self.model = str(model) if len(str(model).encode()) <= 200 else "sha256:" + _sha(str(model), 64)
        self.tenant: str = _option(extra, "tenant", _name, "default")
        self.endpoint: str | None = _option(extra, "endpoint", check_connect_endpoint, None)
        self.timeout: float = _option(extra, "timeout", seconds, 5.0)
        c = storage_config
        shard = f"tp{c.tp_rank}of{c.tp_size}/pp{c.pp_rank}of{c.pp_size}/cp{c.attn_cp_rank}of{c.attn_cp_size}"
        if c.dcp_size > 1:
            shard += f"/dcp{c.dcp_rank}of{c.dcp_size}"
        rev: str = _option(extra, "revision", _revision, "")
        weights = "" if served is None else _weights(served, path)
        self.revision = "/".join(part for part in (rev, weights, shard) if part)
        self.client: KVStoreClient | None = None  # loads: a busy daemon is a miss
        self._lookups: KVStoreClient | None = None  # lookups: the same, never behind a load
        self._saver: KVStoreClient | None = None  # stores: made on the first, waits out busy
        self._saver_lock = threading.Lock()
        self._closed = False  # no saver is made after close
        self._pages: _HostPages | None = None
        self.backoff = Backoff(log)  # a daemon that does not answer is left alone a while

    # -- the host pool ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Map the host pool's pages and connect (lazily: the first call says hello)."""
        super().register_mem_pool_host(mem_pool_host)
        self._pages = _HostPages(mem_pool_host)
        first, last = getattr(mem_pool_host, "start_layer", None), getattr(mem_pool_host, "end_layer", None)
        if self.config.pp_size > 1 and first is not None and last is not None:
            # a pipeline stage's layers are set by SGLANG_PP_LAYER_PARTITION too, not by its rank
            # alone: another split gives the same rank other layers, whose K/V these pages are not
            self.revision += f"/layers{int(first)}-{int(last)}"
        self.client = self._new_client(wait_when_busy=False)
        self._lookups = self._new_client(wait_when_busy=False, timeout=LOOKUP_TIMEOUT)

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

    def _new_client(self, *, wait_when_busy: bool, timeout: float = math.inf) -> KVStoreClient:
        """Lookups and loads (not ``wait_when_busy``): one time-out at most (a dead daemon would cost
        three, retried); stores ask again once, off SGLang's way, as vLLM's connector's saves do.
        Either way a call's time-outs take half of HOOK_BUDGET at most: a hook's next call (pages past
        the daemon's limit of one request, a store sent again without its missing prefix) fits too."""
        assert self._pages is not None
        retries = STORE_RETRIES if wait_when_busy else 0
        # a call's worst: each try's time-out, and waiting out ``busy`` (up to one more) for a store
        tries = retries + 1 + wait_when_busy
        return KVStoreClient(
            self.endpoint,
            model=self.model,
            layout=self._pages.layout,
            tenant=self.tenant,
            revision=self.revision,
            timeout=min(self.timeout, timeout, HOOK_BUDGET / 2 / tries),
            wait_when_busy=wait_when_busy,
            retries=retries,
        )

    def close(self) -> None:
        """Close the clients at once: a call another SGLang thread has under way on a daemon that does
        not answer ends now (a miss, or pages not stored), not after its time-outs."""
        for client in (self.client, self._lookups):
            if client is not None:
                client.close(abort=True)
        with self._saver_lock:
            self._closed = True
            saver, self._saver = self._saver, None
        if saver is not None:
            saver.close(abort=True)

    # -- the v1 (zero-copy) interface ---------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` the store holds."""
        if not keys or not self.backoff.available():
            return 0
        n = 0
        deadline = time.monotonic() + HOOK_BUDGET
        try:
            self._client()  # attached, or LayoutError
            client = self._lookups
            assert client is not None
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
        got = 0
        deadline = time.monotonic() + HOOK_BUDGET
        if self.backoff.available():
            try:
                host, client = self._host(), self._client()
                host.paged(host_indices, len(keys))  # whole pages, or nothing is read
                ps = host.page_size
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
        if not self.backoff.available():
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
                    # the prefix pages are not in the store (evicted, or never written): the pages are
                    # still findable by their keys, which name their whole prefix; store them as a chain
                    r = saver.put_from(KeyChain.of(keys[part]), src)
                failed = {f.block for f in r.failed}
                for i in range(len(keys[part])):
                    stored[part.start + i] = i not in failed
        except Exception as e:  # the pages not stored yet are simply not stored
            # a store waits on a busy daemon up to its time-out: one that waited it out backs off, or
            # every backup batch would wait as long
            waited = saver is not None and time.monotonic() - began >= saver.timeout
            self.backoff.failed(f"batch_set_v1 of {len(keys)} pages", e, waited=waited)
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
        """Drop every page of this namespace (this model, shard and tenant) from the store."""
        client = self._client()
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

    def _host(self) -> _HostPages:
        if self._pages is None:
            raise LayoutError("kvstore: register_mem_pool_host was not called; SGLang calls it on attach")
        return self._pages


def _in_time(client: KVStoreClient, deadline: float) -> bool:
    """Whether another call of ``client`` ends by ``deadline`` even if the daemon answers none of its
    tries nor stops being busy (see _new_client: two such calls fit HOOK_BUDGET, the first of a hook
    and the hello a new client says before it)."""
    return time.monotonic() + client.timeout * (client.retries + 1 + client.wait_when_busy) <= deadline


def _server_args() -> Any | None:
    """The ServerArgs of the SGLang process this backend runs in, or None where it publishes none
    (a backend made outside a scheduler)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # noqa: BLE001 - not published, or an SGLang before runtime_context
        pass
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # noqa: BLE001 - retired (it raises), or not published either
        return None


def _weights(served: Any, path: str) -> str:
    """What besides the model's path changes its K/V, from SGLang's server args: its revision, its
    weights (``weights.weights_id``), their quantization and the config overrides (hashed)."""
    revision = getattr(served, "revision", None)
    parts = [f"rev={revision}"] if revision else []
    named = weights_id(path, revision) if path else ""
    if named:
        parts.append(named)
    quantization = getattr(served, "quantization", None)
    if quantization:
        parts.append(f"q={quantization}")
    overrides = getattr(served, "json_model_override_args", None)
    if overrides and overrides != "{}":
        parts.append(f"ov={_sha(str(overrides), 16)}")
    # SGLang seeds a --lora-paths adapter's page hashes with an id made of its name and path only:
    # an adapter rewritten in place would find the old one's pages. Its content is named here (a
    # change of any adapter's files starts every page afresh; adapters loaded later get random ids)
    adapters = sorted(_adapters(getattr(served, "lora_paths", None)))
    if adapters:
        parts.append("lora=" + _sha("\0".join(f"{n}\0{p}\0{weights_id(p)}" for n, p in adapters), 16))
    # a speculative draft model's layers may share the host pool's pages
    draft = getattr(served, "speculative_draft_model_path", None)
    if draft:
        named = weights_id(str(draft), getattr(served, "speculative_draft_model_revision", None))
        parts.append("draft=" + _sha(f"{draft}\0{named}", 16))
    return ";".join(parts)


def _adapters(lora_paths: Any) -> list[tuple[str, str]]:
    """(name, path) of each adapter of SGLang's ``lora_paths``: LoRARef records once SGLang has read
    its arguments, or as given (``name=path`` or ``path`` strings, dicts)."""
    out = []
    if isinstance(lora_paths, dict):  # {name: path}
        lora_paths = [{"lora_name": k, "lora_path": v} for k, v in lora_paths.items()]
    for item in lora_paths or ():
        if isinstance(item, str):
            name, _, path = item.partition("=")
            out.append((name, path or name))
        elif isinstance(item, dict):
            out.append((str(item.get("lora_name", "")), str(item.get("lora_path", ""))))
        else:
            out.append((str(getattr(item, "lora_name", "")), str(getattr(item, "lora_path", ""))))
    return out


def _sha(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _option(extra: dict[str, Any], key: str, check: Callable[[Any], Any], default: Any) -> Any:
    """``extra[key]`` checked (``default`` when absent, or null for endpoint and model); ValueError
    naming the key: a bad setting stops SGLang at start, not every call later."""
    v = extra.get(key)
    if key not in extra or (v is None and key in ("endpoint", "model")):
        return default
    try:
        return check(v)
    except (ConfigError, ValueError) as e:
        raise ValueError(f"kvstore: extra_config {key!r}: {e}") from None


def _name(v: Any) -> str:
    # length and control characters: kvstore.keys.Namespace refuses them, naming the field
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"expected a non-empty string, got {v!r}")
    return v


def _revision(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


_V1 = (
    "kvstore's SGLang backend implements the zero-copy v1 calls only: "
    'set "interface_v1": 1 in --hicache-storage-backend-extra-config'
)


class _HostPages:
    """SGLang's host pool (MHATokenToKVPoolHost) as per-layer K and V pages ``[pages, page_size, H, D]``:
    views of its ``kv_buffer``, whatever its layout, for kvstore.kvbuffers.PagedKV."""

    def __init__(self, pool: Any) -> None:
        layout = getattr(pool, "layout", None)
        if layout not in LAYOUTS:
            raise ValueError(
                f"kvstore: the host pool layout {layout!r} is not supported; use --hicache-mem-layout "
                f"one of {', '.join(LAYOUTS)}"
            )
        kv = pool.kv_buffer
        if not isinstance(kv, torch.Tensor) or not hasattr(pool, "head_num"):
            raise ValueError(f"kvstore: {type(pool).__name__} is not an MHA host pool (MLA is not supported)")
        ps, n_layers = int(pool.page_size), int(pool.layer_num)
        pages = int(pool.size) // ps
        H, D = int(pool.head_num), int(pool.head_dim)
        if getattr(pool, "v_head_dim", D) != D:
            raise ValueError("kvstore: K and V head dims differ; kvstore blocks need one head_dim")
        per_layer: list[torch.Tensor] = []  # [2, pages, ps, H, D] per layer
        for layer in range(n_layers):
            if layout == "layer_first":  # [2, L, size, H, D]
                x = kv[:, layer, : pages * ps].unflatten(1, (pages, ps))
            elif layout == "page_first":  # [2, size, L, H, D]
                x = kv[:, : pages * ps, layer].unflatten(1, (pages, ps))
            else:  # page_first_direct: [2, pages, L, ps, H, D]
                x = kv[:, :pages, layer]
            per_layer.append(x)
        self.kv = per_layer
        self.k = [x[0] for x in per_layer]
        self.v = [x[1] for x in per_layer]
        self.page_size = ps
        if kv.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
            raise LayoutError(
                f"SGLang keeps this KV cache in {kv.dtype} (--kv-cache-dtype fp8): kvstore keeps K/V in "
                "the model's dtype, and an fp8 KV cache is not supported; run SGLang with "
                "--kv-cache-dtype auto"
            )
        self.layout = KVLayout(
            num_layers=n_layers,
            num_kv_heads=H,
            head_dim=D,
            dtype=dtype_name(kv.dtype),
            block_tokens=ps,
        )

    def paged(self, host_indices: torch.Tensor, n: int) -> PagedKV:
        """The pages holding ``host_indices`` (``n`` pages of ``page_size`` consecutive slots, as
        SGLang's host allocator hands them out). Raises LayoutError otherwise."""
        ps = self.page_size
        idx = torch.as_tensor(host_indices, dtype=torch.int64).view(-1)
        if idx.numel() != n * ps:
            raise LayoutError(f"{n} pages need {n * ps} host indices, got {idx.numel()}")
        rows = idx.view(n, ps)
        first = rows[:, 0]
        if bool((first % ps).any()) or not torch.equal(rows - first[:, None], _offsets(ps).expand(n, ps)):
            raise LayoutError("host indices are not whole pages (page_size consecutive, aligned slots)")
        return PagedKV.blocks(self.k, self.v, first // ps, n * ps, kv=self.kv)


def _offsets(ps: int) -> torch.Tensor:
    return torch.arange(ps, dtype=torch.int64)[None, :]


__all__: Sequence[str] = ["KVStoreHiCache"]
