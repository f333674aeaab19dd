"""The shape of the K/V tensors kvstore keeps.

A block is the K and V of ``block_tokens`` consecutive tokens for every layer::

    [num_layers, 2, block_tokens, num_kv_heads, head_dim]     (dim 1: 0 = K, 1 = V)

in the model's dtype. K is kept as the model computed it (after RoPE), so a
block is only valid at its absolute position; the chained keys guarantee that.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import LayoutError

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Upper bounds that catch nonsense (a swapped argument, a byte count passed as
# a head count) long before an allocation would.
_LIMITS = {"num_layers": 1024, "num_kv_heads": 1024, "head_dim": 4096, "block_tokens": 65536}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The canonical name of a supported dtype; raises LayoutError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise LayoutError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return _DTYPE_NAMES[dtype]
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise LayoutError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """Shapes and dtype of one model's KV cache, and the block size kvstore cuts it into."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 64

    def __post_init__(self) -> None:
        for field, limit in _LIMITS.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"layout {field} must be an integer, got {value!r}")
            if not 1 <= value <= limit:
                raise LayoutError(f"layout {field} must be between 1 and {limit}, got {value}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    def shape(self, tokens: int | None = None) -> tuple[int, int, int, int, int]:
        """Canonical tensor shape for ``tokens`` tokens (default: one block)."""
        t = self.block_tokens if tokens is None else tokens
        return (self.num_layers, 2, t, self.num_kv_heads, self.head_dim)

    @property
    def values_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.values_per_token * self.itemsize

    @property
    def block_numel(self) -> int:
        return self.values_per_token * self.block_tokens

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in the native dtype (what an hbm slot holds)."""
        return self.block_numel * self.itemsize

    def canonical(self) -> bytes:
        """The bytes that identify this layout in keys and fingerprints."""
        return (
            f"L={self.num_layers};H={self.num_kv_heads};D={self.head_dim};"
            f"dtype={self.dtype};T={self.block_tokens}"
        ).encode()

    def fingerprint(self) -> bytes:
        """16 bytes that differ whenever any field differs; every frame carries it."""
        return hashlib.sha256(b"kvstore-layout/1\x00" + self.canonical()).digest()[:16]

    def check_tensor(self, kv: torch.Tensor, *, tokens: int | None = None, what: str = "kv") -> None:
        """Raise LayoutError unless ``kv`` is ``[L, 2, tokens, H, D]`` in this layout's dtype."""
        if not isinstance(kv, torch.Tensor):
            raise LayoutError(f"{what} must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dim() != 5:
            raise LayoutError(f"{what} must have 5 dims [L, 2, T, H, D], got shape {tuple(kv.shape)}")
        expect = self.shape(kv.shape[2] if tokens is None else tokens)
        if tuple(kv.shape) != expect:
            raise LayoutError(f"{what} has shape {tuple(kv.shape)}, layout expects {expect}")
        if kv.dtype != self.torch_dtype:
            raise LayoutError(f"{what} has dtype {kv.dtype}, layout expects {self.dtype}")

    @classmethod
    def of_block(cls, block: torch.Tensor) -> KVLayout:
        """The layout a single block tensor ``[L, 2, T, H, D]`` implies (T = block_tokens)."""
        if not isinstance(block, torch.Tensor) or block.dim() != 5 or block.shape[1] != 2:
            shape = tuple(block.shape) if isinstance(block, torch.Tensor) else type(block).__name__
            raise LayoutError(f"a block must be a tensor [L, 2, T, H, D], got {shape}")
        L, _, T, H, D = block.shape
        return cls(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype_name(block.dtype), block_tokens=T)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
        }

    @classmethod
    def from_dict(cls, d: Any) -> KVLayout:
        """Build from a mapping (a protocol field, a config table); unknown or missing keys raise."""
        if not isinstance(d, dict):
            raise LayoutError(f"layout must be a mapping, got {type(d).__name__}")
        fields = {"num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens"}
        unknown = set(d) - fields
        if unknown:
            raise LayoutError(f"unknown layout field(s) {sorted(unknown)}; allowed: {sorted(fields)}")
        missing = {"num_layers", "num_kv_heads", "head_dim"} - set(d)
        if missing:
            raise LayoutError(f"layout is missing {sorted(missing)}")
        return cls(**d)
