"""``fp8``: E4M3 codes with one bfloat16 scale per (layer, K/V, token, head).

Each group of ``head_dim`` values is divided by ``scale = absmax / 448``
(rounded *up* to bfloat16, so no value lands past ±448) and cast to
``float8_e4m3fn``; values are clamped to ±448 first because an unclamped cast
turns an overflow into NaN. An all-zero group gets scale 1 (its codes are 0).
E4M3 keeps 3 mantissa bits, so a decoded value is within 1/16 of its group's
absmax, and within 2^-4 of itself while it stays in E4M3's normal range (above
absmax / 2^14). 8.25 bits per value.

With ``k_fix=r`` (default 8) the ``r`` largest K channels of each (layer, head)
also carry an int8 residual (``kfix.py``): +0.53 bit per value at r = 8, and
on SmolLM2 the model's KL divergence fell from 1.3e-3 to ~4e-4, because those
channels, which queries weigh most, held most of E4M3's absolute error.
Measured and rejected: taking K's per-channel block mean out first (K's L2
error halves but KL doubles: the attention-sink token, far from the block's
mean, gets a larger error, and it carries much of the attention); a Hadamard
rotation of K (KL 5.7e-4, but a 64x64 matmul per (token, head) makes decoding
~5x slower on a CPU); choosing each scale among 8 by least squares (KL -25%).

Input holding inf or NaN is refused with CodecError at encode: a cache that
holds them is already broken, and no scale can represent them.

Payload (G = layers * 2 * tokens * heads)::

    [G bfloat16 scales][K corrections, see kfix.py, if k_fix][G x head_dim E4M3 codes]

Decoding does not convert E4M3 with torch's scalar cast (slow on CPU). An E4M3
byte ``s eeee mmm`` moved into the fields of a float32 (``s 0000eeee mmm 0...``)
*is* the same number times 2^-120, zero and subnormals included. So decoding is
a widening copy, a shift and a mask (integer passes), one float32 multiply by
``scale * 2^120``, the K corrections (a scatter-add over r/64 of K), and the
cast to the block's dtype: vectorised passes, the same
torch code on CPU and CUDA. The product of a 4-bit and an 8-bit significand is
exact in float32 and rounded once into the output dtype, so the result equals
``(codes.float() * scale).to(dtype)`` bit for bit. (On CPU, float32 arithmetic
plus one cast measured ~2x faster than bfloat16 arithmetic.) Frames whose
scales reach 2^8 (absmax past 114688) take that plain path instead. If a
process sets ``torch.set_flush_denormal(True)``, the few codes below E4M3's
normal range decode as 0: an error under 2^-6 of the scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvstore.codecs.base import WideningCodec, expect_bytes
from kvstore.codecs.kfix import KFix
from kvstore.codecs.scales import divide, require_finite, round_down, round_up
from kvstore.errors import CodecError, FrameError
from kvstore.layout import KVLayout

FP8_MAX = 448.0
GROUP = "token_head"

# An E4M3 byte widened to int32, shifted left by 20 and masked to (sign, 4 exponent
# bits, 3 mantissa bits) is the float32 whose value is the E4M3 value times 2^-120.
_SHIFT = 20
_MASK = 0x87F00000 - (1 << 32)  # as a signed int32
_BIAS = 2.0**120


def fp8_scales(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bfloat16 scales from per-group absmax (float32): absmax / 448 rounded up, 1 where that is 0.

    Scales are capped so that ``448 * scale`` stays finite in ``dtype`` (the
    decoded values are ``dtype``). Raises CodecError when a group holds inf or NaN.
    """
    require_finite(amax, "fp8")
    cap = round_down(torch.finfo(dtype).max / FP8_MAX, torch.bfloat16)
    scale = round_up(divide(amax, FP8_MAX), torch.bfloat16).clamp_(max=cap)
    # all zeros, or so small that absmax / 448 underflows: any scale will do, the codes are 0
    return scale.masked_fill_(scale == 0, 1.0)


def fp8_check_scales(scales: torch.Tensor) -> float:
    """The largest of a frame's ``scales`` (bfloat16); FrameError unless all are positive and finite."""
    lo, hi = scales.float().aminmax()
    lo_f, hi_f = float(lo), float(hi)
    if not (lo_f > 0.0 and hi_f < float("inf")):
        raise FrameError("fp8 frame holds a scale that is not a positive finite number")
    return hi_f


