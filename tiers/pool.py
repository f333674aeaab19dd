"""A fixed arena of equal pages that the hbm and ram tiers keep their entries in.

::

    arena (exactly capacity bytes, allocated once)
    +--------+--------+--------+--------+--------+--   --+--------+~~~~~~~+
    | page 0 | page 1 | page 2 | page 3 | page 4 |  ...  | page P | slack |
    +--------+--------+--------+--------+--------+--   --+--------+~~~~~~~+
      entry a (3 pages)          entry b (2 pages, not contiguous: 3 and 7)

An entry of ``n`` bytes takes ``ceil(n / page_bytes)`` pages, any free ones.
Writes go through ``index_copy_`` on the ``[pages, page_bytes]`` view (or one
``copy_`` when the pages happen to be a contiguous run), reads through
``index_select``, so a read result is a fresh tensor that never aliases the
arena. The ``slack`` past the last whole page (when the capacity is not a
multiple of the page size) is allocated but never used.

Every page has a generation counter, bumped when the page is freed. A reader
outside the daemon (a client that mapped the arena, kvstore.shm) notes the
generations of a block's pages when it is told where the block is and checks
them after copying: a page freed meanwhile (and perhaps reused) shows as a
changed generation, and the block is treated as missing, never served.
Generations start at 1, never 0: shared memory given back after its daemon
stopped (kvstore.shm.segment) reads as zeros, which match no located block.

The free list is a preallocated stack of page numbers: alloc pops, free pushes;
an entry gets only its page tuple and its index tensor, nothing else. Pages are
popped in ascending order and pushed back reversed, so an entry freed and a new
entry of the same size get the same contiguous run back: with fixed-size
blocks (every block of a layout has the same size) entries stay contiguous and
reads take the fast path.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.config import PAGE_ALIGN
from kvstore.errors import ConfigError
from kvstore.memcopy import Copier
from kvstore.tiers.base import TierFull

log = logging.getLogger("kvstore.tiers.pool")

DEFAULT_PAGE_BYTES = 64 * 1024

# Where a pool's memory comes from: (capacity bytes, page bytes, pages, device) -> (arena, page
# generations).
# The default is private memory; kvstore.shm.plane gives shared segments the daemon's clients map.
# (capacity, page bytes, pages, device) -> (arena, page generations) in memory shared elsewhere, or
# None: that memory cannot be had here, the pool allocates its own
PoolMemory = Callable[[int, int, int, torch.device], tuple[torch.Tensor, np.ndarray] | None]


@dataclass(frozen=True)
class PageSpan:
    """The pages one entry holds. ``index`` is int64 on the pool's device (for index_copy_/select),
    ``array`` the same on the host (for the generations)."""

    index: torch.Tensor
    pages: tuple[int, ...]
    first: int
    contiguous: bool
    array: np.ndarray

    @property
    def count(self) -> int:
        return len(self.pages)


def resolve_device(device: torch.device | str) -> torch.device:
    """``"auto"`` -> ``cuda:0`` when CUDA is present else ``cpu``; a cuda device without CUDA raises ConfigError."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device; use 'cpu', 'cuda:N' or 'auto'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r} needs CUDA, but this torch build sees no GPU; use device 'cpu' or 'auto'"
            )
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r} is not supported; use 'cpu', 'cuda:N' or 'auto'")
    return dev


