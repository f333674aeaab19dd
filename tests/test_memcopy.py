"""Copier and copy_into: the same bytes as ``Tensor.copy_``, by memcpy where that is faster."""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.memcopy import Copier, _host_bytes, _rows, copy_into, scatter_rows


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (every byte value, NaN payloads included: bytes must match)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8).view(dtype).view(shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int64])
def test_a_prefix_copied_into_its_blocks_and_back_is_the_same_bytes(dtype: torch.dtype, threads: int) -> None:
    # the copies a put and a get make: [L, 2, n*T, H, D] <-> [n, L, 2, T, H, D] (runs of T*H*D)
    L, n, T, H, D = 4, 5, 16, 3, 64
    prefix = _random((L, 2, n * T, H, D), dtype)
    blocks = torch.empty((n, L, 2, T, H, D), dtype=dtype)
    copy_into(blocks.permute(1, 2, 0, 3, 4, 5), prefix.unflatten(2, (n, T)))
    back = torch.empty_like(prefix)
    for i in range(n):
        copy_into(back[:, :, i * T : (i + 1) * T], blocks[i])
    assert torch.equal(back.view(torch.uint8), prefix.view(torch.uint8))
    expected = torch.empty_like(blocks)
    expected.permute(1, 2, 0, 3, 4, 5).copy_(prefix.unflatten(2, (n, T)))
    assert torch.equal(blocks.view(torch.uint8), expected.view(torch.uint8))


def test_numpy_moves_host_bytes_of_one_dtype_and_torch_everything_else() -> None:
    big = torch.zeros(1 << 20, dtype=torch.bfloat16)
    assert _host_bytes(big, torch.ones_like(big))  # contiguous: memcpy, at any thread count
    strided = torch.zeros(2, 1 << 20, dtype=torch.bfloat16)[:, ::2]
    assert _host_bytes(strided, torch.ones_like(strided))
    assert not _host_bytes(big, big.float())  # a cast
    assert not _host_bytes(big[:16], big[:16].clone())  # too small to gain
    assert not _host_bytes(big.view(2, -1), big)  # shapes differ: copy_ broadcasts or raises
    assert not _host_bytes(torch.zeros(1, 1 << 16).expand(4, -1), torch.ones(4, 1 << 16))


def test_a_cast_and_a_broadcast_are_torch_s() -> None:
    wide = torch.randn(4, 1 << 15)
    out = torch.empty(4, 1 << 15, dtype=torch.bfloat16)
    assert torch.equal(copy_into(out, wide), wide.to(torch.bfloat16))
    row = torch.randn(1 << 15)
    assert torch.equal(copy_into(torch.empty(4, 1 << 15), row), row.expand(4, -1))
    with pytest.raises(RuntimeError):  # as copy_: several elements would be written to one place
        copy_into(torch.zeros(1, 1 << 16).expand(4, -1), torch.ones(4, 1 << 16))


def test_a_read_only_mapping_is_a_source(tmp_path: Path) -> None:
    # a client copies out of a pool it maps read-only (as kvstore.shm.segment maps it)
    data = _random((1 << 18,), torch.uint8)
    path = tmp_path / "pool"
    path.write_bytes(data.numpy().tobytes())
    with path.open("rb") as f:
        ro = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the array is not writable
        src = torch.from_numpy(np.frombuffer(ro, dtype=np.uint8))
    out = torch.empty_like(src)
    assert copy_into(out, src) is out
    assert torch.equal(out, data)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_a_copy_split_over_threads_is_the_same_bytes(threads: int) -> None:
    # sizes that do not divide evenly, both directions of the prefix <-> blocks transposition
    L, n, T, H, D = 7, 3, 64, 3, 64
    prefix = _random((L, 2, n * T, H, D), torch.bfloat16)
    copier = Copier(threads, part_bytes=1 << 12)  # every copy below is split
    try:
        blocks = torch.empty((n, L, 2, T, H, D), dtype=torch.bfloat16)
        copier.copy(blocks.permute(1, 2, 0, 3, 4, 5), prefix.unflatten(2, (n, T)))
        back = torch.empty_like(prefix)
        copier.copy(back.unflatten(2, (n, T)).permute(2, 0, 1, 3, 4, 5), blocks)
        assert torch.equal(back.view(torch.uint8), prefix.view(torch.uint8))
        flat = torch.empty(prefix.numel() * 2 + 5, dtype=torch.uint8)[5:]  # an odd offset
        copier.copy(flat, prefix.view(-1).view(torch.uint8))
        assert torch.equal(flat, prefix.view(-1).view(torch.uint8))
    finally:
        copier.close()


