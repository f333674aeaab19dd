"""The hbm tier: blocks in their native dtype, in a page pool on the GPU (or the CPU on a host without one).

No codec and no checksum: a block goes in and comes out bit for bit, and a
read is one device copy (``index_select``, or a slice ``clone`` when the
block's pages are contiguous) plus a move to the requested device.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from kvstore.errors import LayoutError
from kvstore.memcopy import Copier
from kvstore.tiers.base import TierName
from kvstore.tiers.paged import PagedTier
from kvstore.tiers.pool import DEFAULT_PAGE_BYTES, PagePool, PoolMemory


@dataclass(frozen=True)
class _BlockMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


class HbmTier(PagedTier):
    """Native-dtype blocks in a PagePool of ``capacity_bytes`` on ``device``.

    ``device``: ``"cpu"``, ``"cuda:N"`` (ConfigError when CUDA is absent) or
    ``"auto"``. A block occupies ``ceil(nbytes / page_bytes)`` pages.
    """

    name = TierName.HBM

    def __init__(
        self,
        capacity_bytes: int,
        device: torch.device | str = "cpu",
        page_bytes: int = DEFAULT_PAGE_BYTES,
        memory: PoolMemory | None = None,
        copier: Copier | None = None,
    ) -> None:
        """``memory``: where the pool lives (default: private memory; see kvstore.shm.plane).
        ``copier``: how its host copies run (default: on the calling thread; see kvstore.memcopy)."""
        super().__init__(
            PagePool(capacity_bytes, page_bytes=page_bytes, device=device, memory=memory, copier=copier)
        )

    @property
    def device(self) -> torch.device:
        return self._pool.device

    def batched(self) -> AbstractContextManager[None]:
        """Blocks put by this thread meanwhile are copied together at the end, on the copier's threads
        (kvstore.tiers.pool.PagePool.batched: reads through this tier see them at once)."""
        return self._pool.batched()

    def can_put(self, block: torch.Tensor) -> bool:
        return self._pool.can_alloc(block.numel() * block.element_size())

    def could_hold(self, block: torch.Tensor) -> bool:
        return self._pool.pages_for(block.numel() * block.element_size()) <= self._pool.num_pages

    def put(self, key: bytes, block: torch.Tensor) -> int:
        """Copy ``block`` (any shape, any device) into the pool under ``key``. TierFull: nothing changed."""
        # the block as it is (a strided slice of a put's K/V): one copy into the pool, not two
        return self._store(key, block.detach(), _BlockMeta(shape=tuple(block.shape), dtype=block.dtype))

    def get(
        self, key: bytes, device: torch.device | str | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A copy of the block on ``device`` (default: the pool's), or written into ``out``. KeyError when absent."""
        with self._reading(key) as entry:
            meta: _BlockMeta = entry.meta
            if out is not None:  # one copy, arena -> out (the entry stays allocated while it runs)
                if tuple(out.shape) != meta.shape or out.dtype != meta.dtype:
                    raise LayoutError(
                        f"hbm get: out is {tuple(out.shape)} {out.dtype}, the block is "
                        f"{meta.shape} {meta.dtype}"
                    )
                src = self._pool.view(entry.span, entry.nbytes)
                if src is None:
                    src = self._pool.read(entry.span, entry.nbytes)
                return self._pool.copier.copy(out, src.view(meta.dtype).view(meta.shape))
            data = self._pool.read(entry.span, entry.nbytes)
        block = data.view(meta.dtype).view(meta.shape)
        if device is not None and torch.device(device) != block.device:
            block = block.to(device)
        return block