class PagePool:
    """A preallocated arena cut into ``page_bytes`` pages, with a free list.

    ``can_alloc`` checks, ``alloc``/``free`` change the free list (under a lock,
    so the pool is thread-safe). ``write``/``read``/``view`` touch only the
    span's pages and take no lock: the caller owns a span from ``alloc`` until
    it passes it to ``free``, and must not free a span that is being read.
    """

    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        memory: PoolMemory | None = None,
        copier: Copier | None = None,
    ) -> None:
        """``memory``: where the arena and the generations live (default, or when it returns None:
        private to this process). ``copier``: how host copies into and out of the arena run (default:
        on the calling thread)."""
        for name, value, low in (("capacity_bytes", capacity_bytes, 0), ("page_bytes", page_bytes, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"page pool {name} must be an integer >= {low}, got {value!r}")
        if page_bytes % PAGE_ALIGN:
            # a block is viewed as its dtype at its first page (and copied by CUDA at 256-byte alignment)
            raise ConfigError(f"page pool page_bytes must be a multiple of {PAGE_ALIGN}, got {page_bytes}")
        self.device = resolve_device(device)
        self.copier = copier or Copier(1)
        self.capacity_bytes = capacity_bytes
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        pin = bool(pin_memory) and self.device.type == "cpu" and torch.cuda.is_available()
        self.pinned = pin
        self._host: _PinnedHost | None = None  # the private pinned arena's owner, when there is one
        shared = None if memory is None else memory(capacity_bytes, page_bytes, self.num_pages, self.device)
        # shared with other processes (kvstore.shm): a GPU write must have landed before the block is
        # published, since a client reads it on a stream of its own (CUDA IPC)
        self._shared_gpu = shared is not None and self.device.type == "cuda"
        if shared is not None:
            self._arena, self.gens = shared
            self.pinned = pin and _register_host(self._arena)
        else:
            # Zero-filled on purpose: the memory is touched now, so a host that cannot back the
            # configured capacity fails at start instead of being OOM-killed under load later.
            try:
                if pin and _registers_exactly():
                    self._host = _PinnedHost(capacity_bytes)
                    self._arena, self.pinned = self._host.tensor, self._host.registered
                    if not self.pinned:
                        log.warning(
                            "a %d-byte host pool could not be page-locked; its GPU copies run at "
                            "pageable speed",
                            capacity_bytes,
                        )
                else:  # torch's pinned allocator (rounded up to a power of two) without cupy
                    self._arena = torch.zeros(
                        capacity_bytes, dtype=torch.uint8, device=self.device, pin_memory=pin
                    )
            except (RuntimeError, MemoryError, OSError) as e:  # out of host or device memory: too large
                raise ConfigError(
                    f"a {capacity_bytes}-byte pool cannot be allocated on {self.device} "
                    f"({str(e).splitlines()[0][:200]}); lower the tier's capacity"
                ) from None
            self.gens = np.zeros(self.num_pages, dtype=np.uint64)
        self.gens[:] = 1  # never 0 (see above)
        self._pages = self._arena[: self.num_pages * page_bytes].view(self.num_pages, page_bytes)
        self._flat = self._arena[: self.num_pages * page_bytes]
        # Stack of free page numbers; the top is at _top - 1. Highest pages at the bottom.
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._top = self.num_pages
        self._lock = threading.Lock()
        self._batcher: int | None = None  # the thread whose writes are batched now (``batched``)
        self._failed: BaseException | None = None  # a batched copy's failure another thread's flush met
        self._batch = self.copier.batch()
        self._pending: set[int] = set()  # the first pages of the spans written in the batch
        self._flushing = threading.Lock()  # held while pending writes run: a reader waits for all of them

    # -- checks -----------------------------------------------------------------------
    def pages_for(self, nbytes: int) -> int:
        """Pages an entry of ``nbytes`` bytes takes (at least one, so every entry owns a page)."""
        return max(1, -(-nbytes // self.page_bytes))

    def can_alloc(self, nbytes: int) -> bool:
        """Whether ``alloc(nbytes)`` would succeed now. Changes nothing."""
        with self._lock:
            return self.pages_for(nbytes) <= self._top

    @property
    def free_pages(self) -> int:
        with self._lock:
            return self._top

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    # -- changes ----------------------------------------------------------------------
    def alloc(self, nbytes: int) -> PageSpan:
        """Take the pages for ``nbytes`` bytes. Raises TierFull (nothing taken) when too few are free."""
        need = self.pages_for(nbytes)
        with self._lock:
            if need > self._top:
                raise TierFull(
                    f"page pool on {self.device}: {nbytes} bytes need {need} pages of "
                    f"{self.page_bytes}, {self._top} of {self.num_pages} free"
                )
            taken = self._free[self._top - need : self._top][::-1].copy()
            self._top -= need
        pages = tuple(taken.tolist())
        contiguous = pages[-1] - pages[0] == need - 1 and pages == tuple(range(pages[0], pages[0] + need))
        index = torch.from_numpy(taken)
        if self.device.type != "cpu":
            index = index.to(self.device)
        return PageSpan(index=index, pages=pages, first=pages[0], contiguous=contiguous, array=taken)

    def free(self, span: PageSpan) -> None:
        """Return the span's pages to the free list. The span must not be used afterwards."""
        try:
            self.flush()  # a batched write into these pages must not land after they are taken again
        finally:  # the batch has ended either way: nothing lands in them later
            with self._lock:
                if self._top + span.count > self.num_pages:
                    raise RuntimeError("page pool: freeing more pages than were taken (double free)")
                self.gens[list(span.pages)] += 1  # before the pages can be taken again: readers see it
                self._free[self._top : self._top + span.count] = span.pages[::-1]
                self._top += span.count

    def generations(self, span: PageSpan) -> np.ndarray:
        """The span's page generations now (a copy)."""
        return self.gens[span.array]

    # -- data -------------------------------------------------------------------------
    def write(self, span: PageSpan, data: torch.Tensor) -> None:
        """Copy ``data`` (1-D uint8, any device) into the span's pages, from the start of its first page."""
        n = data.numel()
        if n > span.count * self.page_bytes:
            raise ValueError(f"{n} bytes do not fit {span.count} pages of {self.page_bytes}")
        data = data.to(self.device, non_blocking=False)
        if span.contiguous:
            start = span.first * self.page_bytes
            self.copier.copy(self._flat[start : start + n], data)
            self._landed()
            return
        full = n // self.page_bytes
        if full:
            self._pages.index_copy_(
                0, span.index[:full], data[: full * self.page_bytes].view(full, self.page_bytes)
            )
        rest = n - full * self.page_bytes
        if rest:
            self._pages[span.pages[full], :rest].copy_(data[full * self.page_bytes :])
        self._landed()

    def _landed(self) -> None:
        """Wait for this thread's GPU writes into a shared arena (other processes read it next)."""
        if self._shared_gpu:
            torch.cuda.current_stream(self.device).synchronize()

    def write_tensor(self, span: PageSpan, data: torch.Tensor) -> None:
        """Copy ``data`` (any shape, dtype, strides and device) into the span as its contiguous bytes:
        one copy straight from a strided ``data`` when the span's pages are contiguous."""
        n = data.numel() * data.element_size()
        if span.contiguous and n <= span.count * self.page_bytes:
            start = span.first * self.page_bytes
            dst = self._flat[start : start + n].view(data.dtype).view(data.shape)
            if self._batcher == threading.get_ident() and self.device.type == data.device.type == "cpu":
                # marked and queued together: a flush on another thread (a reader) in between would
                # clear the mark of a copy it did not run
                with self._flushing:
                    if span.first in self._pending:  # written twice in one batch: the later copy must win
                        self._batch.finish()
                        self._pending.clear()
                    self._pending.add(span.first)
                    self._batch.add(dst, data)
                return
            self.copier.copy(dst, data)
            self._landed()
            return
        self.write(span, data.detach().contiguous().view(-1).view(torch.uint8))

    def read(self, span: PageSpan, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes of the span as a fresh 1-D uint8 tensor on the pool's device."""
        self.flush()
        if span.contiguous:
            start = span.first * self.page_bytes
            return self._flat[start : start + nbytes].clone()
        return self._pages.index_select(0, span.index).view(-1)[:nbytes]

    def view(self, span: PageSpan, nbytes: int) -> torch.Tensor | None:
        """The bytes in place (aliasing the arena) when the span is contiguous, else None.

        Only valid while the caller keeps the span from being freed; copy before letting go.
        """
        if not span.contiguous:
            return None
        self.flush()
        start = span.first * self.page_bytes
        return self._flat[start : start + nbytes]

    def xor_byte(self, span: PageSpan, offset: int, mask: int = 0xFF) -> None:
        """Flip bits of the byte at ``offset`` of the span's data in place. For corruption tests only."""
        if not 0 <= offset < span.count * self.page_bytes:
            raise IndexError(f"offset {offset} is outside the span's {span.count * self.page_bytes} bytes")
        self.flush()
        page, pos = span.pages[offset // self.page_bytes], offset % self.page_bytes
        self._pages[page, pos] ^= mask

    # -- batched writes ---------------------------------------------------------------
    @contextmanager
    def batched(self) -> Iterator[None]:
        """Host copies this thread makes meanwhile (``write_tensor`` into contiguous pages) are
        gathered and run when the block ends, on the copier's threads at once (a put's blocks, each
        too small to split, copied on every core: kvstore.memcopy.CopyBatch). What is written
        meanwhile may be read before then only through this pool: every read, view and free here
        (and the tier's locate) waits for the pending copies first; a page freed may be taken again
        by a later write of the batch. Other threads' writes are not batched; a batch opened inside
        another is part of it."""
        me = threading.get_ident()
        with self._lock:
            mine = self._batcher is None
            if mine:
                self._batcher = me
        if not mine:
            yield
            return
        try:
            yield
        finally:
            try:
                self.flush()
            finally:
                with self._lock:
                    self._batcher = None
                    failed, self._failed = self._failed, None
            if failed is not None:  # met by another thread's flush: the batch's own thread answers for it
                raise failed

    def flush(self) -> None:
        """Run the batched writes still pending (see ``batched``); returns when all have landed (also
        when one failed). A failure is raised to the batch's own thread, which withdraws what it
        wrote: on another thread (a reader, a free) it is kept for the batch's end."""
        with self._flushing:
            try:
                self._batch.finish()
            except BaseException as e:
                batcher = self._batcher
                if batcher is None or batcher == threading.get_ident():
                    raise
                self._failed = e
            finally:
                self._pending.clear()


def _registers_exactly() -> bool:
    """Whether host memory can be page-locked as it is (cupy: its error check clears what a failed
    registration leaves in CUDA's last error, which torch's own cudart call would leave for the next
    kernel to fail on)."""
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


class _PinnedHost:
    """``nbytes`` of page-locked host memory, exactly: torch's pinned allocator rounds every request
    up to a power of two (a 33 GiB ram tier would lock 64 GiB). An anonymous mapping, registered with
    CUDA (kvstore.shm.cuda.host_register), zero-filled where it could not be (registering touches every
    page). Unregistered when this object goes, always before the mapping is unmapped: ``tensor``
    and its views keep the mapping, not the registration (a view that outlives the pool copies at
    pageable speed)."""

    def __init__(self, nbytes: int) -> None:
        # private, as torch's and cudaHostAlloc's memory is (anonymous mmap is shared by default)
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if nbytes else None
        empty = torch.empty(0, dtype=torch.uint8)
        self.tensor = empty if self._map is None else torch.frombuffer(self._map, dtype=torch.uint8)
        self._ptr = self.tensor.data_ptr()
        self.registered = bool(nbytes) and _register_host(self.tensor)
        if not self.registered:
            self.tensor.zero_()

    def __del__(self) -> None:
        if self.registered:
            from kvstore.shm.cuda import host_unregister

            self.registered = False
            host_unregister(self._ptr)


def _register_host(arena: torch.Tensor) -> bool:
    """Page-lock host memory allocated elsewhere (a shared segment) for fast GPU copies (see
    kvstore.shm.cuda.host_register). It stays registered for the process's life: the segment is
    unmapped at its exit."""
    from kvstore.shm.cuda import host_register

    return host_register(arena.data_ptr(), arena.numel(), read_only=False)
