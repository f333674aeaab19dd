"""``int8``: 8-bit integer codes with a scale (and zero point) per group.

Groups (``k_axis="channel"``, the default, KIVI-style)::

    K  [L, T, H, D]   per (layer, head, channel) over the block's tokens
    V  [L, T, H, D]   per (layer, token, head) over head_dim

``k_axis="token"`` groups K like V, per (token, head). K has a few large
channels (after RoPE, the slowly rotating pairs): in a per-token group they set
the range and every other channel loses precision, while per channel each gets
its own. On SmolLM2 per-channel K cuts K's error 3x and the model's KL
divergence from 8e-5 to 2.5e-5 at the same size (T = D = 64 gives as many
groups either way).

Asymmetric (the default)::

    s = (max - min) / 255   float32
    q = round((x - min) / s)  in [0, 255] (uint8);   decoded: q * s + min

with ``min`` kept in the block's dtype (it is one of the block's values, so
exact). A group's minimum decodes exactly and its maximum to within float32
rounding, i.e. exactly once cast back. That matters more than its share of
the L2 error: the extremes of a K channel are often the attention-sink token,
which carries much of the attention. With bfloat16 zero points and scales
instead, SmolLM2's KL divergence was 2.2x higher (5.6e-5 against 2.5e-5).

Symmetric (``symmetric=True``): ``s = absmax / 127`` (float32), ``q`` in
[-127, 127] (int8), decoded ``q * s``: 16 bits less per group, about twice the
error of a one-sided group. A block whose values span most of float32's range
(only bfloat16/float32 blocks can) is coded symmetrically whatever the
parameter, since its asymmetric range would overflow; the frame says so.

Decoding widens the codes to float32, multiplies, adds, and rounds once into
the block's dtype. A constant group decodes exactly (scale 1, codes 0); all
zeros decode to zeros. Every decoded value is within 1/100 of its group's
absmax. Input holding inf or NaN is refused with CodecError at encode.

Payload (one value per group in each stats piece)::

    [K scales f32][V scales f32][K mins][V mins, block dtype][L x 2 x T x H x D codes]

(no minimums when symmetric). 8.75 bits per value for 16-bit dtypes at
T = D (asymmetric), 8.5 symmetric.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvstore.codecs.base import WideningCodec, expect_bytes
from kvstore.codecs.scales import (
    check_in_range,
    check_scales,
    divide,
    past_range,
    require_finite,
    stat_range,
)
from kvstore.errors import CodecError, FrameError
from kvstore.layout import KVLayout

K_AXES = ("channel", "token")
_NORMAL = float(torch.finfo(torch.float32).smallest_normal)
_TINY = _NORMAL * 2.0**-23  # float32's smallest subnormal
_REDUCE = {"channel": 1, "token": 3}  # dim of [L, T, H, D] a group runs along


def quantize(
    t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, symmetric: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Quantize ``t`` (float32) by groups with minimums ``lo`` and maximums ``hi`` (broadcastable).

    Returns (float32 scales, minimums in ``dtype`` or None when symmetric, codes):
    asymmetric codes are uint8 with ``x = q * s + min``, symmetric ones int8 with
    ``x = q * s``. Asymmetric needs ``hi - lo`` finite in float32 (see ``too_wide``).
    """
    if symmetric:
        s = divide(torch.maximum(hi, -lo), 127)
        base = None
    else:
        s = divide(hi, 255) - divide(lo, 255)
        base = lo
    # A range whose step is subnormal: the quotient lands on float32's coarse subnormal grid (or 0),
    # often below the step the codes need, and they clamp short of the range. There the step is a
    # whole number of float32's smallest units, rounded up (such values are exact multiples of it).
    span = (torch.maximum(hi, -lo) if symmetric else hi - lo).double()
    units = torch.ceil(divide(span, 127 if symmetric else 255) / _TINY)  # (by 2**-149: exact)
    s = torch.where(s < _NORMAL, (units * _TINY).float(), s)
    s.masked_fill_(s == 0, 1.0)  # a constant group (asymmetric) or zeros: any scale decodes it exactly
    q = torch.div(t if base is None else t - base, s).round_()
    q = q.clamp_(-127, 127) if base is None else q.clamp_(0, 255)
    limit = torch.finfo(dtype).max
    if float(torch.maximum(hi, -lo).max()) > 0.99 * limit:
        # Near the dtype's edge a code could decode past it (to inf): step it back.
        dec = q * s + (base if base is not None else 0.0)
        q -= (dec > limit).to(q.dtype)
        q += (dec < -limit).to(q.dtype)
    codes = q.to(torch.int8) if base is None else q.to(torch.uint8)
    return s, (None if base is None else base.to(dtype)), codes


