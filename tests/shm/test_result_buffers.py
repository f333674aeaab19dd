"""A same-host client's get results come from its kvstore.hostmem.HostBuffers: a dropped result's buffer serves the
next get, and a result the caller keeps is never written by the gets after it (MIN_BYTES and STEP
lowered for the tests' 1 KiB blocks)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import hostmem
from tests.hardening.conftest import (
    LAYOUT,
    assert_exact,
    client,
    endpoint_of,
    prefix_kv,
    random_tokens,
    write_config,
)


@pytest.fixture
def small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers kept for every result size (the tests' blocks are 1 KiB)."""
    monkeypatch.setattr(hostmem, "MIN_BYTES", 0)
    monkeypatch.setattr(hostmem, "STEP", 4096)


def test_gets_reuse_dropped_results_and_never_write_a_kept_one(
    daemons: Any, tmp_path: Path, small_buffers: None
) -> None:
    cfg = write_config(tmp_path)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(5)
    a, b = random_tokens(rng, 12), random_tokens(rng, 12)
    with client(ep) as c:
        c.lookup([])  # the hello, which brings the offer
        assert c.shared_memory  # each get's result: a fresh tensor the client fills
        assert c.put(a, prefix_kv(a)).stored == 12 and c.put(b, prefix_kv(b)).stored == 12
        kept = c.get(a)  # held by the caller
        assert kept.kv is not None
        for _ in range(5):
            r = c.get(b)
            assert r.kv is not None and r.kv.data_ptr() != kept.kv.data_ptr()
            assert_exact(b, r.kv, r.matched_tokens)
            del r
            gc.collect()
        assert c._buffers.reused >= 3  # each dropped result's buffer served the next
        assert_exact(a, kept.kv, kept.matched_tokens)  # never written by the gets after it


def test_a_closed_client_keeps_no_result_memory(daemons: Any, tmp_path: Path, small_buffers: None) -> None:
    cfg = write_config(tmp_path)
    ep = endpoint_of(cfg)
    daemons(cfg)
    a = random_tokens(np.random.default_rng(6), 12)
    with client(ep) as c:
        assert c.put(a, prefix_kv(a)).stored == 12
        kept = c.get(a)
        assert c.get(a).matched_blocks == 12  # a result dropped at once: its buffer kept for the next
        gc.collect()
        assert c._buffers.kept > 0
    assert c._buffers.kept == 0  # closing let it go
    del kept
    gc.collect()
    assert c._buffers.kept == 0  # and a result dropped after the close is not kept either


def test_a_get_of_a_prompt_larger_than_a_host_reserves_only_what_is_held(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the result was sized for the whole prompt before anything was asked: a 128K-token prompt of a
    # 70B model (40 GiB) with one block stored raised MemoryError where the socket served the block
    from kvstore import client as client_module
    from tests.shm.spy import sent_ops

    cfg = write_config(tmp_path)
    daemons(cfg)
    rng = np.random.default_rng(8)
    prompt = random_tokens(rng, 40)
    with client(endpoint_of(cfg)) as c:
        assert c.put(prompt[: 3 * 4], prefix_kv(prompt[: 3 * 4])).stored == 3
        block = LAYOUT.block_nbytes
        monkeypatch.setattr(client_module, "SIZE_BY_LOOKUP", 10 * block)  # the prompt's 40 blocks are past it
        ops = sent_ops(c, monkeypatch)
        r = c.get(prompt)
        assert ops[:2] == ["lookup", "locate"] and r.kv is not None and r.kv.shape[2] == 3 * 4
        assert_exact(prompt, r.kv, r.matched_tokens)
        ops.clear()
        r = c.get(prompt[:32])  # 8 blocks: reserved whole, nothing asked first
        assert ops[0] == "locate" and r.matched_blocks == 3
