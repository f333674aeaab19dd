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
    collect_ignore_glob = ["test_*.py", "pools.py"]  # the main suite has no SGLang
else:
    import torch

    from tests.engines.sglang import pools
    from tests.hardening.conftest import daemons, write_config  # noqa: F401 - a fixture

PAGE, LAYERS, HEADS, HDIM = 4, 3, 2, 8
MODEL = "sglang-test-model"


def host_pool(layout: str, dtype: Any = None) -> Any:
    """A real MHATokenToKVPoolHost over a CPU device pool of 64 slots (page size PAGE)."""
    return pools.host_pool(
        layout, tokens=64, page=PAGE, layers=LAYERS, heads=HEADS, head_dim=HDIM, dtype=dtype or torch.bfloat16
    )


def storage_config(endpoint: str, *, tp_rank: int = 0, model: str = MODEL, layout: str = "page_first") -> Any:
    return pools.storage_config(endpoint, model=model, layout=layout, tp_rank=tp_rank, tp_size=2)


def backend(endpoint: str, pool: Any, **kw: Any) -> Any:
    """The backend as SGLang's cache controller builds it: the dynamic factory, then the host pool."""
    return pools.attach(storage_config(endpoint, layout=pool.layout, **kw), pool)


def daemon_config(tmp_path: Path, **server: Any) -> Path:
    """A daemon config with raw tiers (bit-exact) and shared memory; ``server`` keys added."""
    return write_config(
        tmp_path,
        server={"shm_staging": "4MiB", "shm_staging_per_client": "2MiB", **server},
        hbm={"device": "cpu", "capacity": "4MiB"},
        ram={"capacity": "4MiB", "codec": "raw"},
        policy={"page_bytes": "1KiB"},
    )


@pytest.fixture
def daemon(daemons: Callable[..., Any], tmp_path: Path) -> Iterator[Any]:
    """A real kvstore daemon with raw tiers (bit-exact) and shared memory."""
    yield daemons(daemon_config(tmp_path))