def test_copies_from_many_threads_at_once_share_the_helpers() -> None:
    from concurrent.futures import ThreadPoolExecutor

    copier = Copier(2, part_bytes=1 << 12)
    sources = [_random((8, 1 << 18), torch.uint8) for _ in range(6)]
    outs = [torch.empty_like(s) for s in sources]
    with ThreadPoolExecutor(3) as callers:
        list(callers.map(lambda i: copier.copy(outs[i], sources[i]), range(6)))
    assert all(torch.equal(o, s) for o, s in zip(outs, sources, strict=True))
    copier.close()  # and it can be used again: the helpers start anew
    assert torch.equal(copier.copy(outs[0].zero_(), sources[1]), sources[1])
    copier.close()


def test_a_copier_follows_torch_s_thread_count_unless_told(threads: int) -> None:
    assert Copier().threads is None and Copier(3).threads == 3
    src = _random((4, 1 << 20), torch.uint8)
    assert torch.equal(Copier().copy(torch.empty_like(src), src), src)
    with pytest.raises(ValueError, match="threads >= 1"):
        Copier(0)


def test_a_copier_leaves_devices_casts_and_broadcasts_to_torch() -> None:
    copier = Copier(2)
    wide = torch.randn(4, 1 << 16)
    assert torch.equal(
        copier.copy(torch.empty(4, 1 << 16, dtype=torch.bfloat16), wide), wide.to(torch.bfloat16)
    )
    with pytest.raises(RuntimeError):
        copier.copy(torch.zeros(1, 1 << 16).expand(4, -1), torch.ones(4, 1 << 16))
    copier.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_batch_s_copies_land_by_its_finish_each_the_same_bytes(threads: int) -> None:
    # a put's blocks into their pages: [L, 2, T, H, D] slices of a prefix, some pages contiguous
    L, n, T, H, D = 4, 9, 16, 3, 64
    prefix = _random((L, 2, n * T, H, D), torch.bfloat16)
    pages = torch.zeros((n, L, 2, T, H, D), dtype=torch.bfloat16)
    order = torch.randperm(n).tolist()
    pairs = [(pages[order[i]], prefix[:, :, i * T : (i + 1) * T]) for i in range(n)]
    pairs.append((torch.empty(3, 1 << 14), torch.randn(3, 1 << 14).to(torch.bfloat16)))  # a cast: copy_'s
    copier = Copier(threads)
    batch = copier.batch()
    try:
        for d, src in pairs:
            batch.add(d, src)
        batch.finish()
        batch.finish()  # nothing left: returns at once
    finally:
        copier.close()
    for i in range(n):
        assert torch.equal(
            pages[order[i]].view(torch.int16), prefix[:, :, i * T : (i + 1) * T].view(torch.int16)
        )
    assert torch.equal(pairs[-1][0], pairs[-1][1].float())


