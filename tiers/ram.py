"""The ram tier: codec frames (fp8 by default) in a page pool in host RAM, page-locked when CUDA is present.

``put`` encodes on the block's device (a GPU block is compressed on the GPU and
only the frame crosses PCIe), then copies the frame into pages. ``get`` checks
the frame (checksum, header, layout) and decodes it onto the requested
device; a damaged frame raises FrameError and the store drops the key. When
the frame's pages are contiguous (the usual case, see pool.py) it is checked
and decoded in place, so the decode's own output is the only copy.
``put_frame`` stores a frame the store encoded before taking its lock (a
FrameTier, see base.py); ``get_frame`` hands out a copy, unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.codecs import Codec, check_frame, decode_frame
from kvstore.codecs.base import bytes_tensor
from kvstore.codecs.frame import HEADER_SIZE, Buffer
from kvstore.layout import KVLayout
from kvstore.memcopy import Copier
from kvstore.tiers.base import FrameTier, TierName
from kvstore.tiers.paged import PagedTier
from kvstore.tiers.pool import DEFAULT_PAGE_BYTES, PagePool, PoolMemory


@dataclass(frozen=True)
class _FrameMeta:
    layout: KVLayout


class RamTier(PagedTier, FrameTier):
    """Codec frames in a host-RAM PagePool of ``capacity_bytes``.

    ``pin_memory``: page-lock the pool (None: when CUDA is present; never without CUDA).
    """

    name = TierName.RAM

    def __init__(
        self,
        capacity_bytes: int,
        codec: Codec,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        pin_memory: bool | None = None,
        memory: PoolMemory | None = None,
        copier: Copier | None = None,
    ) -> None:
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        super().__init__(
            PagePool(
                capacity_bytes,
                page_bytes=page_bytes,
                device="cpu",
                pin_memory=pin,
                memory=memory,
                copier=copier,
            )
        )
        self.codec = codec
        # Largest frame seen per layout. Without zstd a codec's frames of one layout are all
        # the same size, so this is exact after the first put; before it (or with zstd)
        # can_put falls back to the codec's bound, which may say no where put would fit.
        self._frame_bytes: dict[KVLayout, int] = {}

    def can_put(self, block: torch.Tensor) -> bool:
        """Judged on the frame size seen for the block's layout, else the codec's upper bound."""
        layout = KVLayout.of_block(block)
        seen = None if self.codec.zstd_level else self._frame_bytes.get(layout)
        return self._pool.can_alloc(seen if seen is not None else self.codec.max_frame_bytes(layout))

    def could_hold(self, block: torch.Tensor) -> bool:
        """Judged as ``can_put`` is, on an empty pool."""
        layout = KVLayout.of_block(block)
        seen = None if self.codec.zstd_level else self._frame_bytes.get(layout)
        return self.could_hold_frame(seen if seen is not None else self.codec.max_frame_bytes(layout))

    def could_hold_frame(self, frame_bytes: int) -> bool:
        return self._pool.pages_for(frame_bytes) <= self._pool.num_pages

    def block_cost(self, layout: KVLayout) -> int:
        """A frame of ``layout`` rounded up to whole pages: the size seen, else header and payload
        (zstd's gain unknown)."""
        n = self._frame_bytes.get(layout) or HEADER_SIZE + self.codec.payload_bytes(layout)
        return -(-n // self.page_bytes) * self.page_bytes

    def can_put_frame(self, frame_bytes: int) -> bool:
        """Whether a frame of ``frame_bytes`` bytes fits now (for ``put_frame``). Changes nothing."""
        return self._pool.can_alloc(frame_bytes)

    def put(self, key: bytes, block: torch.Tensor) -> int:
        """Encode ``block`` with the tier's codec and store the frame. TierFull: nothing changed."""
        frame = self.codec.encode(block)
        layout = KVLayout.of_block(block)
        with self._lock:
            self._frame_bytes[layout] = max(len(frame), self._frame_bytes.get(layout, 0))
        return self._store(key, bytes_tensor(frame), _FrameMeta(layout=layout))

    def put_frame(self, key: bytes, frame: Buffer) -> int:
        """Store an already-encoded frame (any codec) after checking it; FrameError if it is damaged."""
        header = check_frame(frame)
        return self._store(key, bytes_tensor(frame), _FrameMeta(layout=header.layout))

    def get(
        self, key: bytes, device: torch.device | str | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Check and decode the frame under ``key`` onto ``device`` (default CPU), or into ``out``.

        KeyError when absent; FrameError (ChecksumMismatch, LayoutMismatch, ...) when damaged.
        """
        with self._reading(key) as entry:
            data = self._pool.view(entry.span, entry.nbytes)
            if data is None:
                data = self._pool.read(entry.span, entry.nbytes)
            meta: _FrameMeta = entry.meta
            return decode_frame(
                data.numpy().data, layout=meta.layout, device=device, out=out, codecs=(self.codec,)
            )

    def get_frame(self, key: bytes) -> bytes:
        """A copy of the stored frame, unchecked (the receiver checks it). KeyError when absent."""
        with self._reading(key) as entry:
            data = self._pool.view(entry.span, entry.nbytes)
            if data is None:
                data = self._pool.read(entry.span, entry.nbytes)
            return bytes(data.numpy().data)

    def layout(self, key: bytes) -> KVLayout:
        """The layout of the block under ``key`` (from its frame header at put time). KeyError when absent."""
        with self._reading(key) as entry:
            meta: _FrameMeta = entry.meta
            return meta.layout

    def _debug_corrupt(self, key: bytes, offset: int, mask: int = 0xFF) -> None:
        """Flip bits of byte ``offset`` of the stored frame, in place. For corruption tests only."""
        with self._reading(key) as entry:
            if not 0 <= offset < entry.nbytes:
                raise IndexError(f"offset {offset} is outside the {entry.nbytes}-byte frame")
            self._pool.xor_byte(entry.span, offset, mask)
