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

from kvstore.tiers.base import Tier, TierFull, TierIOError, TierUsage
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.lmdb_env import DEFAULT_DURABILITY, DURABILITY
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.pool import PagePool, PageSpan
from kvstore.tiers.ram import RamTier

__all__ = [
    "DEFAULT_DURABILITY",
    "DURABILITY",
    "HbmTier",
    "NvmeTier",
    "PagePool",
    "PageSpan",
    "RamTier",
    "Tier",
    "TierFull",
    "TierIOError",
    "TierUsage",
]
