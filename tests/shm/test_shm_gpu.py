"""The same-host data plane on a GPU host: the hbm pool on cuda:0 shared by CUDA IPC, the ram pool
page-locked, destinations and sources on the GPU. Run wherever CUDA and cupy exist (./dev gpu-check)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.kvbuffers import PagedKV
from kvstore.wire.messages import Finish, Locate, LocateOk
from tests.hardening.conftest import (
    LAYOUT,
    NS,
    T,
    assert_exact,
    client,
    endpoint_of,
    prefix_kv,
    random_tokens,
    write_config,
)
from tests.shm.clients import SHM, attached, socket_client, vllm_buffers
from tests.shm.spy import sent_ops


def _cupy_works() -> bool:
    """cupy imports and sees a device (installed is not enough: a build for another CUDA fails here)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - any failure means no CUDA IPC here
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        not _cupy_works(), reason="needs cupy for torch's CUDA (./dev setup; or pip install -e .[cuda12])"
    ),
]


def gpu_config(tmp_path: Path, **policy: Any) -> Path:
    return write_config(
        tmp_path,
        server=SHM,
        hbm={"device": "cuda:0", "capacity": "256KiB"},
        ram={"codec": "fp8", "pin_memory": True},
        policy={"promote_on_hit": False, **policy},
    )


def test_hbm_on_a_gpu_is_read_through_cuda_ipc_into_gpu_and_cpu_destinations(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = gpu_config(tmp_path)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(1)
    a = random_tokens(rng, 6)
    want = prefix_kv(a)
    with attached(ep) as c:
        m = c._shm.mapping()
        assert m is not None and m.tiers == ["hbm", "ram"]  # the hbm pool is mapped by IPC
        ops = sent_ops(c, monkeypatch)  # every read below through the mapping, none over the socket
        assert c.put_from(a, want.cuda()).stored == 6
        out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.float16, device="cuda")
        r = c.get_into(a, out)
        assert r.tiers == ["hbm"] * 6
        assert torch.equal(out.cpu(), want)
        got = c.get(a)  # a CPU destination, from GPU memory
        assert_exact(a, got.kv, got.matched_tokens)
        caches, ids = vllm_buffers(len(a) // 2)
        caches = [x.cuda() for x in caches]
        paged = PagedKV.vllm(caches, ids, len(a))
        assert c.get_into(a, paged).matched_blocks == 6
        back = paged.read(0, torch.empty(LAYOUT.shape(6 * T), dtype=torch.float16, device="cuda"))
        assert torch.equal(back.cpu(), want)
        assert "locate" in ops and "get" not in ops, ops


def test_ram_frames_are_decoded_on_the_gpu_as_the_socket_decodes_them(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = gpu_config(tmp_path)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(2)
    a = random_tokens(rng, 6)
    with attached(ep) as c, socket_client(ep) as s:
        assert c.put(a, prefix_kv(a)).stored == 6
        c.evict(tier="hbm")
        ref = s.get(a)
        assert ref.tiers == ["ram"] * 6 and ref.kv is not None
        out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.float16, device="cuda")
        ops = sent_ops(c, monkeypatch)
        r = c.get_into(a, out)
        assert r.tiers == ["ram"] * 6
        assert "locate" in ops and "get" not in ops, ops  # decoded here, on the GPU, not by the daemon
        torch.testing.assert_close(out.cpu(), ref.kv, rtol=0, atol=0)


def test_a_lapsed_lease_on_gpu_hbm_is_a_miss(daemons: Any, tmp_path: Path) -> None:
    cfg = gpu_config(tmp_path, pin_lease="300ms")
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(3)
    a, b = random_tokens(rng, 6), random_tokens(rng, 6)
    with attached(ep) as c, client(ep) as other:
        assert c.put(a, prefix_kv(a)).stored == 6
        m = c._shm.mapping()
        assert m is not None
        reply = c._conn.call(Locate(ns=NS.id, tokens=a, tiers=m.tiers), idempotent=True)
        assert isinstance(reply, LocateOk)
        time.sleep(0.6)
        other.evict(all=True)
        assert other.put(b, prefix_kv(b)).stored == 6
        out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.float16, device="cuda")
        assert m.read_blocks(reply.blocks, LAYOUT, out, 0, reply.staging) == 0
        c._conn.call(Finish(handle=reply.handle, used=0), idempotent=True)


@pytest.mark.parametrize("tier", ["hbm", "ram"])
def test_a_read_on_a_side_stream_waits_for_its_own_copies_not_the_engine_s_stream(
    daemons: Any, tmp_path: Path, tier: str
) -> None:
    """An engine's loading thread reads on its own stream while the engine's stream runs a forward
    pass: get_into returns once its copies are done (the blocks checked right), while the engine's
    stream still runs (a whole-device wait would have waited for it)."""
    cfg = gpu_config(tmp_path)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(4)
    a = random_tokens(rng, 6)
    want = prefix_kv(a)
    with attached(ep) as c, socket_client(ep) as s:
        assert c.put(a, want).stored == 6
        if tier == "ram":
            c.evict(tier="hbm")
        ref = s.get(a)
        assert ref.tiers == [tier] * 6 and ref.kv is not None
        caches, ids = vllm_buffers(len(a) // 2)
        paged = PagedKV.vllm([x.cuda() for x in caches], ids, len(a))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # a first read page-locks the pools here and allocates: CUDA
            assert c.get_into(a, paged).matched_blocks == 6  # may sync the device for that, once
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # the engine's forward pass: seconds of GPU time on its stream
        engine = torch.cuda.current_stream()
        with torch.cuda.stream(side):
            r = c.get_into(a, paged)
        assert not engine.query(), "get_into waited for the engine's stream"
        assert r.matched_blocks == 6 and r.tiers == [tier] * 6
        back = paged.read(0, torch.empty(LAYOUT.shape(6 * T), dtype=torch.float16, device="cuda"))
        torch.cuda.synchronize()
        torch.testing.assert_close(back.cpu(), ref.kv, rtol=0, atol=0)
