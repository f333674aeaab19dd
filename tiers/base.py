"""The tier contract: where a block lives, and what a tier promises.

A tier holds blocks under their 32-byte key, each in the tier's own form
(hbm: the native tensor in a fixed slot; ram: a codec frame in a fixed slot;
nvme: a codec frame plus the block's record in LMDB). Tiers know nothing of
prefixes, LRU order, pins or sessions: the store decides what moves where and
calls these methods; a tier only keeps its capacity promise.

Checks are kept apart from changes (``can_put`` vs ``put``). A tier is safe to
call from several threads; each method is atomic with respect to the others.

::

    Tier          blocks in, blocks out (hbm; every tier is one)
    FrameTier     also takes and gives codec frames as they are (ram): the store
                  encodes a frame before it takes its lock and hands it over
    NvmeTier      (nvme.py) frames plus each block's record, sessions and
                  namespaces in LMDB: what a restart rebuilds the index from
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError

if TYPE_CHECKING:  # annotations only: config and the CLI import TierName without loading torch
    import torch

    from kvstore.codecs import Codec
    from kvstore.codecs.frame import Buffer
    from kvstore.layout import KVLayout


class TierName(str, Enum):
    """The tiers, top to bottom. A str, so configs, the wire and the CLI use the plain names."""

    HBM = "hbm"
    RAM = "ram"
    NVME = "nvme"

    def __str__(self) -> str:
        return self.value


class TierFull(KVStoreError):
    """The tier has no room for the block; nothing was changed. The store must evict first."""

    code = "tier_full"


class TierIOError(KVStoreError):
    """The tier's backing store failed (disk full, I/O error); nothing was changed."""

    code = "tier_io"


@dataclass(frozen=True)
class TierUsage:
    """How full a tier is. ``used_bytes`` counts everything the tier holds (slots, frames, metadata)."""

    name: str
    blocks: int
    used_bytes: int
    capacity_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


class Tier(ABC):
    """One storage tier of blocks."""

    name: TierName

    @abstractmethod
    def can_put(self, block: torch.Tensor) -> bool:
        """Whether ``put(key, block)`` would succeed now without evicting anything. Changes nothing."""

    @abstractmethod
    def could_hold(self, block: torch.Tensor) -> bool:
        """Whether ``block`` would fit in this tier were it empty: where not, evicting makes no room
        for it. Changes nothing."""

    @abstractmethod
    def put(self, key: bytes, block: torch.Tensor) -> int:
        """Store ``block`` (``[L, 2, T, H, D]``, native dtype, any device) under ``key``.

        Encodes it with the tier's codec on the block's device. Returns the
        bytes the block now occupies in this tier. Replaces an existing entry
        for the same key. Raises TierFull (nothing changed) when there is no
        room, TierIOError when the backing store fails.
        """

    @abstractmethod
    def get(
        self, key: bytes, device: torch.device | str | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decode the block under ``key`` onto ``device`` (default: the tier's own device).

        Raises KeyError when absent, FrameError when the stored frame fails its
        checks; the caller then drops the key. The result never aliases tier memory.
        With ``out`` (the block's shape and dtype, on ``device``; a strided view is
        fine) the block is written into ``out`` and ``out`` returned, so a caller
        assembling many blocks copies each once; LayoutError if ``out`` does not fit.
        """

    @abstractmethod
    def drop(self, key: bytes) -> int:
        """Remove ``key``; return the bytes freed (0 if it was absent)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every key the tier holds (a snapshot; safe to drop while iterating)."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    @abstractmethod
    def nbytes(self, key: bytes) -> int:
        """Bytes the block under ``key`` occupies here; KeyError when absent."""

    def block_cost(self, layout: KVLayout) -> int:
        """Bytes a native block of ``layout`` takes here (an estimate for tiers that encode)."""
        return layout.block_nbytes

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release resources. The tier is unusable afterwards."""


class FrameTier(Tier):
    """A tier that stores codec frames (``codec``'s, or any codec's through ``put_frame``).

    The store encodes a frame for such a tier before it takes its lock (the
    codec work is the slow part) and stores it under the lock with ``put_frame``.
    """

    codec: Codec

    @abstractmethod
    def can_put_frame(self, frame_bytes: int) -> bool:
        """Whether ``put_frame`` of a ``frame_bytes``-byte frame would succeed now. Changes nothing."""

    @abstractmethod
    def could_hold_frame(self, frame_bytes: int) -> bool:
        """Whether a ``frame_bytes``-byte frame would fit in this tier were it empty. Changes nothing."""

    @abstractmethod
    def put_frame(self, key: bytes, frame: Buffer) -> int:
        """Store an encoded frame as it is under ``key`` (replacing an entry for the key); returns the
        bytes it occupies. FrameError when the frame is damaged, TierFull when there is no room: nothing
        changed in either case."""

    @abstractmethod
    def get_frame(self, key: bytes) -> bytes:
        """A copy of the frame under ``key``, unchecked (whoever decodes it checks it). KeyError when absent."""