def fp8_decode_groups(codes: torch.Tensor, scales: torch.Tensor, largest: float) -> torch.Tensor:
    """``codes`` ([G, n] uint8 E4M3) times ``scales`` ([G, 1] bfloat16), exactly, as a new float32 tensor,
    for a block whose dtype's largest value is ``largest``. FrameError for scales no encoder writes
    (not positive and finite, or past ``largest`` / 448), and for E4M3's NaN code (s1111111, which no
    encoder writes) where it would decode to NaN (cast) or past the dtype (480 x scale, through the
    bit pattern): looked for only then (a pass over the codes, 7 % of a decode)."""
    hi_f = fp8_check_scales(scales)
    if hi_f * FP8_MAX > largest:
        raise FrameError("fp8 frame holds a scale larger than any of its block dtype's")
    plain = hi_f * _BIAS >= torch.finfo(torch.float32).max  # the multiplier would overflow
    if (plain or hi_f * 480 > largest) and codes.numel() and int(codes.bitwise_or(0x80).max()) == 0xFF:
        raise FrameError("fp8 frame holds E4M3's NaN code, which no encoder writes")
    s32 = scales.float()
    if plain:
        return codes.view(torch.float8_e4m3fn).to(torch.float32) * s32
    w = codes.view(torch.int8).to(torch.int32)
    # Tensor operands: an in-place op with a Python scalar takes a slower dispatch path.
    w.bitwise_left_shift_(torch.tensor(_SHIFT, dtype=torch.int32))
    w.bitwise_and_(torch.tensor(_MASK, dtype=torch.int32))
    return w.view(torch.float32).mul_(s32.mul_(_BIAS))


