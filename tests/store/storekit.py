"""Shared pieces of the store's stories: a 1 KiB-block layout, token and K/V makers, comparisons."""

from __future__ import annotations

import torch

from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store.engine import Store
from kvstore.store.index import LOSSY

# 2 layers x K/V x 4 tokens x 2 heads x 16 dims x bf16 = 1 KiB a block
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_tokens=4)
NS = Namespace("tiny-model", LAYOUT)
T = LAYOUT.block_tokens
HBM_PAGE = 1024  # one block a page
RAM_PAGE = 2048  # one raw frame (1 KiB + header) a page


class Clock:
    """A clock the test moves by hand (leases, TTL)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tokens(n_blocks: int, seed: int = 0, tail: int = 0) -> list[int]:
    """Token ids of ``n_blocks`` full blocks (+ ``tail`` extra ids); different seeds diverge at block 0."""
    return [seed * 100_000 + i for i in range(n_blocks * T + tail)]


def kv(n_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(n_tokens), generator=g).to(torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two bf16 tensors."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def close_to(a: torch.Tensor, b: torch.Tensor, rel: float = 0.25) -> bool:
    """Within int4's error: relative L2 error below ``rel``."""
    a, b = a.float(), b.float()
    return a.shape == b.shape and float((a - b).norm() / b.norm()) < rel


def served_right(s: Store, key: bytes, tier: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """What get served for ``key`` from ``tier`` is what was put: bit-exact from a lossless tier unless
    that copy was promoted from a lossy one (then, like a read from the lossy tier, within its error)."""
    e = s._index.get(key)
    lossless = tier == "hbm" or (tier == "ram" and s.tiers[1].codec.lossless)  # type: ignore[attr-defined]
    if lossless and e is not None and not e.tiers & LOSSY:
        return same(got, want)
    return close_to(got, want)
