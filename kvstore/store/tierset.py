"""The store's tiers, top to bottom, and what each can do.

::

    t = 0   hbm    Tier        native blocks
    t = 1   ram    FrameTier   codec frames, taken ready-made (encoded outside the store's lock)
    t = 2   nvme   NvmeTier    frames + records in LMDB (the durable copy; optional)

Tier numbers are the index bits of ``index.Entry.tiers``. A store may run
without ram or nvme; then the numbers close up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch

from kvstore.errors import LayoutError
from kvstore.layout import KVLayout
from kvstore.results import InvalidRequest
from kvstore.tiers.base import FrameTier, Tier
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier


class TierSet:
    """The tiers in order, with typed access to the frame tiers and to nvme."""

    def __init__(self, hbm: Tier, ram: Tier | None, nvme: NvmeTier | None) -> None:
        self.all: list[Tier] = [t for t in (hbm, ram, nvme) if t is not None]
        self.names: list[str] = [t.name.value for t in self.all]
        self.last = len(self.all) - 1
        self.nvme = nvme
        self.nvme_t: int | None = self.last if nvme is not None else None
        # whether a tier's copy is the original bytes (a promotion from a lossy one marks the block LOSSY)
        self.lossless = [t.codec.lossless if isinstance(t, (FrameTier, NvmeTier)) else True for t in self.all]

    def __len__(self) -> int:
        return len(self.all)

    def __getitem__(self, t: int) -> Tier:
        return self.all[t]

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.all)

    def check_holds(self, layout: KVLayout, position: int | None = None) -> None:
        """LayoutError unless some tier could hold a block of ``layout`` (at ``position`` in its
        prefix, which picks nvme's codec; None: either) were it empty: a block larger than every
        tier would only push every block out, and then not be stored. Changes nothing."""
        block = torch.empty(layout.shape(), dtype=layout.torch_dtype, device="meta")
        if any(t.could_hold(block, position) if t is self.nvme else t.could_hold(block) for t in self.all):
            return
        sizes = ", ".join(f"{t.name.value} {t.usage().capacity_bytes}" for t in self.all)
        raise LayoutError(
            f"a block of {layout.block_nbytes} bytes ({layout.block_tokens} tokens of this layout) is larger "
            f"than any tier can hold (capacity in bytes: {sizes}); raise a tier's capacity, or use fewer "
            "tokens per block"
        )

    def batched_writes(self) -> AbstractContextManager[None]:
        """A block within which the blocks put into hbm (on the host) are copied together, on every
        core the pool's copier has, at its end (kvstore.tiers.pool.PagePool.batched)."""
        hbm = self.all[0]
        return hbm.batched() if isinstance(hbm, HbmTier) else nullcontext()

    def frames(self, t: int) -> FrameTier | None:
        """Tier ``t`` when it takes ready-made frames (ram), else None: only then is a frame for it
        encoded before the store's lock is taken."""
        tier = self.all[t]
        return tier if isinstance(tier, FrameTier) else None

    def number(self, name: str) -> int:
        """The position of the tier called ``name``; InvalidRequest naming the tiers when there is none."""
        for t, n in enumerate(self.names):
            if n == name:
                return t
        raise InvalidRequest(f"unknown tier {name!r}; tiers are {', '.join(self.names)}")
