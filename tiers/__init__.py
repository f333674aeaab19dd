"""The three storage tiers behind one small interface (see ``base.py``).

======  ==========================================  =====================
tier    where                                       holds
======  ==========================================  =====================
hbm     PagePool on cuda:N (or the CPU)             native-dtype blocks
ram     PagePool in host RAM (pinned with CUDA)     codec frames (fp8)
nvme    LMDB environment on local disk              frames + records
======  ==========================================  =====================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.tiers.base import FrameTier, Tier, TierFull, TierIOError, TierName, TierUsage
    from kvstore.tiers.hbm import HbmTier
    from kvstore.tiers.lmdb_env import DEFAULT_DURABILITY, DURABILITY, Durability
    from kvstore.tiers.nvme import NvmeTier
    from kvstore.tiers.pool import PagePool, PageSpan
    from kvstore.tiers.ram import RamTier

# Imported on first use, so that config and the CLI can read TierName and Durability without torch.
_EXPORTS = {
    "FrameTier": "base",
    "Tier": "base",
    "TierFull": "base",
    "TierIOError": "base",
    "TierName": "base",
    "TierUsage": "base",
    "HbmTier": "hbm",
    "DEFAULT_DURABILITY": "lmdb_env",
    "DURABILITY": "lmdb_env",
    "Durability": "lmdb_env",
    "NvmeTier": "nvme",
    "PagePool": "pool",
    "PageSpan": "pool",
    "RamTier": "ram",
}

__all__ = [
    "DEFAULT_DURABILITY",
    "DURABILITY",
    "Durability",
    "FrameTier",
    "HbmTier",
    "NvmeTier",
    "PagePool",
    "PageSpan",
    "RamTier",
    "Tier",
    "TierFull",
    "TierIOError",
    "TierName",
    "TierUsage",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.tiers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvstore.tiers.{module}"), name)
