"""What the store's operations return: frozen dataclasses, no engine imports.

The protocol and the client import these without importing the store. Block
counts are relative to the request (``get(start_block=s)`` returns blocks
``s .. s+matched_blocks-1``); ``tiers`` name, per block, the highest tier that
held it when it was read.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from kvstore.errors import KVStoreError

# Codes in PutResult.failed.
MISSING_PARENT = "missing_parent"  # the block before start_block is not stored: storing would orphan these
NO_ROOM = "no_room"  # every tier is full of pinned blocks


class InvalidRequest(KVStoreError, ValueError):
    """An argument the store cannot act on (a negative start block, an unknown tier name, ...)."""

    code = "invalid_request"


def as_int(v: Any, least: int = 0) -> int | None:
    """``v`` as an int (numpy's integers too, never a bool or a float) if it is ``least`` or more, else None."""
    if isinstance(v, bool):
        return None
    try:
        i = operator.index(v)
    except TypeError:
        return None
    return i if i >= least else None


def check_index(name: str, v: Any) -> int:
    """``v``, a block index or count of a request; InvalidRequest unless a non-negative integer."""
    i = as_int(v)
    if i is None:
        raise InvalidRequest(f"{name} must be a non-negative integer, got {v!r}")
    return i


class InvalidFilter(InvalidRequest):
    """An EvictFilter that selects nothing on purpose (no criterion) or names an unknown tier."""

    code = "invalid_filter"


class StoreClosed(KVStoreError):
    """The store was closed; open a new one on the same path to go on."""

    code = "closed"


class FailedBlock(NamedTuple):
    """A block a put did not store: its index in the prefix, a wire error code, and why."""

    block: int
    code: str
    message: str


@dataclass(frozen=True)
class PutResult:
    """``stored``: new blocks written; ``present``: blocks already held (not rewritten, tags/access updated);
    ``failed``: the blocks refused, from the first one refused to the end of the put (a put never
    leaves a hole); ``deferred``: stored blocks whose write-through waited past the back-pressure
    limit (they reach nvme on the next flush or idle moment)."""

    stored: int
    present: int
    failed: list[FailedBlock] = field(default_factory=list)
    deferred: int = 0


@dataclass(frozen=True)
class LookupResult:
    matched_blocks: int
    matched_tokens: int
    tiers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GetResult:
    """``kv`` is ``[L, 2, matched_tokens, H, D]`` (None when nothing matched); ``matched_tokens ==
    matched_blocks * block_tokens`` counted from ``start_block``."""

    matched_blocks: int
    matched_tokens: int
    kv: torch.Tensor | None
    tiers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class EvictFilter:
    """Which blocks an evict selects; the criteria combine with AND.

    ``tier`` turns the eviction into a move: the selected blocks held in that
    tier go down one tier (from the last tier they are dropped). Without
    ``tier`` the selected blocks are dropped from every tier. ``session``
    selects blocks tagged with that session and no other. ``older_than``
    (seconds) selects blocks not accessed for that long. ``all`` selects
    everything; a filter with no criterion at all is refused (InvalidFilter).
    """

    session: str | None = None
    older_than: float | None = None
    tier: str | None = None
    namespace: str | None = None
    model: str | None = None
    tenant: str | None = None
    all: bool = False

    def selects_anything(self) -> bool:
        return self.all or any(
            v is not None
            for v in (self.session, self.older_than, self.tier, self.namespace, self.model, self.tenant)
        )


@dataclass(frozen=True)
class EvictResult:
    """``blocks`` affected (dropped or moved, descendants included), bytes freed per tier,
    ``moved`` (of ``blocks``, those that went down a tier instead of away), their keys.
    ``not_done``: a part that could not be done, and why (the cluster's part of an evict of a
    session while the cluster is down); empty when all was done. ``displaced``: other blocks the
    moves pushed out of the store (the tier below full, and nothing below it to take them), not
    among ``blocks``; a dry run cannot say."""

    blocks: int
    bytes_freed: dict[str, int]
    moved: int
    keys: list[bytes]
    dry_run: bool = False
    not_done: str = ""
    displaced: int = 0


@dataclass(frozen=True)
class PrefetchResult:
    """``moved``: blocks copied up into the target tier; ``present``: already there (or above);
    ``failed``: blocks that could not be read (corrupt) or placed (no room).

    For one slice of the session's chain (``start_block`` on): ``blocks`` is the whole chain's
    length, ``remaining`` the blocks after the slice still to visit (0: done, or the chain broke
    at a failed block), ``bytes_moved`` what the moved blocks take in the target tier."""

    session: str
    to: str
    moved: int
    present: int
    failed: int
    start_block: int = 0
    blocks: int = 0
    remaining: int = 0
    bytes_moved: int = 0


@dataclass(frozen=True)
class SessionInfo:
    """A session: the last prefix put under its tag. ``blocks`` counts the tail's chain still cached,
    ``tiers`` how many of those each tier holds (a block may be in several)."""

    name: str
    namespace: str
    model: str
    tenant: str
    tokens: int
    blocks: int
    tiers: dict[str, int]
    created: float
    last_access: float


@dataclass(frozen=True)
class NamespaceUsage:
    """One namespace's share of the store: its blocks (in all, and held per tier) and sessions;
    ``tier_bytes``: what its blocks take in each tier, from the tier's cost of a block of its
    layout (an estimate where a tier compresses: a tenant's own figure, no other's in it)."""

    namespace: str
    model: str
    tenant: str
    blocks: int
    tiers: dict[str, int]
    sessions: int
    tier_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockInfo:
    position: int
    key: str  # hex
    tiers: list[str]
    last_access: float


@dataclass(frozen=True)
class SessionDetail:
    info: SessionInfo
    blocks: list[BlockInfo]


@dataclass(frozen=True)
class TierStats:
    name: str
    blocks: int
    used: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    corrupt: int


@dataclass(frozen=True)
class StoreStats:
    tiers: dict[str, TierStats]
    blocks: int
    sessions: int
    namespaces: int
    pinned: int
    write_queue: int
    write_deferred: int
    written: int
    expired: int
    lookups: int
    tokens_asked: int
    tokens_matched: int
    tokens_served: int
    write_failures: int = 0  # write-through attempts that failed (full disk, I/O error); retried
    unencodable: int = 0  # blocks dropped on their way down: the tier's codec refused them (inf or NaN)
    sessions_forgotten: int = (
        0  # sessions the store let go: dead ones past their bound, or past a tenant's cap
    )
    cluster: dict[str, Any] | None = None  # the cluster tier's state and counters (None: not configured)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for ``--json`` and the protocol)."""
        return asdict(self)
