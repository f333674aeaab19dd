"""Copying K/V between host tensors at memcpy speed, on one core or several.

A one-thread ``torch.Tensor.copy_`` of host memory runs at about half of what
the C library's ``memcpy`` reaches on the same core. Measured on a 2-core Xeon
VM for 94 MB of bfloat16 (GB/s):

    copy                                        torch copy_    np.copyto (memcpy)
    contiguous, 1 thread                          3.0-3.9        5.0-7.2
    contiguous, 2 threads                         7.7           12.4-13.6 (split in two)
    a prefix to its blocks (runs of 24 KB), 1     2.9-3.4        3.6-4.8
    the same, 2 threads                           6.8            6.6-8.9 (split in two)

``memcpy`` streams a large copy past the caches (non-temporal stores); one core
cannot saturate the memory bus, two nearly double it. So a host-to-host copy of
one dtype goes through ``np.copyto`` (which releases the GIL), split along its
first dimension over a Copier's threads when it is large; every other copy (a
device on either side, a cast, a broadcast) is ``copy_``'s.

A scatter of rows into an engine's paged buffers (``index_copy_``) moves each
row element by element on the CPU: 1.2-1.4 GB/s for rows of 6 KB (a 16-token
page of SmolLM2), against 4.1-4.4 GB/s for numpy's fancy assignment of the
same rows taken as single opaque elements, a memcpy each. ``scatter_rows`` does
the latter where the rows are contiguous host bytes.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

# numpy has no bfloat16 (nor float8): bytes are moved as unsigned integers of the same width
SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SMALL = 1 << 16  # below this the two conversions cost more than they save
PART_BYTES = (
    1 << 23
)  # the least a thread is handed: a hand-off costs 60-100 us on a VM (a 1.5 MB block's copy: 0.3 ms)


class Copier:
    """Host copies split over up to ``threads`` threads (None: torch's thread count at each copy,
    as the caller's process set it); the threads past the calling one are started when first needed.
    Thread-safe: concurrent copies share the helper threads."""

    def __init__(self, threads: int | None = None, *, part_bytes: int = PART_BYTES) -> None:
        """``part_bytes``: the least a thread is handed (one copy is split, or ``copy_many``'s pairs
        shared out, only where each thread gets that much)."""
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"a Copier needs threads >= 1 (or None), got {threads!r}")
        self.threads = threads
        self.part_bytes = max(1, part_bytes)
        self._helpers: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
        """Copy ``src`` into ``dst`` (as ``dst.copy_(src)``) and return ``dst``. ``non_blocking`` is
        passed to ``copy_`` for copies to or from a GPU."""
        threads = self.threads or torch.get_num_threads()
        if not _host_bytes(dst, src):
            return dst.copy_(src, non_blocking=non_blocking)
        parts = min(
            threads, dst.numel() * dst.element_size() // self.part_bytes, dst.shape[0] if dst.ndim else 1
        )
        if parts < 2:  # too small to hand out: on this thread, or on torch's threads if it has several
            return copy_into(dst, src, non_blocking=non_blocking)
        width = SAME_WIDTH[dst.element_size()]
        d, s = dst.view(width).numpy(), src.detach().view(width).numpy()
        bounds = [d.shape[0] * i // parts for i in range(parts + 1)]
        done: list[Future[None]] = []
        try:
            helpers = self._pool()
            for a, b in zip(bounds[1:-1], bounds[2:], strict=True):
                done.append(helpers.submit(np.copyto, d[a:b], s[a:b], casting="no"))
            np.copyto(d[: bounds[1]], s[: bounds[1]], casting="no")
        finally:
            _settle(done)
        return dst

    def batch(self) -> CopyBatch:
        """A CopyBatch: many copies, each too small to split (a hand-off costs tens of
        microseconds), run together on this Copier's threads."""
        return CopyBatch(self)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._helpers is None:
                n = max(1, (self.threads or os.cpu_count() or 2) - 1)
                self._helpers = ThreadPoolExecutor(n, "kvstore-copy")
            return self._helpers

    def close(self) -> None:
        """Stop the helper threads (after the copies they run); a later copy starts them again."""
        with self._lock:
            pool, self._helpers = self._helpers, None
        if pool is not None:
            pool.shutdown(wait=True)


class CopyBatch:
    """Copies gathered while their writer goes on, run by ``finish`` on the Copier's threads at once,
    shared out whole (each thread takes the next copy left): many copies, each too small to split.
    They run at the end, not as they come, because a helper that needs the GIL while the writer runs
    Python waits for the interpreter's switch interval (5 ms): measured on a 2-core VM, copies started
    as they came made a put's store no faster than copying on one core. The destinations of the
    copies pending at once must not overlap. Thread-safe: ``add`` from one thread while others call
    ``finish`` (the finishes run one at a time)."""

    def __init__(self, copier: Copier) -> None:
        self._copier = copier
        self._queue: deque[Callable[[], object]] = deque()  # append/popleft are atomic
        self._bytes = 0
        self._finishing = threading.Lock()  # a second finish waits for the copies the first one runs

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, now (not host bytes: a device, a cast) or by ``finish``; ``src`` is
        kept alive and must not change until then."""
        if not _host_bytes(dst, src):
            dst.copy_(src)
            return
        self._queue.append(lambda: _memcpy(dst, src))
        self._bytes += dst.numel() * dst.element_size()

    def add_rows(self, dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
        """``scatter_rows(dst, dim, index, src)``, now (a device on either side) or by ``finish``;
        ``index`` and ``src`` are kept alive and must not change until then."""
        if dst.device.type != "cpu" or src.device.type != "cpu":
            scatter_rows(dst, dim, index, src)
            return
        self._queue.append(lambda: scatter_rows(dst, dim, index, src))
        self._bytes += src.numel() * src.element_size()

    def finish(self) -> None:
        """Run the copies added so far; returns when every one has been made, also when one failed
        (the first failure is raised then, after all the others ran: none is left queued, and none is
        still running, to land after the caller moved on)."""
        with self._finishing:
            if not self._queue:  # nothing queued (a reader's flush, mostly): nothing to hand out
                return
            threads = self._copier.threads or torch.get_num_threads()
            helpers = min(threads - 1, len(self._queue) - 1, self._bytes // self._copier.part_bytes - 1)
            self._bytes = 0
            running: list[Future[None]] = []
            try:
                if helpers > 0:
                    pool = self._copier._pool()
                    for _ in range(helpers):
                        running.append(pool.submit(self._drain))
                self._drain()
            finally:
                _settle(running)

    def _drain(self) -> None:
        """Make the queued copies until none is left; the first failure is raised after the rest."""
        failed: BaseException | None = None
        while True:
            try:
                copy = self._queue.popleft()
            except IndexError:
                break
            try:
                copy()
            except BaseException as e:  # noqa: BLE001 - raised below, once the queue is empty
                failed = failed or e
        if failed is not None:
            raise failed


def _settle(running: list[Future[None]]) -> None:
    """Wait for every one of ``running``, then raise the first failure among them (if any).

    An interrupt (Ctrl-C) while waiting does not cut the wait short: the copies still running would
    land after the caller moved on (into a staging range given back, say, and reused). It is raised
    once they are done."""
    if not running:
        return
    interrupted: BaseException | None = None
    while True:
        try:
            wait(running)
            break
        except BaseException as e:  # noqa: BLE001 - raised below, once every copy has ended
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
    for f in running:
        f.result()


def copy_into(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` on the calling thread alone: by ``memcpy`` where that is faster than torch
    at its thread count (one thread, or both sides contiguous). Returns ``dst``."""
    if _host_bytes(dst, src) and (
        torch.get_num_threads() == 1 or (dst.is_contiguous() and src.is_contiguous())
    ):
        _memcpy(dst, src)
        return dst
    return dst.copy_(src, non_blocking=non_blocking)


def scatter_rows(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.index_copy_(dim, index, src)`` for an ``index`` of any shape: ``src`` is shaped
    ``dst.shape[:dim] + index.shape + dst.shape[dim+1:]``. On the host, when every row (the dims of
    ``dst`` after ``dim``) is contiguous in both, each row is one memcpy; otherwise ``index_copy_``.
    Returns ``dst``."""
    want = (*dst.shape[:dim], *index.shape, *dst.shape[dim + 1 :])
    if tuple(src.shape) != want:  # numpy would broadcast a mismatch where index_copy_ refuses it
        raise ValueError(f"scatter_rows: source {tuple(src.shape)} for rows of {want}")
    if (
        dst.dtype == src.dtype
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and not dst.requires_grad
    ):
        rows = _rows(dst, dim + 1)
        from_rows = _rows(src.detach(), dim + index.dim())
        if rows is not None and from_rows is not None and rows.dtype == from_rows.dtype:
            idx = index.cpu().numpy()
            if idx.size and idx.min() < 0:  # numpy would count it from the end, index_copy_ refuses it
                raise IndexError(f"scatter_rows: row {idx.min()} is out of bounds")
            rows[(slice(None),) * dim + (idx,)] = from_rows
            return dst
    flat = src.reshape(*dst.shape[:dim], index.numel(), *dst.shape[dim + 1 :]).to(dst.device)
    into = dst
    if dst.dtype == src.dtype and dst.element_size() in SAME_WIDTH:  # fp8 has no index_copy_ of its own
        width = SAME_WIDTH[dst.element_size()]
        into, flat = dst.view(width), flat.view(width)
    into.index_copy_(dim, index.reshape(-1).to(dst.device), flat)
    return dst


def _rows(t: torch.Tensor, k: int) -> np.ndarray | None:
    """A host tensor as a numpy array of its first ``k`` dims whose elements are its rows (dims
    ``k..``) as opaque bytes, sharing its memory; None where those rows are not contiguous."""
    if t.layout != torch.strided or t.is_conj() or t.is_neg() or t.is_quantized or t.numel() == 0:
        return None
    expect = 1
    for size, stride in zip(reversed(t.shape[k:]), reversed(t.stride()[k:]), strict=True):
        if size != 1 and stride != expect:
            return None
        expect *= size
    shape = (*t.shape[:k], expect)
    strides = (*t.stride()[:k], 1)
    flat = torch.as_strided(t, shape, strides).view(torch.uint8).numpy()
    return flat.view(np.dtype((np.void, expect * t.element_size())))[..., 0]


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    width = SAME_WIDTH[dst.element_size()]
    np.copyto(dst.view(width).numpy(), src.detach().view(width).numpy(), casting="no")


def _host_bytes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src -> dst`` is a plain move of host bytes (same dtype and shape, not tiny)."""
    if dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype:
        return False
    if (
        dst.shape != src.shape
        or dst.element_size() not in SAME_WIDTH
        or dst.numel() * dst.element_size() < _SMALL
    ):
        return False
    if dst.layout != torch.strided or src.layout != torch.strided or dst.is_quantized or src.is_quantized:
        return False
    if dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg() or dst.requires_grad:
        return False
    # a broadcast destination: copy_ refuses it (several elements written to one place), and so must this
    return not any(st == 0 and n > 1 for st, n in zip(dst.stride(), dst.shape, strict=True))
