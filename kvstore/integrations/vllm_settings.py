"""The vLLM connector's settings, the namespace it stores under, and its connected clients.

The namespace holds everything that changes K/V: the model and revision, the layout of this
instance's share of the model, the tensor- and pipeline-parallel ranks, the LoRA adapter and
vLLM's ``cache_salt`` (hashed).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError, LayoutError
from kvstore.integrations.backoff import Backoff
from kvstore.layout import KVLayout, dtype_name

log = logging.getLogger("kvstore.integrations.vllm")

MAX_CLIENTS = 16  # distinct (LoRA, cache salt) namespaces kept connected per process


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

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; kvstore takes {sorted(known)}"
            )
        try:
            s = cls(**extra)
        except TypeError as e:
            raise ConfigError(f"kv_connector_extra_config: {e}") from None
        if not isinstance(s.block_tokens, int) or s.block_tokens < 1:
            raise ConfigError(f"block_tokens must be a positive integer, got {s.block_tokens!r}")
        return s


@dataclass(frozen=True)
class Variant:
    """What, besides the model, changes a request's K/V: its LoRA adapter and cache salt."""

    lora: str = ""
    salt: str = ""  # sha256 of vLLM's cache_salt: the salt itself is never sent nor logged

    @classmethod
    def of(cls, request: Any) -> Variant:
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None)
        return cls(
            lora="" if lora is None else f"{lora.lora_name}#{lora.lora_int_id}",
            salt="" if not salt else hashlib.sha256(str(salt).encode()).hexdigest()[:32],
        )


def model_layout(vllm_config: Any, block_tokens: int) -> KVLayout:
    """The K/V layout of this vLLM instance's share of the model (its pipeline stage's layers, its
    tensor-parallel rank's KV heads), in the dtype vLLM keeps K/V in."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(mc, "use_mla", False):
        raise LayoutError("kvstore's vLLM connector keeps per-head K and V; MLA models are not supported")
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


def namespace_revision(vllm_config: Any, ranks: tuple[int, int], variant: Variant) -> str:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    parts = [
        f"rev={mc.revision or ''}",
        f"tp={ranks[0]}/{pc.tensor_parallel_size}",
        f"pp={ranks[1]}/{pc.pipeline_parallel_size}",
    ]
    if variant.lora:
        parts.append(f"lora={variant.lora}")
    if variant.salt:
        parts.append(f"salt={variant.salt}")
    return ";".join(parts)


def model_name(vllm_config: Any, settings: Settings) -> str:
    name = settings.model or str(vllm_config.model_config.model)
    if len(name.encode()) > 200:  # a namespace field holds 256 bytes
        name = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
    return name


class Clients:
    """Connected clients, one per namespace variant (and purpose), made on first use."""

    def __init__(
        self, vllm_config: Any, settings: Settings, layout: KVLayout, ranks: tuple[int, int]
    ) -> None:
        self._cfg, self._settings, self._layout, self._ranks = vllm_config, settings, layout, ranks
        self._clients: dict[tuple[Variant, str], KVStoreClient] = {}
        self._lock = threading.Lock()
        # lookups are on the scheduler's path: a daemon that did not answer is left alone a while
        self.backoff = Backoff(log)
        self.available, self.failed = self.backoff.available, self.backoff.failed

    def get(self, variant: Variant, purpose: str) -> KVStoreClient:
        with self._lock:
            c = self._clients.pop((variant, purpose), None)
            if c is None:
                if len(self._clients) >= MAX_CLIENTS:
                    oldest = next(iter(self._clients))
                    self._clients.pop(oldest).close()
                s = self._settings
                c = KVStoreClient(
                    s.endpoint,
                    model=model_name(self._cfg, s),
                    layout=self._layout,
                    tenant=s.tenant,
                    timeout=s.timeout,
                    revision=namespace_revision(self._cfg, self._ranks, variant),
                    shared_memory=s.shared_memory,
                    retries=0 if purpose == "lookup" else 2,  # the scheduler does not wait twice
                )
            self._clients[(variant, purpose)] = c  # most recently used last
            return c

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


def worker_ranks() -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:  # not initialised: a single process
        return 0, 0
