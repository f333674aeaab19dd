"""The vLLM connector's settings, the namespace it stores under, and its connected clients.

The namespace holds everything that changes K/V: the model and revision, the weights'
quantization and ``hf_overrides``, the layout of this instance's share of the model, the tensor-
and pipeline-parallel ranks, the LoRA adapter and vLLM's ``cache_salt`` (hashed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.config import check_connect_endpoint
from kvstore.errors import ConfigError, KVStoreError, LayoutError
from kvstore.integrations.backoff import Backoff
from kvstore.integrations.weights import Weights, weights_id
from kvstore.layout import KVLayout, dtype_name
from kvstore.wire.protocol import Limits

log = logging.getLogger("kvstore.integrations.vllm")

MAX_CLIENTS = 16  # distinct (LoRA, cache salt) namespaces kept connected per process
QUOTA_RETRY = (
    300.0  # seconds before a new variant is tried again after the daemon's namespace quota refused one
)


@dataclass(frozen=True)
class Settings:
    endpoint: str | None = None
    tenant: str = "default"
    model: str | None = None
    block_tokens: int = 64
    timeout: float = 5.0
    load: bool = True
    save: bool = True
    save_outputs: bool = True
    shared_memory: bool | None = None
    max_variants: int = 32

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        """The settings in vLLM's ``kv_connector_extra_config``, each checked (ConfigError naming the
        key and what it takes): a typo or a string where a number goes must stop the engine at
        start, not fail every call later."""
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; kvstore takes {sorted(known)}"
            )
        checks: dict[str, Callable[[Any], Any]] = {
            "endpoint": _endpoint,
            "tenant": _text,
            "model": _text,
            "block_tokens": _count,
            "timeout": seconds,
            "load": flag,
            "save": flag,
            "save_outputs": flag,
            "shared_memory": flag,
            "max_variants": _count,
        }
        values: dict[str, Any] = {}
        for key, v in extra.items():
            if v is None and key in ("endpoint", "model", "shared_memory"):
                values[key] = None
                continue
            try:
                values[key] = checks[key](v)
            except ValueError as e:
                raise ConfigError(f"kv_connector_extra_config {key!r}: {e}") from None
        return cls(**values)


def flag(v: Any) -> bool:
    """A boolean setting: true/false (JSON), or the strings true/false, yes/no, on/off, 1/0. Any
    other value raises ValueError (the string "false" is not true)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError(f"expected true or false, got {v!r}")


def seconds(v: Any) -> float:
    """A positive, finite number of seconds: a number or its text ("5", "2.5"); ValueError otherwise."""
    n = _number(v)
    if not (n > 0 and math.isfinite(n)):
        raise ValueError(f"expected a positive number of seconds, got {v!r}")
    return n


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _number(v: Any) -> float:
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            pass
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise ValueError(f"expected a number, got {v!r}")


def _count(v: Any) -> int:
    n = _number(v)
    if not math.isfinite(n) or n != int(n) or n < 1:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return int(n)


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a non-empty string, got {v!r}")
    return v


def _endpoint(v: Any) -> str:
    try:
        return check_connect_endpoint(v)  # tcp://*:5555 is where a daemon listens, not an address
    except ConfigError as e:
        raise ValueError(str(e)) from None


@dataclass(frozen=True)
class Variant:
    """What, besides the model's name, changes a request's K/V: the base weights (as the scheduler
    named them: the workers take the name from it, with each transfer), its LoRA adapter and cache salt."""

    lora: str = ""
    salt: str = ""  # sha256 of vLLM's cache_salt: the salt itself is never sent nor logged
    base: str = ""  # weights.weights_id of the model vLLM loaded

    @classmethod
    def of(cls, request: Any, weights: Weights, base: str = "") -> Variant:
        """The variant of ``request`` on base weights ``base``. A LoRA adapter is named by its weights
        as its files are now (``weights.name``): vLLM's adapter id is its load order, and a name may
        come back with retrained weights, after a restart or reloaded in place."""
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None)
        return cls(
            lora=""
            if lora is None
            else f"{lora.lora_name}@{weights.name(str(getattr(lora, 'lora_path', '') or ''))}",
            salt="" if not salt else hashlib.sha256(str(salt).encode()).hexdigest()[:32],
            base=base,
        )

    @property
    def plain(self) -> bool:
        """No adapter, no salt: the model's own K/V."""
        return not self.lora and not self.salt

    @property
    def adapter(self) -> str:
        """The LoRA adapter's name ("" for none)."""
        return self.lora.rpartition("@")[0]


