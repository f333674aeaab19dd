"""The store's counters: per tier (hits, moves, damage) and for the whole store (traffic, writes).

Plain ints changed under the store's lock; ``stats()`` copies them out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # copies that left this tier (demoted, dropped, expired, evicted on request)
    demotions: int = 0  # of those, moved down one tier
    promotions: int = 0  # copies made here from a lower tier on a hit or prefetch
    corrupt: int = 0


@dataclass
class StoreCounts:
    lookups: int = 0
    tokens_asked: int = 0
    tokens_matched: int = 0
    tokens_served: int = 0
    written: int = 0  # blocks written through to nvme
    expired: int = 0  # blocks dropped by the TTL
    write_failures: int = (
        0  # writes to nvme that failed (full disk, I/O error, a record that cannot be written)
    )
