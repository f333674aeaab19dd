"""Blocks for the codec tests: hypothesis strategies and builders of structured data."""

from __future__ import annotations

import hypothesis.strategies as st
import torch

from kvstore.codecs import CODECS, get_codec
from kvstore.codecs.base import Codec

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KINDS = ("normal", "heavy", "zeros", "constant", "onesided", "wide", "huge", "tiny")


def codec_variants() -> list[tuple[str, dict]]:
    """(name, params) for every registered codec: its defaults, zstd on, and the known options."""
    variants: list[tuple[str, dict]] = []
    for name in CODECS:
        variants += [(name, {}), (name, {"zstd": 1})]
    extra: dict[str, list[dict[str, object]]] = {
        "raw": [{"shuffle": True, "zstd": 3}, {"shuffle": True}],
        "int8": [{"symmetric": True}],
        "int4": [{"rotate": True, "zstd": 3}],
    }  # the nvme tier's default
    for name, options in extra.items():
        if name in CODECS:
            variants += [(name, p) for p in options]
    return variants


def variant_id(v: tuple[str, dict]) -> str:
    name, params = v
    return name + "".join(f"-{k}={p}" for k, p in params.items())


def make_codec(v: tuple[str, dict]) -> Codec:
    return get_codec(v[0], **v[1])


def structured_block(
    kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, log2_scale: int = 0
) -> torch.Tensor:
    """A block of ``kind``: values built in float64, scaled by 2**log2_scale, then cast (finite)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "heavy":  # a few channels 30x the others, as real K has (with a sign bias)
        D = shape[-1]
        chans = torch.randperm(D, generator=g)[: max(1, D // 16)]
        x[..., chans] = x[..., chans] * 30 + 20
    elif kind == "zeros":
        x.zero_()
    elif kind == "constant":  # every (layer, K/V, token, head) group constant, some zero
        x = x[..., :1].round().expand(shape).clone()
    elif kind == "onesided":  # all of a group on one side of zero, far from it
        x = x.abs() + 8
    elif kind == "wide":  # magnitudes spread over many binades inside a group
        x = x * torch.exp2(torch.randint(-12, 12, shape, generator=g, dtype=torch.float64))
    elif kind == "huge":  # far past E4M3's 448 and near the dtype's own limit
        x = x / x.abs().amax().clamp_min(1e-9) * torch.finfo(dtype).max * 0.999
        return x.to(dtype)
    elif kind == "tiny":  # down in the dtype's subnormals
        x = x * torch.finfo(dtype).smallest_normal * 4
        return x.to(dtype)
    x = x * 2.0**log2_scale
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


@st.composite
def blocks(draw: st.DrawFn) -> torch.Tensor:
    """A small block [L, 2, T, H, D] of any supported dtype and any KIND of content."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = (
        draw(st.integers(1, 3)),
        2,
        draw(st.integers(1, 6)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([1, 2, 3, 8, 16, 64])),
    )
    kind = draw(st.sampled_from(KINDS))
    log2_scale = draw(st.integers(-14, 14))
    block = structured_block(kind, shape, dtype, draw(st.integers(0, 2**31)), log2_scale)
    # A few hand-picked values anywhere (hypothesis shrinks toward the interesting ones).
    limit = float(torch.finfo(dtype).max)
    for _ in range(draw(st.integers(0, 3))):
        index = tuple(draw(st.integers(0, n - 1)) for n in shape)
        block[index] = draw(st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=32))
    return block


def slice_absmax(block: torch.Tensor) -> torch.Tensor:
    """Absmax of each (layer, K/V, head) slice, broadcastable to the block: every codec group lies inside one."""
    return block.double().abs().amax(dim=(2, 4), keepdim=True)


def group_absmax(block: torch.Tensor) -> torch.Tensor:
    """Absmax of each (layer, K/V, token, head) group of head_dim values."""
    return block.double().abs().amax(dim=-1, keepdim=True)


def subnormal_unit(dtype: torch.dtype) -> float:
    """The smallest positive value of ``dtype``: rounding into it can always cost that much."""
    return float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps)


def rel_l2(decoded: torch.Tensor, original: torch.Tensor) -> float:
    o = original.double()
    return float((decoded.double() - o).norm() / o.norm().clamp_min(1e-300))
