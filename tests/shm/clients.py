"""The clients the shared-memory tests attach to real daemons, and the destinations they fill."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvstore.client import KVStoreClient
from tests.hardening.conftest import (
    LAYOUT,
    MODEL,
    T,
    assert_exact,
    client,
)

SHM = {"shm_staging": "1MiB", "shm_staging_per_client": "512KiB"}


def socket_client(endpoint: str) -> KVStoreClient:
    return KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=10.0, shared_memory=False)


def attached(endpoint: str, **kw: Any) -> KVStoreClient:
    c = client(endpoint, **kw)
    c.ping()
    c.lookup([])
    assert c.shared_memory, "an ipc client of the daemon's user is offered shared memory"
    return c


def shm_stats(c: KVStoreClient) -> dict[str, Any]:
    shm = c.stats()["server"]["shm"]
    assert isinstance(shm, dict)
    return shm


def vllm_buffers(blocks: int, block_size: int = 2, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """vLLM-shaped per-layer caches ``[2, num_blocks, block_size, H, D]`` and shuffled block ids."""
    caches = [
        torch.zeros(2, 2 * blocks, block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=torch.float16)
        for _ in range(LAYOUT.num_layers)
    ]
    ids = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(seed))[:blocks]
    return caches, ids


def assert_served(c: KVStoreClient, toks: np.ndarray) -> None:
    """Every block of ``toks`` is served, bit for bit."""
    got = c.get(toks)
    assert got.matched_blocks == len(toks) // T
    assert_exact(toks, got.kv, got.matched_tokens)
