"""The Hadamard rotation int4 applies to each head's channels (``rotate=True``; QuaRot, Ashkboos et
al. 2024), and in which precision a block is rotated back.

Encoding rotates in float32. Decoding rotates a bfloat16 block back in bfloat16 where that is fast
(``bf16_matmul_fast``) and its values are not so small that the product unit would flush them
(``none_tiny``); otherwise in float32.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch


def rotation_fits(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every rotated value stays well inside ``dtype`` (|y| <= sqrt(n) x absmax, n <= D)."""
    d = x.shape[-1]
    limit = torch.finfo(dtype).max / 4  # centres and scales, rounded up, must stay finite too
    if x.numel() == 0:
        return True
    lo, hi = x.aminmax()
    return max(-float(lo), float(hi)) * math.sqrt(d & -d) <= limit


def bf16_matmul_fast(device: torch.device) -> bool:
    """Whether bfloat16 matrix products run on matrix or vector units on ``device``: a GPU, or a CPU
    with bfloat16 instructions (AVX512-BF16, AMX) and oneDNN on. Elsewhere torch multiplies them in a
    scalar loop, ~40x slower than in float32 (oneDNN turned off: measured), or oneDNN emulates them
    (AVX-512 without BF16, Arm: not measured; float32 there, as before)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    return _bf16_instructions()


@lru_cache(maxsize=1)
def _bf16_instructions() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # a torch without the checks: assume not
        return False


_TINY_BITS = (127 - 100) << 7  # bfloat16's bits of 2^-100, sign off: a magnitude under it is smaller


def none_tiny(stats: torch.Tensor) -> bool:
    """Whether no group centre or scale in ``stats`` (a bfloat16 frame's stats, as bytes) is nonzero and
    under 2^-100. oneDNN's bfloat16 products on a CPU flush values under 2^-126 (subnormal) to zero:
    in a slice whose values are all that small, that would be the whole slice, past the promise.
    Where none is, what a flush drops is under 2^-26 of its group's largest value."""
    if stats.device.type == "cpu":  # numpy: 8 us for a SmolLM2 block's stats, where torch takes 48
        u = stats.numpy().view(np.uint16) & np.uint16(0x7FFF)
        return not bool(((u - np.uint16(1)) < np.uint16(_TINY_BITS - 1)).any())  # 0 wraps to 65535
    bits = stats.view(torch.int16) & 0x7FFF
    return not bool(((bits > 0) & (bits < _TINY_BITS)).any())


@lru_cache(maxsize=16)
def hadamard(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order ``n`` (a power of two): symmetric, its own
    inverse, in ``dtype``. Cached per (order, device, dtype): built once, not per block (callers never
    write to it)."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Multiply the last dim by a block-diagonal orthonormal Hadamard matrix (applied twice: identity),
    in ``x``'s dtype: float32, or bfloat16 on decode (the entries +-1/sqrt(n) are exact in it where n is
    a power of four, as 64, and rounded elsewhere, as 128: every value 1e-4 smaller, a fraction of a
    step; the products are summed in float32). The one rounding it adds, of the decoded
    value before rotating back, is at most 2^-8 of it, against int4's steps of 1/15 of a group's
    range; rotated back, those roundings move a value by about a unit of bfloat16, sqrt(n)/2 at
    worst. AMX runs the product 4x as fast as float32 (bench/codec_speed.py)."""
    d = x.shape[-1]
    n = d & -d  # largest power of two dividing d
    if n == 1:
        return x
    return (x.reshape(*x.shape[:-1], d // n, n) @ hadamard(n, x.device, x.dtype)).reshape(x.shape)
