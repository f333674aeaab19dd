"""Scale arithmetic shared by the scaled codecs (fp8, int8).

A codec that stores its scales in a narrow float rounds them *up*, and then
quantizes with the rounded value: the decoder multiplies by exactly the scale
the encoder divided by, and no value can land past the code range.
"""

from __future__ import annotations

import math

import torch

from kvstore.errors import CodecError, FrameError


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, correctly rounded on every device (a new tensor).

    CUDA divides a tensor by a Python number as a product with the number's
    rounded reciprocal, which lands one unit off the quotient for many values
    (a third of them at 448): a scale one unit higher is another scale once
    rounded up, and the same block would make another frame on a GPU than on
    the CPU. A divisor on the tensor's own device is divided by elementwise.
    """
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32, every element >= 0) rounded up into ``dtype`` (a new tensor)."""
    out = x.to(dtype)
    if dtype == torch.float32:
        return out.clone() if out.data_ptr() == x.data_ptr() else out
    ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    # Casting rounds to nearest; for non-negative floats the next representable
    # value up is the next bit pattern up.
    out.view(ints).add_((out.float() < x).to(ints))
    return out


def round_down(value: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` number <= ``value`` (a positive, finite Python float)."""
    x = torch.tensor(value, dtype=torch.float64)
    b = x.to(dtype)
    if float(b) > value:
        ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
        b = (b.view(ints) - 1).view(dtype)
    return float(b)


def stat_range(stat: torch.Tensor, codec: str) -> tuple[float, float]:
    """(smallest, largest) of a frame's statistics (scales, minimums, centres); FrameError unless every
    one is finite (no encoder writes others). One pass (NaN carries through it): a check per tensor,
    not a kernel per test, since a block's decode is a millisecond and each kernel a few microseconds."""
    if not stat.numel():
        return 0.0, 0.0
    lo, hi = stat.aminmax()
    lo_f, hi_f = float(lo), float(hi)
    if not (math.isfinite(lo_f) and math.isfinite(hi_f)):
        raise FrameError(f"{codec} frame holds a scale or offset that is not a finite number")
    return lo_f, hi_f


def check_scales(stat: torch.Tensor, codec: str) -> float:
    """The largest of a frame's scales; FrameError unless all are finite and none is negative (the
    steps of an encoder's codes go up)."""
    lo, hi = stat_range(stat, codec)
    if lo < 0:
        raise FrameError(f"{codec} frame holds a negative scale")
    return hi


def past_range(bound: float, dtype: torch.dtype) -> bool:
    """Whether a frame's largest decodable magnitude ``bound`` passes ``dtype``'s range. A frame an
    encoder wrote near the edge can (its codes were stepped back: none decodes past it); others,
    damaged or forged under a sound checksum, would decode to inf: ``check_in_range``."""
    return bound > torch.finfo(dtype).max


def check_in_range(block: torch.Tensor, dtype: torch.dtype, codec: str) -> None:
    """FrameError unless every value of the decoded ``block`` is within ``dtype``'s finite range."""
    limit = torch.finfo(dtype).max
    if not bool((block.abs() <= limit).all()):
        raise FrameError(f"{codec} frame decodes to values past the range of {dtype} (inf)")


def require_finite(stat: torch.Tensor, codec: str) -> None:
    """Raise CodecError unless every element of ``stat`` (a per-group max or min) is finite."""
    if not bool(torch.isfinite(stat).all()):
        raise CodecError(
            f"{codec}: the block holds inf or NaN; a KV block must be finite "
            f"(check the model's output, or store it with codec raw)"
        )
