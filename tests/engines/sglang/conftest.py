"""SGLang's host pool and dynamic storage factory around a real kvstore daemon.

These tests run in SGLang's own environment (``KVSTORE_ENGINE=sglang``, made by ``./dev engines``):
SGLang 0.5.x imported on the CPU torch, its host pools built with ``device="cpu"``. Device <-> host
copies need a GPU, so pages are written into the host pool directly, as a backup would leave them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVSTORE_ENGINE") != "sglang":
    collect_ignore_glob = ["test_*.py"]  # the main suite has no SGLang
else:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from tests.hardening.conftest import daemons, write_config  # noqa: F401 - a fixture

PAGE, LAYERS, HEADS, HDIM = 4, 3, 2, 8
MODEL = "sglang-test-model"


def host_pool(layout: str, dtype: Any = None) -> Any:
    """A real MHATokenToKVPoolHost over a CPU device pool (page size PAGE)."""
    dev = MHATokenToKVPool(
        size=64,
        page_size=PAGE,
        dtype=dtype or torch.bfloat16,
        head_num=HEADS,
        head_dim=HDIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    info = dev.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
    )


def storage_config(endpoint: str, *, tp_rank: int = 0, model: str = MODEL, layout: str = "page_first") -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
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


def backend(endpoint: str, pool: Any, **kw: Any) -> Any:
    """The backend as SGLang's cache controller builds it: the dynamic factory, then the host pool."""
    store = StorageBackendFactory.create_backend(
        "dynamic", storage_config(endpoint, layout=pool.layout, **kw), pool
    )
    store.register_mem_pool_host(pool)
    return store


@pytest.fixture
def daemon(daemons: Callable[..., Any], tmp_path: Path) -> Iterator[Any]:
    """A real kvstore daemon with raw tiers (bit-exact) and shared memory."""
    cfg = write_config(
        tmp_path,
        server={"shm_staging": "4MiB", "shm_staging_per_client": "2MiB"},
        hbm={"device": "cpu", "capacity": "4MiB"},
        ram={"capacity": "4MiB", "codec": "raw"},
        policy={"page_bytes": "1KiB"},
    )
    yield daemons(cfg)
