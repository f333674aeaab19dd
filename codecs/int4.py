"""``int4``: KIVI-style 4-bit codes, two a byte, with a scale and a centre per group.

How a block ``[L, 2, T, H, D]`` is grouped (defaults in brackets)::

    K  [L, T, H, D]   per channel: every (l, h, d) over groups of ``k_group`` tokens  [32]
                      (K has a few large, one-sided channels; a scale per channel keeps
                      them from swamping the others -- KIVI, Liu et al. 2024)
    V  [L, T, H, D]   per token: every (l, t, h) over groups of ``v_group`` channels  [32]

Every group stores, in the block's own dtype::

    z = (min + max) / 2                         rounded to the dtype
    s = max(max - z, z - min) / 7.5             rounded up to the dtype
    q = round((x - z) / s + 7.5)  in [0, 15];   decoded: z + (q - 7.5) * s

so every decoded value is within s/2 <= (max - min)/30 of the original (plus the
rounding of the result into the dtype), and no intermediate can overflow even
next to the dtype's largest value. A constant group gets s = 0 and decodes
exactly. Bits per value for 16-bit dtypes: ``4 + 32/k_group`` for K and
``4 + 32/v_group`` for V: 5 at the defaults, before the optional zstd.

``rotate=True`` multiplies the head dimension by an orthonormal Sylvester Hadamard
matrix before quantizing and undoes it after decoding (QuaRot, Ashkboos et al. 2024);
it spreads outlier channels over the head but loosens the per-value error bound (to
n/14 of the slice's absmax for a rotation of order n: ``error_bound``) and costs a
64x64 matmul per token on decode, so the codec's default is off; the nvme tier turns
it on, with an int8 first block (configs/default.toml). A head dimension that is not a
power of two is rotated in blocks of its largest power-of-two divisor; a block whose
rotated values could pass the dtype's range is written unrotated (its frame says so).

Measured on SmolLM2-135M (bench/codec_quality.py): the defaults give KL 4.0e-3 at
5.0 bits/value; groups of 64 cost 1.8x the KL for 0.5 bit less; K per token (like V)
2.3x; rotation alone nothing (4.3e-3). Most of the loss is K of the attention sink
(the prefix's first tokens), which a codec cannot single out -- its values look like
any other token's. A store that keeps the first block at int8 halves the KL (1.9e-3),
and then rotation helps: 1.7e-3, top-1 98.3% (5.0 bits in the int4 blocks; 4.94 bits/value
over the whole prefix as the nvme tier stores it, int8 block and zstd 3 included).

Group sizes that do not divide the block are fine: the last group is padded by
repeating its last entry (which cannot widen its range). Every parameter travels
in the frame; a default instance decodes any int4 frame. Blocks holding NaN or inf
are refused with CodecError. Only torch ops: the same code runs on the GPU.

Payload: [K centres][K scales][V centres][V scales][codes: K in the low nibbles,
V in the high ones, the shorter zero-padded].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.codecs.base import Codec, expect_bytes
from kvstore.codecs.rotation import bf16_matmul_fast, none_tiny, rotate, rotation_fits
from kvstore.codecs.scales import (
    check_in_range,
    check_scales,
    divide,
    past_range,
    require_finite,
    round_up,
    stat_range,
)
from kvstore.errors import CodecError, FrameError
from kvstore.layout import KVLayout

_HALF = 7.5  # codes 0..15 centred on 7.5
_K_AXES = ("channel", "token")
_MAX_GROUP = 65536


@dataclass(frozen=True)
class Int4Params:
    """The grouping of one int4 frame; ``check`` says what is wrong with it, if anything."""

    k_axis: str = "channel"  # "channel": K groups run over tokens; "token": over channels, like V
    k_group: int = 32
    v_group: int = 32
    rotate: bool = False

    def check(self) -> str | None:
        if self.k_axis not in _K_AXES:
            return f"k_axis must be one of {_K_AXES}, got {self.k_axis!r}"
        for name in ("k_group", "v_group"):
            g = getattr(self, name)
            if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= _MAX_GROUP:
                return f"{name} must be an integer 1..{_MAX_GROUP}, got {g!r}"
        if not isinstance(self.rotate, bool):
            return f"rotate must be true or false, got {self.rotate!r}"
        return None

    def specs(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """For K and V: (dim of the [L, T, H, D] tensor the groups run along, group size)."""
        return (1 if self.k_axis == "channel" else 3, self.k_group), (3, self.v_group)

    def to_dict(self) -> dict[str, Any]:
        return {
            "k_axis": self.k_axis,
            "k_group": self.k_group,
            "v_group": self.v_group,
            "rotate": self.rotate,
        }


class Int4Codec(Codec):
    """KIVI-style int4: K per channel over tokens, V per token over channels."""

    name = "int4"
    codec_id = 4
    # s/2 <= (max - min)/30 <= absmax/15, plus the rounding of z (dtype epsilon x absmax) and of
    # the result; groups lie inside one (layer, K/V, head) slice. Rotated frames: see error_bound.
    max_error = 1 / 14

    def __init__(
        self,
        *,
        k_axis: str = "channel",
        k_group: int = 32,
        v_group: int = 32,
        rotate: bool = False,
        zstd: int = 0,
    ) -> None:
        super().__init__(zstd=zstd)
        self.grouping = Int4Params(k_axis, k_group, v_group, rotate)
        problem = self.grouping.check()
        if problem:
            raise CodecError(f"codec int4: {problem}")

    def params(self) -> dict[str, Any]:
        return {**self.grouping.to_dict(), **super().params()}

    def error_bound(self, layout: KVLayout) -> float | None:
        """Rotated by an orthonormal Hadamard matrix of order n, a value y of the rotated slice is
        within sqrt(n) x absmax; its error, within sqrt(n) x absmax / 15; and rotating back sums n
        such errors, each divided by sqrt(n): n x absmax / 15 at worst. The worst comes from values
        sharing one sign: their mean gathers in one rotated channel and sets its group's scale
        (random normal blocks stay within about 1/10)."""
        if not self.grouping.rotate:
            return self.max_error
        return (layout.head_dim & -layout.head_dim) * self.max_error

    def payload_bytes(self, layout: KVLayout) -> int:
        return _sizes(self.grouping, layout).total

    # -- encode ---------------------------------------------------------------------------
    def _encode(self, block: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
        g, dtype = self.grouping, block.dtype
        x = block.to(torch.float32)
        if g.rotate and rotation_fits(x, dtype):
            # in float32, whatever the dtype: rounded to bfloat16 before quantizing, the rotated
            # values moved SmolLM2's KL by 6% (bench/codec_quality.py); rotating back in it did not
            x = rotate(x)
        elif g.rotate:  # rotated, values could pass the dtype's range: this frame goes unrotated
            g = Int4Params(g.k_axis, g.k_group, g.v_group, rotate=False)
        pieces, codes = [], []
        edge = False
        for i, (dim, size) in enumerate(g.specs()):
            t = _grouped(x[:, i], dim, size)
            hi, lo = t.amax(dim + 1, keepdim=True), t.amin(dim + 1, keepdim=True)
            require_finite(hi, "int4")
            require_finite(lo, "int4")
            z = (lo * 0.5 + hi * 0.5).to(dtype)  # halves first: lo + hi may overflow
            zf = z.float()
            # Scale from the rounded centre, rounded up: every value lands inside 0..15.
            s = round_up(divide(torch.maximum(hi - zf, zf - lo), _HALF), dtype)
            sf = s.float()
            # A constant group keeps s = 0 and decodes to z exactly, whatever its codes.
            q = torch.sub(t, zf).div_(sf.masked_fill(sf == 0, 1.0)).add_(_HALF).round_().clamp_(0, 15)
            edge = edge or float(torch.maximum(hi, -lo).max()) > 0.99 * torch.finfo(dtype).max
            pieces += [z.reshape(-1), s.reshape(-1)]
            codes.append(q.to(torch.uint8).reshape(-1))
        # K's codes in the low nibbles, V's in the high ones: each unpacks with one op.
        n = max(c.numel() for c in codes)
        ck, cv = (torch.nn.functional.pad(c, (0, n - c.numel())) for c in codes)
        # Next to the dtype's largest value a decoded value can round just past it (to inf):
        # such frames ask the decoder to clamp (a pass that other frames are spared).
        params = {**g.to_dict(), "clamp": True} if edge else g.to_dict()
        return params, [*pieces, ck | (cv << 4)]

    # -- decode ---------------------------------------------------------------------------
    def _decode(self, payload: torch.Tensor, layout: KVLayout, params: dict[str, Any]) -> torch.Tensor:
        g, clamp = _params_of_frame(params)
        sizes = _sizes(g, layout)
        expect_bytes(payload, sizes.total, "int4")
        dtype = layout.torch_dtype
        dims = [layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim]
        # Clamped frames, and rotated ones unless a bfloat16 block may be rotated back in bfloat16
        # (see rotation.py), go through a float32 block; the others are written straight into the
        # output dtype, group by group (one pass per K and per V).
        via_float = clamp or (
            g.rotate
            and not (
                dtype == torch.bfloat16
                and bf16_matmul_fast(payload.device)
                and none_tiny(payload[: sizes.stats])
            )
        )
        out = torch.empty(layout.shape(), dtype=torch.float32 if via_float else dtype, device=payload.device)
        packed = payload[sizes.total - sizes.packed :]
        pos = 0
        # the largest magnitude a code could decode to (at most), past the dtype: the block is checked
        # once decoded (a rotated group's values spread over the head: up to sqrt(D) times)
        bound, spread = 0.0, math.sqrt(layout.head_dim) if g.rotate else 1.0
        for i, (dim, size) in enumerate(g.specs()):
            gshape, sshape = _group_shapes(dims, dim, size)
            n_stats = math.prod(sshape) * layout.itemsize
            z16 = payload[pos : pos + n_stats].view(dtype)
            s16 = payload[pos + n_stats : pos + 2 * n_stats].view(dtype)
            lo, hi = stat_range(z16, "int4")  # finite centres and scales, no negative scale
            bound = max(bound, (max(-lo, hi) + _HALF * check_scales(s16, "int4")) * spread)
            z, s = z16.float().view(sshape), s16.float().view(sshape)
            pos += 2 * n_stats
            nibbles = (packed & 15) if i == 0 else (packed >> 4)
            # z + (q - 7.5) s, in place in q: the centred code times a 16-bit scale is exact in float32
            # and cannot overflow (|q - 7.5| s <= 7.5 s, which the encoder kept finite), so the sum
            # rounds once. On a CPU, three passes in place take 0.6-0.8 of addcmul's time into a
            # 16-bit out (V's stats broadcast along the innermost dim, which addcmul does slowly).
            q = nibbles[: math.prod(gshape)].view(gshape).float().sub_(_HALF)
            q.mul_(s).add_(z)
            target = out[:, i]
            if gshape[dim] * size == dims[dim]:  # groups tile the block
                target.view(gshape).copy_(q)
            else:
                target.copy_(q.view([*dims[:dim], -1, *dims[dim + 1 :]]).narrow(dim, 0, dims[dim]))
        if g.rotate:
            out = rotate(out)
        if clamp:
            limit = torch.finfo(dtype).max
            out.clamp_(-limit, limit)
        out = out.to(dtype)
        if not clamp and past_range(bound, dtype):
            check_in_range(out, dtype, "int4")
        return out


def _params_of_frame(params: dict[str, Any]) -> tuple[Int4Params, bool]:
    """The grouping a frame names (absent keys take the defaults) and its clamp flag.

    Raises FrameError if the parameters are unusable.
    """
    params = dict(params)
    clamp = params.pop("clamp", False)
    known = Int4Params().to_dict()
    unknown = set(params) - set(known)
    if unknown:
        raise FrameError(f"int4 frame has unknown parameter(s) {sorted(unknown)}")
    g = Int4Params(**{**known, **params})
    problem = g.check() or (
        None if isinstance(clamp, bool) else f"clamp must be true or false, got {clamp!r}"
    )
    if problem:
        raise FrameError(f"int4 frame parameters: {problem}")
    return g, clamp


def _padded(n: int, g: int) -> int:
    return -(-n // g) * g


def _grouped(x: torch.Tensor, dim: int, g: int) -> torch.Tensor:
    """``x`` [L, T, H, D] with ``dim`` split into (groups, g), padded by repeating its last entry."""
    n = x.shape[dim]
    pad = _padded(n, g) - n
    if pad:
        last = x.narrow(dim, n - 1, 1)
        x = torch.cat([x, last.expand(*[pad if i == dim else s for i, s in enumerate(last.shape)])], dim)
    return x.reshape(*x.shape[:dim], -1, g, *x.shape[dim + 1 :])


def _group_shapes(dims: list[int], dim: int, g: int) -> tuple[list[int], list[int]]:
    """Shapes of a grouped [L, T, H, D] tensor and of its per-group stats."""
    gshape = [*dims[:dim], _padded(dims[dim], g) // g, g, *dims[dim + 1 :]]
    sshape = list(gshape)
    sshape[dim + 1] = 1
    return gshape, sshape


@dataclass(frozen=True)
class _Sizes:
    stats: int  # bytes of all centres and scales
    packed: int  # bytes of the packed codes

    @property
    def total(self) -> int:
        return self.stats + self.packed


def _sizes(g: Int4Params, layout: KVLayout) -> _Sizes:
    dims = [layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim]
    stats = codes = 0
    for dim, size in g.specs():
        gshape, sshape = _group_shapes(dims, dim, size)
        stats += 2 * math.prod(sshape) * layout.itemsize
        codes = max(codes, math.prod(gshape))
    return _Sizes(stats, codes)
