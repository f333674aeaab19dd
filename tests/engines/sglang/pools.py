"""SGLang's own objects as its cache controller builds them, on the CPU: a host memory pool over a
device pool, the storage config, and kvstore's backend through SGLang's dynamic factory. Shared by
the engine tests and bench/sglang_backend.py; needs SGLang (the ``sglang`` engine environment)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory


def host_pool(
    layout: str,
    *,
    tokens: int,
    page: int,
    layers: int,
    heads: int,
    head_dim: int,
    dtype: Any = torch.bfloat16,
    start_layer: int | None = None,
) -> Any:
    """A real MHATokenToKVPoolHost (twice the device pool's size) over a CPU MHATokenToKVPool;
    ``start_layer``: a pipeline stage's first layer (its ``layers`` from there on)."""
    stage = {} if start_layer is None else {"start_layer": start_layer, "end_layer": start_layer + layers - 1}
    dev = MHATokenToKVPool(
        size=tokens,
        page_size=page,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        **stage,
    )
    info = dev.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        page,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
    )


def storage_config(
    endpoint: str,
    *,
    model: str,
    layout: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> HiCacheStorageConfig:
    """The config SGLang hands a dynamic backend, naming kvstore's (extra_config, as the flag passes it)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=layout.startswith("page_first"),
        model_name=model,
        extra_config={
            "backend_name": "kvstore",
            "module_path": "kvstore.integrations.sglang",
            "class_name": "KVStoreHiCache",
            "interface_v1": 1,
            "endpoint": endpoint,
        },
    )


def attach(config: HiCacheStorageConfig, pool: Any) -> Any:
    """The backend as SGLang's cache controller builds it: the dynamic factory, then the host pool."""
    store = StorageBackendFactory.create_backend("dynamic", config, pool)
    store.register_mem_pool_host(pool)
    return store