class Fp8Codec(WideningCodec):
    """E4M3 with per-(layer, K/V, token, head) bfloat16 scales; see the module docstring.

    ``k_fix``: how many K channels per (layer, head) get an int8 correction
    (``kfix.py``); 0 stores plain E4M3.
    """

    name = "fp8"
    codec_id = 2
    max_error = 1 / 16

    def __init__(self, *, k_fix: int = 8, zstd: int = 0) -> None:
        super().__init__(zstd=zstd)
        if isinstance(k_fix, bool) or not isinstance(k_fix, int) or not 0 <= k_fix <= 4096:
            raise CodecError(
                f"codec fp8: k_fix must be an integer 0..4096 (channels per head), got {k_fix!r}"
            )
        self.k_fix = k_fix

    def params(self) -> dict[str, Any]:
        return {"k_fix": self.k_fix, **super().params()}

    def _encode(self, block: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
        L, _, T, H, D = block.shape
        x = block.to(torch.float32)
        g = x.view(-1, D)
        scale = fp8_scales(g.abs().amax(-1, keepdim=True), block.dtype)
        codes = torch.div(g, scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        r = min(self.k_fix, D)
        fix: list[torch.Tensor] = []
        if r:
            k_codes = codes.view(L, 2, T, H, D)[:, 0]
            k_scales = scale.float().view(L, 2, T, H, 1)[:, 0]
            fix = KFix.encode(x[:, 0], k_codes, k_scales, r).pieces()
        return {"group": GROUP, "k_fix": r}, [scale, *fix, codes.view(torch.uint8)]

    def payload_bytes(self, layout: KVLayout) -> int:
        return _payload_bytes(layout, min(self.k_fix, layout.head_dim))

    def _decode_f32(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        r = _k_fix(params, layout)
        expect_bytes(payload, _payload_bytes(layout, r), "fp8")
        L, _, T, H, D = layout.shape()
        G = _groups(layout)
        scales = payload[: 2 * G].view(torch.bfloat16).view(G, 1)
        at = 2 * G + sum(KFix.nbytes(L, T, H, r))
        out = fp8_decode_groups(payload[at:].view(G, D), scales, _largest(layout)).view(layout.shape())
        if r:
            fix = KFix.from_payload(payload[2 * G : at], L, T, H, D, r)
            fix.apply(out[:, 0], _near_limit(layout, scales, fix))
        return out

    def _decode_batch_f32(
        self,
        payloads: list[torch.Tensor],
        layout: KVLayout,
        params: dict[str, Any],
        device: torch.device,
        sound: Callable[[], int] | None,
    ) -> tuple[torch.Tensor, int] | None:
        """One row of a device buffer per payload (one copy across PCIe each, queued), the checks of
        ``_decode_f32`` and the scaling for all rows at once, the frames' checksums on the host
        meanwhile (``sound``), one wait for the device (where each frame's own decode costs three),
        then the K corrections of the good rows: the same arithmetic as ``_decode_f32``, so the same
        values bit for bit."""
        r = _k_fix(params, layout)
        size = _payload_bytes(layout, r)
        L, _, T, H, D = layout.shape()
        G = _groups(layout)
        at = 2 * G + sum(KFix.nbytes(L, T, H, r))
        expect_bytes(payloads[0], size, "fp8")
        n = 0
        for p in payloads:
            if p.numel() != size:
                break
            n += 1
        row = -(-size // 16) * 16  # rows 16-byte aligned: every piece views as its dtype
        buf = torch.empty((n, row), dtype=torch.uint8, device=device)
        for i, p in enumerate(payloads[:n]):
            buf[i, :size].copy_(p, non_blocking=True)
        scales = buf[:, : 2 * G].view(torch.bfloat16).float()  # [n, G]
        # NaN compares false: bad too; so is a scale whose values would pass the dtype (inf)
        bad = ~((scales > 0) & (scales * FP8_MAX <= _largest(layout))).all(1)
        fix = KFix.from_batch(buf[:, 2 * G : at], L, T, H, r) if r else None
        if fix is not None:  # a channel past the head would be a scatter out of bounds
            bad |= ((fix.index < 0) | (fix.index >= D)).flatten(1).any(1)
            k_scales = fix.scales.float()
            bad |= ~((k_scales > 0) & (k_scales < float("inf"))).flatten(1).all(1)
        # E4M3's NaN (s1111111), which no encoder writes: a cast makes it NaN (the one-frame decode,
        # a bit pattern, a finite value); either way not a block to serve
        bad |= (buf[:, at:size] & 0x7F).eq(0x7F).any(1)
        # every row scaled (a bad row's values are never read): elementwise, no index to go astray
        codes = buf[:, at:size].view(torch.float8_e4m3fn).view(n, G, D)
        out = codes.to(torch.float32).mul_(scales.unsqueeze(-1)).view(n, *layout.shape())
        checked = n if sound is None else min(n, sound())  # host work while the device works
        flags = bad.cpu()
        good = int(flags.to(torch.uint8).argmax()) if bool(flags.any()) else n
        if not good:
            raise FrameError(
                "fp8 frame holds a scale (or a K correction's) that is not a positive finite "
                "number, or corrects a K channel outside the head"
            )
        good = min(good, checked)
        if fix is not None:  # a scatter: only rows whose indices were checked
            KFix(fix.scales[:good], fix.index[:good], fix.codes[:good]).apply(
                out[:good, :, 0], _largest(layout)
            )
        return out, good


def _k_fix(params: dict[str, Any], layout: KVLayout) -> int:
    """The frame's ``k_fix``; FrameError for parameters no fp8 frame has."""
    r = params.get("k_fix", 0)
    if (
        params.get("group", GROUP) != GROUP
        or isinstance(r, bool)
        or not isinstance(r, int)
        or not 0 <= r <= layout.head_dim
    ):
        raise FrameError(
            f"fp8 frame has unusable parameters {params!r} (scale groups {GROUP!r}, "
            f"k_fix 0..{layout.head_dim} expected)"
        )
    return r


def _largest(layout: KVLayout) -> float:
    return float(torch.finfo(layout.torch_dtype).max)


def _near_limit(layout: KVLayout, scales: torch.Tensor, fix: KFix | None = None) -> float | None:
    """The dtype's largest value when a group of the block may hold a value past half of it (its scale
    x 448: the K corrections must be kept within it), or when a correction (``fix``) may reach it (an
    encoder's never does: only a damaged frame's, decoded to inf else), else None."""
    largest = _largest(layout)
    coarse = float(scales.amax()) * FP8_MAX
    if coarse * 2 >= largest:
        return largest
    if fix is not None and coarse + fix.top * 127 >= largest:
        return largest
    return None


def _groups(layout: KVLayout) -> int:
    return layout.num_layers * 2 * layout.block_tokens * layout.num_kv_heads


def _payload_bytes(layout: KVLayout, r: int) -> int:
    fix = KFix.nbytes(layout.num_layers, layout.block_tokens, layout.num_kv_heads, r)
    return 2 * _groups(layout) + sum(fix) + layout.block_numel