def too_wide(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """True when some group's range ``hi - lo`` (or ``q * s`` when decoding) could overflow float32."""
    return float((hi * 0.5 - lo * 0.5).max()) > 0.25 * torch.finfo(torch.float32).max


class Int8Codec(WideningCodec):
    """8-bit codes: K per channel (or per token), V per token; asymmetric unless ``symmetric=True``."""

    name = "int8"
    codec_id = 3
    max_error = 1 / 100

    def __init__(self, *, symmetric: bool = False, k_axis: str = "channel", zstd: int = 0) -> None:
        super().__init__(zstd=zstd)
        if not isinstance(symmetric, bool):
            raise CodecError(f"codec int8: symmetric must be true or false, got {symmetric!r}")
        if k_axis not in K_AXES:
            raise CodecError(f"codec int8: k_axis must be one of {K_AXES}, got {k_axis!r}")
        self.symmetric = symmetric
        self.k_axis = k_axis

    def params(self) -> dict[str, Any]:
        return {"symmetric": self.symmetric, "k_axis": self.k_axis, **super().params()}

    def payload_bytes(self, layout: KVLayout) -> int:
        return sum(n for _, _, n in _pieces(layout, self.symmetric, self.k_axis))

    def _encode(self, block: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
        x = block.to(torch.float32)
        halves = [x[:, i] for i in range(2)]
        dims = (_REDUCE[self.k_axis], _REDUCE["token"])
        stats = [
            (t.amin(d, keepdim=True), t.amax(d, keepdim=True)) for t, d in zip(halves, dims, strict=True)
        ]
        for lo, hi in stats:
            require_finite(lo, "int8")
            require_finite(hi, "int8")
        # Values spanning most of float32's range (bfloat16/float32 blocks only) are coded
        # symmetrically: the asymmetric range would overflow. The frame records the choice.
        symmetric = self.symmetric or any(too_wide(lo, hi) for lo, hi in stats)
        codes = torch.empty(block.shape, dtype=torch.int8 if symmetric else torch.uint8, device=block.device)
        scales, mins = [], []
        for i, (t, (lo, hi)) in enumerate(zip(halves, stats, strict=True)):
            s, m, q = quantize(t, lo, hi, symmetric, block.dtype)
            scales.append(s)
            mins += [] if m is None else [m]
            codes[:, i] = q
        return {"symmetric": symmetric, "k_axis": self.k_axis}, [*scales, *mins, codes]

    def _decode_f32(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        symmetric = params.get("symmetric", False)
        k_axis = params.get("k_axis", "channel")
        if not isinstance(symmetric, bool) or k_axis not in K_AXES:
            raise FrameError(
                f"int8 frame has parameters symmetric={symmetric!r}, k_axis={k_axis!r}; "
                f"expected true/false and one of {K_AXES}"
            )
        pieces = _pieces(layout, symmetric, k_axis)
        expect_bytes(payload, sum(n for _, _, n in pieces), "int8")
        views, at = [], 0
        for dtype, shape, n in pieces:
            views.append(payload[at : at + n].view(dtype).view(shape))
            at += n
        dtype = layout.torch_dtype
        bound = 0.0  # the largest magnitude a code could decode to (at most): past the dtype, the
        for i in range(2):  # block is checked once decoded
            top = check_scales(views[i], "int8")
            if symmetric:
                bound = max(bound, 128 * top)
            else:
                lo, hi = stat_range(views[2 + i], "int8")
                bound = max(bound, max(-lo, hi) + 255 * top)
        suspect = past_range(bound, dtype)
        # float32 arithmetic and one final cast: on CPU, bfloat16 arithmetic measured ~2x
        # slower, and mixed-dtype kernels (int8 * bf16, addcmul with a broadcast) slower still.
        out = views[-1].to(torch.float32)
        for i in range(2):
            half = out[:, i].mul_(views[i])
            if not symmetric:
                half.add_(views[2 + i].float())
        if suspect:
            check_in_range(out, dtype, "int8")
        return out


def _pieces(layout: KVLayout, symmetric: bool, k_axis: str) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """(dtype, shape, bytes) of each payload piece in order: scales, minimums, codes."""
    L, T, H, D = layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim
    by_token = (L, T, H, 1)
    shapes = ((L, 1, H, D) if k_axis == "channel" else by_token, by_token)
    out = [(torch.float32, shape, 4 * math.prod(shape)) for shape in shapes]
    if not symmetric:
        out += [(layout.torch_dtype, shape, layout.itemsize * math.prod(shape)) for shape in shapes]
    codes = torch.int8 if symmetric else torch.uint8
    return [*out, (codes, layout.shape(), layout.block_numel)]
