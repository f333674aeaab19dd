"""The codec contract.

A codec turns one block ``[L, 2, T, H, D]`` into a self-describing frame
(see ``frame.py``) and back. Everything runs on the device the block lives
on: on a GPU host an hbm block is compressed on the GPU, so demotion never
moves uncompressed bytes over PCIe; on a CPU host the very same torch code
runs on the CPU.
"""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import zstandard

from kvstore.codecs import frame as framing
from kvstore.codecs.frame import Buffer
from kvstore.errors import ChecksumMismatch, CodecError, FrameError
from kvstore.layout import KVLayout
from kvstore.memcopy import copy_into


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a tensor's data, on the CPU (copies only if it is on another device)."""
    t = t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
    return t.numpy().data


def cast_block(wide: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A decoded float32 block rounded into ``dtype``: written into ``out`` when given (one pass,
    no extra copy), else a new tensor (``wide`` itself when ``dtype`` is float32)."""
    if out is not None:
        return out.copy_(wide)
    return wide if dtype == torch.float32 else wide.to(dtype)


def bytes_tensor(buf: Buffer) -> torch.Tensor:
    """A uint8 CPU tensor over ``buf`` without copying. Callers must not write to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are fine: we never write
        return (
            torch.frombuffer(buf, dtype=torch.uint8)
            if memoryview(buf).nbytes
            else torch.empty(0, dtype=torch.uint8)
        )


class Codec(ABC):
    """Encode blocks to frames and decode frames to blocks.

    Subclasses set ``name`` and ``codec_id`` and implement ``_encode`` (the
    payload pieces, as tensors on the block's device, plus the parameters a
    decoder needs) and ``_decode`` (from the payload bytes, already on the
    target device, to a tensor that shares no memory with the frame).
    Every parameter has a default: decoding reads parameters from the frame,
    so a default-built instance decodes any frame of its codec.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool] = False
    #: A lossy codec's promise: every decoded value is within ``max_error`` times
    #: the absmax of its group of the original, and every group lies inside one
    #: (layer, K/V, head) slice of the block. The codec tests hold each codec to it.
    max_error: ClassVar[float | None] = None

    def __init__(self, *, zstd: int = 0) -> None:
        if isinstance(zstd, bool) or not isinstance(zstd, int) or not 0 <= zstd <= 22:
            raise CodecError(
                f"codec {self.name}: zstd level must be an integer 0..22 (0 = off), got {zstd!r}"
            )
        self.zstd_level = zstd
        self._local = threading.local()

    # -- contract -----------------------------------------------------------------
    @abstractmethod
    def _encode(self, block: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Return (params, payload pieces) for a contiguous block."""

    @abstractmethod
    def _decode(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        """Rebuild the block from its payload (uint8, on the target device).

        Must raise FrameError when the payload's size or parameters do not fit
        the layout, and must return a tensor that does not alias ``payload``.
        """

    def error_bound(self, layout: KVLayout) -> float | None:
        """``max_error`` for the frames this instance writes for blocks of ``layout``: the same
        promise, for codecs whose bound depends on their parameters and the layout (int4 rotated)."""
        return self.max_error

    def params(self) -> dict[str, Any]:
        """The parameters this codec was built with (for logs and reports)."""
        return {"zstd": self.zstd_level}

    # -- public ---------------------------------------------------------------------
    def encode(self, block: torch.Tensor) -> bytearray:
        """Encode one block ``[L, 2, T, H, D]`` (float16, bfloat16 or float32) into a frame."""
        layout = KVLayout.of_block(block)
        params, pieces = self._encode(block.detach().contiguous())
        buffers: list[Buffer] = [tensor_bytes(p) for p in pieces]
        flags = 0
        if self.zstd_level:
            buffers = [self._compressor().compress(b"".join(buffers))]
            flags |= framing.FLAG_ZSTD
        return framing.pack(self.codec_id, layout, params, buffers, flags=flags)

    def decode(
        self,
        frame: Buffer,
        *,
        layout: KVLayout | None = None,
        device: torch.device | str | None = None,
        verify: bool = True,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode a frame written by this codec into a block on ``device`` (default CPU).

        With ``layout``, a frame of any other layout raises LayoutMismatch. Any
        damage raises a FrameError; a damaged frame never decodes. With ``out``
        (a tensor of the block's shape and dtype, possibly a strided view such
        as a slice of a longer sequence), the block is written into ``out`` and
        ``out`` is returned: for a codec that decodes from the bytes in place
        (raw), that write is the only copy. ``out`` is unchanged when this raises.
        """
        header = framing.read_header(frame, expect=layout, verify=verify)
        if header.codec_id != self.codec_id:
            raise FrameError(f"frame was written by codec id {header.codec_id}, not {self.name}")
        return self._decode_checked(frame, header, device, out)

    def _decode_checked(
        self,
        frame: Buffer,
        header: framing.FrameHeader,
        device: torch.device | str | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is not None:
            header.layout.check_tensor(
                out, what="decode's out"
            )  # a caller's bug: LayoutError, not FrameError
        mv = memoryview(frame).cast("B")[header.payload_offset : header.frame_len]
        if header.zstd:
            data: Buffer = _inflate(self._decompressor(), mv, header.layout)
        else:
            data = mv
        on_host = (device is None or torch.device(device).type == "cpu") and (
            out is None or out.device.type == "cpu"
        )
        if on_host:
            block = self._decode_direct(data, header.layout, header.params, out)
            if block is not None:
                return block
        payload = bytes_tensor(data)
        if device is not None and torch.device(device).type != "cpu":
            payload = payload.to(device, non_blocking=False)
        try:
            block = self._decode(payload, header.layout, header.params)
        except FrameError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise FrameError(f"{self.name} frame does not decode: {e}") from e
        if out is None:
            return block
        return copy_into(out, block)

    @classmethod
    def payload_is_block(cls, header: framing.FrameHeader) -> bool:
        """Whether the payload of a frame with ``header`` is its block's bytes as a contiguous tensor of
        the layout holds them: such a payload, received straight into the block's place, needs no
        decoding once its checksum holds (``decode_placed``)."""
        return False

    def _decode_direct(
        self, data: Buffer, layout: KVLayout, params: dict[str, Any], out: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The block decoded from the payload bytes (host memory) in one pass into ``out``, or into a
        fresh CPU tensor when ``out`` is None; None when this codec cannot (then ``_decode`` runs).

        Must raise FrameError, before writing anything, for a payload that does not fit the layout.
        """
        return None

    def decode_batch(
        self,
        payloads: list[torch.Tensor],
        layout: KVLayout,
        params: dict[str, Any],
        device: torch.device,
        out: torch.Tensor,
        sound: Callable[[], int] | None = None,
    ) -> int | None:
        """Decode the payloads (host bytes of frames of this codec, none zstd-packed, all with
        ``params``) of consecutive blocks into ``out`` ``[n, L, 2, T, H, D]`` on ``device`` at once.

        ``sound``: the frames' own checks (their checksums), run on the host once the device has
        its work and before waiting for it; it returns how many leading frames passed (raising
        FrameError when none did). Without it the frames were checked already.

        Returns how many leading payloads were decoded (a payload that fails a check ends the batch,
        before anything of it is written); None when this codec has no batch decoder for ``device``
        (then each frame is decoded alone, and ``sound`` is not called).
        """
        return None

    def max_frame_bytes(self, layout: KVLayout) -> int:
        """An upper bound of a frame's size for ``layout`` (sizes RAM-tier slots).

        Codecs whose payload size is fixed override ``payload_bytes``.
        """
        bound = self.payload_bytes(layout)
        if self.zstd_level:
            bound = bound + bound // 128 + 1024  # zstd's worst case on incompressible data
        return framing.HEADER_SIZE + framing.MAX_PARAMS + bound

    def payload_bytes(self, layout: KVLayout) -> int:
        """Payload size before zstd for one block of ``layout``."""
        return layout.block_nbytes

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.zstd_level)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d


def expect_bytes(payload: torch.Tensor, n: int, what: str) -> None:
    """Raise FrameError unless the payload holds exactly ``n`` bytes."""
    if payload.numel() != n:
        raise FrameError(f"{what} payload has {payload.numel()} bytes, the layout needs {n}")


class WideningCodec(Codec):
    """A lossy codec that rebuilds a block in float32 and casts once into the block's dtype.

    Subclasses implement ``_decode_f32``; decoding from host bytes then casts
    straight into the caller's ``out`` (the only write to it).
    """

    @abstractmethod
    def _decode_f32(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        """The block as a new float32 tensor; FrameError when the payload does not fit."""

    def _decode(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        return cast_block(self._decode_f32(payload, layout, params), layout.torch_dtype)

    def _decode_batch_f32(
        self,
        payloads: list[torch.Tensor],
        layout: KVLayout,
        params: dict[str, Any],
        device: torch.device,
        sound: Callable[[], int] | None,
    ) -> tuple[torch.Tensor, int] | None:
        """The leading good payloads decoded as float32 ``[n, L, 2, T, H, D]`` (rows past the count
        undefined), and the count; None without a batch decoder for ``device`` (``sound`` not
        called). ``sound``: see ``decode_batch``."""
        return None

    def decode_batch(
        self,
        payloads: list[torch.Tensor],
        layout: KVLayout,
        params: dict[str, Any],
        device: torch.device,
        out: torch.Tensor,
        sound: Callable[[], int] | None = None,
    ) -> int | None:
        try:
            done = self._decode_batch_f32(payloads, layout, params, device, sound)
        except FrameError:
            raise
        except torch.cuda.OutOfMemoryError:  # a batch needs n blocks of float32 at once: one by one, then
            return None
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise FrameError(f"{self.name} frames do not decode: {e}") from e
        if done is None:
            return None
        wide, good = done
        out[:good].copy_(wide[:good])
        return good

    def _decode_direct(
        self, data: Buffer, layout: KVLayout, params: dict[str, Any], out: torch.Tensor | None
    ) -> torch.Tensor | None:
        try:
            wide = self._decode_f32(bytes_tensor(data), layout, params)
        except FrameError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise FrameError(f"{self.name} frame does not decode: {e}") from e
        return cast_block(wide, layout.torch_dtype, out)


def _inflate(d: zstandard.ZstdDecompressor, mv: memoryview, layout: KVLayout) -> bytes:
    """A zstd payload decompressed, within what a block of ``layout`` could need in any codec (twice
    its raw size, and room for the codec's statistics): a frame whose payload says more, damaged or
    forged under a sound checksum, is refused before memory for it is taken."""
    most = 2 * layout.block_nbytes + (1 << 16)
    try:
        size = zstandard.frame_content_size(mv)
    except zstandard.ZstdError as e:
        raise ChecksumMismatch(f"zstd payload does not decompress: {e}") from e
    if size > most:
        raise FrameError(f"zstd payload inflates to {size} bytes; a block of its layout takes at most {most}")
    try:
        return d.decompress(mv, max_output_size=most)
    except zstandard.ZstdError as e:
        raise ChecksumMismatch(f"zstd payload does not decompress: {e}") from e
