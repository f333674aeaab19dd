"""``raw``: the block's own bytes, bit-exact.

With ``shuffle=True`` the bytes are regrouped by byte plane (all first bytes,
then all second bytes, ...) before zstd: the exponent bytes of neighbouring
values are alike, so planes compress better than interleaved values. Both are
lossless.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvstore.codecs.base import Codec, expect_bytes
from kvstore.codecs.frame import Buffer, FrameHeader
from kvstore.errors import CodecError, FrameError
from kvstore.layout import KVLayout


class RawCodec(Codec):
    name = "raw"
    codec_id = 1
    lossless = True

    def __init__(self, *, shuffle: bool = False, zstd: int = 0) -> None:
        super().__init__(zstd=zstd)
        if not isinstance(shuffle, bool):
            raise CodecError(f"codec raw: shuffle must be true or false, got {shuffle!r}")
        self.shuffle = shuffle

    def params(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle, **super().params()}

    def _encode(self, block: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
        b = block.view(torch.uint8).reshape(-1)
        if self.shuffle:
            b = b.reshape(-1, block.element_size()).t().contiguous().reshape(-1)
        return {"shuffle": self.shuffle}, [b]

    @classmethod
    def payload_is_block(cls, header: FrameHeader) -> bool:
        return (
            not header.zstd
            and not header.params.get("shuffle")
            and header.payload_len == header.layout.block_nbytes
        )

    def _decode_direct(
        self, data: Buffer, layout: KVLayout, params: dict[str, Any], out: torch.Tensor | None
    ) -> torch.Tensor | None:
        if params.get("shuffle") or (out is not None and out.stride(-1) != 1):
            return None
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != layout.block_nbytes:
            raise FrameError(f"raw payload has {src.size} bytes, the layout needs {layout.block_nbytes}")
        if out is None:  # a fresh block: one copy of the bytes, then typed views of it
            return torch.from_numpy(src.copy()).view(layout.torch_dtype).view(layout.shape())
        # bfloat16 has no numpy dtype: copy as bytes, [L, 2, T, H, D * itemsize], into out's strides
        view = out.view(torch.uint8).numpy()
        np.copyto(view, src.reshape(view.shape))
        return out

    def _decode(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        expect_bytes(payload, layout.block_nbytes, "raw")
        if params.get("shuffle"):
            payload = payload.reshape(layout.itemsize, -1).t().contiguous()
        else:
            payload = payload.clone()  # never alias the caller's frame
        return payload.view(layout.torch_dtype).reshape(layout.shape())
