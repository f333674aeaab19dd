"""Host buffers for get results: reused only once nothing refers to them, and bounded
(tests/shm/test_result_buffers.py: a real daemon's gets)."""

from __future__ import annotations

import gc

import numpy as np
import torch

from kvstore.hostmem import MIN_BYTES, HostBuffers

MB = 1 << 20


def ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_is_handed_out_again_once_its_view_is_gone() -> None:
    b = HostBuffers()
    first = b.get(MIN_BYTES + 100)
    where = ptr(first)
    del first
    gc.collect()
    again = b.get(MIN_BYTES + 100)
    assert ptr(again) == where and b.reused == 1
    smaller = b.get(MIN_BYTES + 100)  # the only kept one is in use: a new one
    assert ptr(smaller) != where


def test_a_buffer_some_view_of_the_result_still_holds_is_never_handed_out() -> None:
    b = HostBuffers()
    t = torch.from_numpy(b.get(8 * MB)).view(torch.float16)
    part = t[100:200]  # a view of the result, kept by the caller
    part.fill_(3.0)
    where = t.data_ptr()
    del t
    gc.collect()
    other = b.get(8 * MB)
    assert ptr(other) != where and b.reused == 0
    other.fill(0xFF)
    assert torch.equal(part, torch.full((100,), 3.0, dtype=torch.float16))
    del part, other
    gc.collect()
    assert b.kept == 2 * 8 * MB


def test_sizes_round_up_to_a_step_and_serve_requests_of_their_class_only() -> None:
    b = HostBuffers()
    a = b.get(6 * MB + 1)  # kept as 8 MiB
    where = ptr(a)
    del a
    gc.collect()
    assert b.kept == 8 * MB
    assert ptr(b.get(10 * MB)) != where  # larger: not this one
    gc.collect()
    c = b.get(7 * MB)  # its class: the 8 MiB buffer, 7 MiB of it
    assert c.nbytes == 7 * MB and ptr(c) == where


def test_free_buffers_kept_stay_under_the_bound_the_oldest_going_first() -> None:
    b = HostBuffers(keep_bytes=10 * MB)
    x0, x1, x2 = (b.get(4 * MB) for _ in range(3))
    ptrs = [ptr(x) for x in (x0, x1, x2)]
    del x0
    del x1
    del x2  # a third 4 MiB would pass 10 MiB: the oldest kept (x0's) is let go
    gc.collect()
    assert b.kept == 8 * MB
    assert {ptr(b.get(4 * MB)) for _ in range(2)} == set(ptrs[1:])
    gc.collect()
    huge = b.get(12 * MB)
    del huge
    gc.collect()
    assert b.kept <= 10 * MB  # larger than the bound: never kept


def test_small_buffers_are_malloc_s_to_keep() -> None:
    b = HostBuffers()
    x = b.get(MIN_BYTES - 1)
    del x
    gc.collect()
    assert b.kept == 0


def test_numpy_slices_of_a_buffer_keep_it_from_reuse() -> None:
    b = HostBuffers()
    a = b.get(8 * MB)
    part = a[:100]  # a slice of a slice: numpy would let it skip to the owner of the memory
    part[:] = 7
    where = ptr(a)
    del a
    gc.collect()
    other = b.get(8 * MB)
    assert ptr(other) != where
    other.fill(0)
    assert (part == 7).all()


def test_closed_buffers_keep_nothing_more() -> None:
    b = HostBuffers()
    x, y = b.get(8 * MB), b.get(8 * MB)
    del x
    gc.collect()
    assert b.kept == 8 * MB
    b.close()  # its client closed
    assert b.kept == 0
    del y  # a result the caller still held, dropped after
    gc.collect()
    assert b.kept == 0
