"""Corrections for K's largest channels: an int8 residual on top of a coarse code.

E4M3 keeps each value to within 2^-4 of itself, so K's few large channels
(after RoPE, the slowly rotating pairs) carry the largest absolute errors, and
queries weigh those same channels most: on SmolLM2 they make most of fp8's KL
divergence. For the ``r`` channels of each (layer, head) with the largest mean
square over the block's tokens, the codec also stores ``K - decoded`` as int8
with one scale per (layer, head, channel), which leaves those channels within
~1/4000 of their absmax::

    scales  [L, 1, H, r] bfloat16     (absmax of the residual / 127, rounded up)
    index   [L, H, r]    int16        (the channels, 0 <= c < head_dim)
    codes   [L, T, H, r] int8

At r = 8 of 64 channels this costs 0.5 bit per value of the block and cut the
model's KL divergence 3.6x (1.33e-3 -> 3.7e-4) in our measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstore.codecs.scales import divide, round_up
from kvstore.errors import FrameError


@dataclass(frozen=True)
class KFix:
    """The residual of ``r`` K channels per (layer, head); see the module docstring."""

    scales: torch.Tensor  # [L, 1, H, r] bfloat16
    index: torch.Tensor  # [L, H, r] int16
    codes: torch.Tensor  # [L, T, H, r] int8
    top: float = math.inf  # the largest of ``scales``, where known (a frame's, checked)

    @classmethod
    def encode(cls, k: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, r: int) -> KFix:
        """Residuals of the ``r`` channels of ``k`` [L, T, H, D] (float32) with the largest mean square.

        ``codes`` [L, T, H, D] (float8_e4m3fn) and ``scales`` [L, T, H, 1] (float32) are how the
        coarse code holds ``k``; only the chosen channels are decoded here.
        """
        # float64 (no overflow of a huge value's square into inf ties) and a stable sort (ties in channel
        # order): topk breaks ties one way on the CPU and another on a GPU, and the same block must pick
        # the same channels on either
        score = k.double().square().sum(1)  # [L, H, D]
        index = score.sort(dim=-1, descending=True, stable=True).indices[..., :r]  # [L, H, r]
        at = _expand(index, k.shape[1])
        decoded = codes.view(torch.uint8).gather(-1, at).view(torch.float8_e4m3fn).to(torch.float32) * scales
        residual = k.gather(-1, at) - decoded
        scale = round_up(divide(residual.abs().amax(1, keepdim=True), 127), torch.bfloat16)
        scale.masked_fill_(scale == 0, 1.0)
        q = torch.div(residual, scale.float()).round_().clamp_(-127, 127).to(torch.int8)
        return cls(scale, index.to(torch.int16), q)

    def pieces(self) -> list[torch.Tensor]:
        return [self.scales, self.index, self.codes]

    @staticmethod
    def nbytes(num_layers: int, tokens: int, heads: int, r: int) -> tuple[int, int, int]:
        """Payload bytes of (scales, index, codes)."""
        n = num_layers * heads * r
        return 2 * n, 2 * n, n * tokens

    @classmethod
    def from_payload(cls, data: torch.Tensor, L: int, T: int, H: int, D: int, r: int) -> KFix:
        """Views over the payload bytes ``data`` (scales, index, codes back to back); FrameError on a bad index."""
        a, b, _ = cls.nbytes(L, T, H, r)
        index = data[a : a + b].view(torch.int16).view(L, H, r)
        lo, hi = (int(v) for v in index.aminmax())
        if lo < 0 or hi >= D:
            raise FrameError(f"fp8 frame corrects K channel {hi if hi >= D else lo}, outside 0..{D - 1}")
        scales = data[:a].view(torch.bfloat16)
        least, top = (float(v) for v in scales.aminmax()) if scales.numel() else (1.0, 0.0)
        if not (least > 0 and top < math.inf):  # NaN compares false too
            raise FrameError("fp8 frame holds a K correction scale that is not a positive finite number")
        return cls(
            scales.view(L, 1, H, r),
            index,
            data[a + b :].view(torch.int8).view(L, T, H, r),
            top=top,
        )

    @classmethod
    def from_batch(cls, data: torch.Tensor, L: int, T: int, H: int, r: int) -> KFix:
        """Views over ``data`` [n, bytes] (each row a payload's corrections, checked already by
        ``from_payload``): scales [n, L, 1, H, r], index [n, L, H, r], codes [n, L, T, H, r]."""
        a, b, _ = cls.nbytes(L, T, H, r)
        n = data.shape[0]
        return cls(
            data[:, :a].view(torch.bfloat16).view(n, L, 1, H, r),
            data[:, a : a + b].view(torch.int16).view(n, L, H, r),
            data[:, a + b :].view(torch.int8).view(n, L, T, H, r),
        )

    def apply(self, k: torch.Tensor, limit: float | None = None) -> None:
        """Add the residuals into ``k`` [..., L, T, H, D] (float32, changed in place). ``limit`` (the
        block dtype's largest value, for a block that comes near it): each corrected value is kept
        within +-limit, which a residual rounded up next to it would otherwise pass (to inf)."""
        at = _expand(self.index, k.shape[-3])
        residual = self.codes.to(torch.float32).mul_(self.scales.float())
        if limit is None:
            k.scatter_add_(-1, at, residual)
            return
        fixed = k.gather(-1, at).add_(residual).clamp_(-limit, limit)
        k.scatter_(-1, at, fixed)  # the r channels of a row are distinct: the same sums as scatter_add_


def _expand(index: torch.Tensor, tokens: int) -> torch.Tensor:
    """[..., L, H, r] channel indices as a gather/scatter index over [..., L, T, H, r]."""
    *lead, H, r = index.shape
    return index.to(torch.int64).unsqueeze(-3).expand(*lead, tokens, H, r)