def test_a_batch_with_failed_copies_makes_every_other_copy_before_it_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # four copies on four threads: three fail (injected), one is slow. finish() raises only once the
    # slow one has landed: nothing is left running behind the caller (a pool's flush that returned
    # early would let a freed page be taken again while a copy still lands in it), nor queued
    import time

    import kvstore.memcopy as memcopy

    real = memcopy._memcpy
    copier = Copier(4, part_bytes=1)
    try:
        for _ in range(5):  # which thread takes which copy varies: a few rounds
            dsts = [torch.zeros(1 << 15, dtype=torch.int16) for _ in range(4)]
            batch = copier.batch()
            for d in dsts:
                batch.add(d, torch.ones(1 << 15, dtype=torch.int16))
            slow = dsts[3]

            def failing_but_one(d: torch.Tensor, s: torch.Tensor, slow: torch.Tensor = slow) -> None:
                if d is slow:
                    time.sleep(0.2)
                    real(d, s)
                    return
                time.sleep(0.01)
                raise RuntimeError("injected copy failure")

            monkeypatch.setattr(memcopy, "_memcpy", failing_but_one)
            with pytest.raises(RuntimeError, match="injected"):
                batch.finish()
            assert bool(slow.eq(1).all())  # landed before finish returned
            monkeypatch.setattr(memcopy, "_memcpy", real)
            batch.finish()  # nothing left over
    finally:
        copier.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_a_scatter_of_rows_is_index_copy_s_bytes_for_any_index_shape(dtype: torch.dtype) -> None:
    """Rows of a [2, blocks, 16, 3, 8] cache (vLLM's older layout): contiguous rows go by memcpy,
    strided ones (a row that is a transposed view) by ``index_copy_``; both land where
    ``index_copy_`` puts them, for a flat index and one shaped [n, k]."""
    ids = torch.randperm(20, generator=torch.Generator().manual_seed(4))[:12]
    src = _random((2, 12, 16, 3, 8), dtype)
    want = torch.zeros(2, 20, 16, 3, 8, dtype=dtype)
    want.view(torch.uint8).index_copy_(1, ids, src.view(torch.uint8))
    dst = torch.zeros_like(want)
    assert _rows(dst, 2) is not None and _rows(src, 2) is not None  # the memcpy path is taken
    assert scatter_rows(dst, 1, ids, src) is dst
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    dst.zero_()
    scatter_rows(dst, 1, ids.reshape(3, 4), src.unflatten(1, (3, 4)))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    # rows that are not contiguous: K as a transposed view of a [blocks, 3, 16, 2*8] cache
    cache = torch.zeros(20, 3, 16, 16, dtype=dtype)
    k = cache[..., :8].permute(0, 2, 1, 3)
    assert _rows(k, 1) is None
    scatter_rows(k, 0, ids, src[0])
    assert torch.equal(k.contiguous().view(torch.uint8), want[0].view(torch.uint8))
    assert not cache[..., 8:].view(torch.uint8).any()  # V's half untouched
    for row in (25, -1):  # past the end, or counted from it: refused as index_copy_ refuses them
        with pytest.raises(IndexError):
            scatter_rows(dst, 1, torch.tensor([row]), src[:, :1])
    with pytest.raises(ValueError, match="source"):  # one K/V row for two: refused, not broadcast
        scatter_rows(dst, 1, ids[:1], src[:1, :1])


def test_an_interrupted_copy_returns_only_once_every_helper_has_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while helpers still copy: their writes must not land after copy() is left (into a
    staging range given back and reused by the next put, say)."""
    import os
    import signal
    import threading
    import time
    import types

    import kvstore.memcopy as mc

    def slow_copyto(d: np.ndarray, s: np.ndarray, **kw: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)  # a helper still copying (a large chunk, page faults)
        np.copyto(d, s, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(mc, "np", types.SimpleNamespace(copyto=slow_copyto))
    cp = mc.Copier(2, part_bytes=1024)
    dst, src = torch.zeros(4, 4096), torch.ones(4, 4096)
    threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        cp.copy(dst, src)
    assert bool((dst == 1).all())  # every part landed before the interrupt was raised
    cp.close()