def model_layout(vllm_config: Any, block_tokens: int) -> KVLayout:
    """The K/V layout of this vLLM instance's share of the model (its pipeline stage's layers, its
    tensor-parallel rank's KV heads), in the dtype vLLM keeps K/V in."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(mc, "use_mla", False):
        raise LayoutError("kvstore's vLLM connector keeps per-head K and V; MLA models are not supported")
    if getattr(vllm_config, "speculative_config", None) is not None:
        # a drafter's attention layers (EAGLE, MTP, a draft model) share the target's KV cache: their
        # K/V is no function of the target's layers kvstore keeps, and vLLM registers them beside
        raise LayoutError(
            "kvstore's vLLM connector keeps the target model's layers; speculative decoding "
            "(--speculative-config) is not supported with it"
        )
    cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
    if cache_dtype not in ("auto", str(mc.dtype).removeprefix("torch.")):
        raise LayoutError(
            f"kvstore keeps K/V in the model's dtype ({mc.dtype}); --kv-cache-dtype {cache_dtype} is not supported"
        )
    return KVLayout(
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        dtype=dtype_name(mc.dtype),
        block_tokens=block_tokens,
    )


# The KV cache groups whose blocks stay the request's for its whole life: a group of another kind
# (sliding window, chunked local, R-SWA) frees the blocks behind its window while the request runs, and
# a save planned on the request's block list would read blocks vLLM has given to another request.
_WHOLE_ATTENTION = ("FullAttentionSpec",)


def check_attention(vllm_config: Any, kv_cache_config: Any) -> None:
    """LayoutError unless every layer keeps the K/V of every token of a request in the blocks vLLM
    gave it, in the order of its block table: no sliding-window or chunked-local attention (vLLM
    frees their blocks behind the window as the request runs), no decode context parallelism
    (tokens interleaved across ranks)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if int(getattr(pc, "decode_context_parallel_size", 1) or 1) > 1:
        raise LayoutError(
            "kvstore's vLLM connector reads a request's tokens in the order of its block table; "
            "--decode-context-parallel-size > 1 is not supported"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:  # the connector follows one block table per request: the first group's
        raise LayoutError(
            f"kvstore's vLLM connector follows one block table per request, and this model's KV cache "
            f"has {len(groups)} groups ({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}); "
            "it is not supported"
        )
    kinds = {type(s).__name__ for group in groups for s in _members(group.kv_cache_spec)}
    packed = [
        s
        for group in groups
        for s in _members(group.kv_cache_spec)
        if getattr(s, "num_head_slots", None) is not None
        or getattr(s, "state_content_bytes", None) is not None
    ]
    if packed:  # B12X, ROCm's, quantized caches: K and V are not one head's side by side
        raise LayoutError(
            "this model's attention backend packs its KV cache pages "
            f"({getattr(packed[0], 'num_head_slots', None) or 'per head'} head slots of "
            f"{getattr(packed[0], 'state_content_bytes', None) or 'dense'} bytes); kvstore's vLLM "
            "connector reads unpacked caches only (FlashAttention, FlashInfer, Triton, FlexAttention "
            "or the CPU backend, without a quantized KV cache)"
        )
    other = sorted(kinds - set(_WHOLE_ATTENTION))
    window = getattr(mc, "get_sliding_window", lambda: None)() if kv_cache_config is None else None
    chunk = getattr(mc, "attention_chunk_size", None) if kv_cache_config is None else None
    if other or window or chunk:
        what = ", ".join(other) if other else "sliding-window" if window else "chunked-local"
        raise LayoutError(
            f"kvstore's vLLM connector keeps every token's K/V, and this model's attention ({what}) "
            "has vLLM free the blocks behind its window while a request runs; it is not supported "
            "(a model of full attention only, or one vLLM runs with --disable-sliding-window)"
        )


def _members(spec: Any) -> list[Any]:
    """The specs of a group's layers: UniformTypeKVCacheSpecs holds one kind per layer."""
    members = getattr(spec, "kv_cache_specs", None)
    return list(members.values()) if isinstance(members, dict) else [spec]


def namespace_revision(vllm_config: Any, ranks: tuple[int, int], variant: Variant) -> str:
    """The namespace's revision field: the model's revision and everything else that changes its K/V
    for the same weights' name (the weights themselves, as ``weights.weights_id`` names them, this
    shard, the weights' quantization, ``hf_overrides``, the variant)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    parts = [
        f"rev={mc.revision or ''}",
        *([variant.base] if variant.base else []),
        f"tp={ranks[0]}/{pc.tensor_parallel_size}",
        f"pp={ranks[1]}/{pc.pipeline_parallel_size}",
    ]
    quantization = getattr(mc, "quantization", None)
    if quantization:  # quantized weights compute other K/V than the model's own
        parts.append(f"q={quantization}")
    overrides = _overrides_id(getattr(mc, "hf_overrides", None))
    if overrides:  # a changed config (rope scaling, layers...) computes other K/V
        parts.append(f"hf={overrides}")
    if variant.lora:
        parts.append(f"lora={variant.lora}")
    if variant.salt:
        parts.append(f"salt={variant.salt}")
    return ";".join(parts)


def _overrides_id(overrides: Any) -> str:
    """A short, stable name for vLLM's ``hf_overrides`` (a dict, or a function of the config)."""
    if not overrides:
        return ""
    if callable(overrides):
        text = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', repr(overrides))}"
    else:
        text = json.dumps(overrides, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_name(vllm_config: Any, settings: Settings) -> str:
    name = settings.model or str(vllm_config.model_config.model)
    if len(name.encode()) > 200:  # a namespace field holds 256 bytes
        name = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
    return name


class VariantRefused(KVStoreError):
    """A request's variant (LoRA adapter, cache salt) gets no namespace: over ``max_variants`` or the
    tenant's namespace quota. Its requests are computed as without kvstore."""

    code = "variant_refused"


class ClientsClosed(KVStoreError):
    """The connector's clients were closed (the engine is shutting down): no new one is made."""

    code = "closed"


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
        self.base = weights_id(str(mc.model), mc.revision)
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
                raise ClientsClosed("kvstore's clients are closed (the connector shut down)")
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
            raise ClientsClosed("kvstore's clients are closed (the connector shut down)")
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
            timeout=s.timeout,
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
        once, and ``get`` raises ClientsClosed."""
        with self._lock:
            self._closed = True
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:  # outside the lock
            c.close(abort=True)


def _close_aside(client: KVStoreClient) -> None:
    """Close ``client`` on a thread of its own: its close waits for the call it runs, if any."""
    threading.Thread(target=client.close, name="kvstore-client-close", daemon=True).start()


def worker_ranks() -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:  # not initialised: a single process
        return 0, 0
