"""The typed messages of the kvstore wire protocol (no I/O).

A message is a msgpack header (frame 0) plus, for ``put`` requests and ``get``
replies, one raw payload frame holding K/V bytes ``[L, 2, n*T, H, D]`` in the
namespace's dtype. Token ids travel inside the header as a msgpack ``bin`` of
little-endian uint32 (what the Python client sends) or as a list of ints
(what a hand-written client may send; range-checked here).

Each class lists its header fields in ``schema`` (name -> checker); decoding a
header runs every checker, rejects unknown fields and missing required ones,
and raises RemoteProtocolError with a stable code, never anything else.

One file on purpose: every request and reply of the protocol, side by side, is its vocabulary
(small dataclasses, one per request and one per reply, and the base that checks their fields).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from kvstore.chains import Chain, KeyChain, TokenChain
from kvstore.keys import Namespace
from kvstore.wire import fields as F
from kvstore.wire.errors import RemoteProtocolError

Buffer = Any  # a bytes-like object: bytes, memoryview, numpy array, zmq.Frame


@dataclass(frozen=True)
class Message:
    """Base of every request and reply. ``payload`` names the field sent as a raw frame, if any."""

    op: ClassVar[str] = ""
    schema: ClassVar[dict[str, F.Check]] = {}
    payload: ClassVar[str | None] = None

    def header_fields(self) -> dict[str, Any]:
        """The header's fields; a field that is None and None by default is left out (the receiver
        takes the default): a field added later reaches an older peer only when it is set."""
        optional = self._none_by_default()
        out = {}
        for name in self.schema:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            out[name] = F.wire(value)
        return out

    @classmethod
    def _none_by_default(cls) -> frozenset[str]:
        """The fields whose default is None (found once per message class)."""
        got: frozenset[str] | None = cls.__dict__.get("_none_fields")
        if got is None:
            got = frozenset(f.name for f in fields(cls) if f.default is None)
            setattr(cls, "_none_fields", got)  # noqa: B010 - a class's own cache, not a field
        return got

    def give_back(self) -> Message | None:
        """(A reply.) The request letting go of what this reply holds (a lease, a pin), sent for a
        reply read after its caller stopped waiting; None: it holds nothing."""
        return None

    def payload_frames(self) -> list[Buffer]:
        if self.payload is None:
            return []
        data = getattr(self, self.payload)
        return [] if data is None else [data]

    @classmethod
    def payload_count(cls, header: dict[str, Any]) -> int:
        """How many payload frames a message with these (already checked) fields carries."""
        return 0 if cls.payload is None else 1

    @classmethod
    def from_fields(cls, header: dict[str, Any], frames: list[Buffer]) -> Message:
        """Build from a header's fields (``v``/``op``/``id`` removed) and its payload frames."""
        unknown = set(header) - set(cls.schema)
        if unknown:
            # key=repr: a hand-written client may send bytes keys beside str ones, which do not compare
            names = sorted(unknown, key=repr)
            raise RemoteProtocolError(
                "bad_header",
                f"{cls.op}: unknown field(s) {', '.join(repr(n)[:40] for n in names[:8])}"
                f"{f' and {len(names) - 8} more' if len(names) > 8 else ''}; its fields (text keys) are: "
                f"{', '.join(cls.schema) or 'none'}",
            )
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == cls.payload:
                continue
            if f.name in header:
                values[f.name] = cls.schema[f.name](f.name, header[f.name])
            elif f.default is MISSING:
                raise RemoteProtocolError("bad_header", f"{cls.op}: missing field {f.name!r}")
        expected = cls.payload_count(values)
        if len(frames) != expected:
            raise RemoteProtocolError(
                "bad_frames", f"{cls.op} carries {expected} payload frame(s), got {len(frames)}"
            )
        if cls.payload is not None:
            values[cls.payload] = frames[0] if frames else None
        return cls(**values)


class Named:
    """A request that names blocks: by ``tokens`` (token ids of the whole prefix), or by ``keys``
    (an engine's chained page keys, 32 bytes each, after the page whose key is ``parent``; see
    kvstore.chains). Exactly one of the two (ServerProtocol checks it)."""

    tokens: np.ndarray | None
    keys: bytes | None
    parent: bytes | None

    @property
    def chain(self) -> Chain:
        if self.keys is not None:
            return KeyChain(self.keys, self.parent)
        assert self.tokens is not None
        return TokenChain(self.tokens)


NAMED = {"tokens": F.opt_tokens, "keys": F.opt_engine_keys, "parent": F.opt_key}


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Hello(Message):
    """Register the namespace this client works in; the reply names it (``ns``) and the limits."""

    op = "hello"
    schema = {"namespace": F.namespace, "shm": F.boolean}
    namespace: Namespace
    shm: bool = False  # the client would read and write through shared memory (same host, same user)


@dataclass(frozen=True)
class Ping(Message):
    op = "ping"


@dataclass(frozen=True)
class Lookup(Message, Named):
    op = "lookup"
    schema = {"ns": F.text, **NAMED}
    ns: str
    tokens: np.ndarray | None = None
    keys: bytes | None = None
    parent: bytes | None = None


@dataclass(frozen=True)
class Get(Message, Named):
    """Blocks ``start_block .. start_block+max_blocks-1`` of the prefix, as far as they match."""

    op = "get"
    schema = {"ns": F.text, **NAMED, "start_block": F.nonneg_int, "max_blocks": F.opt_int}
    ns: str
    tokens: np.ndarray | None = None
    start_block: int = 0
    max_blocks: int | None = None
    keys: bytes | None = None
    parent: bytes | None = None


@dataclass(frozen=True)
class Put(Message, Named):
    """Blocks ``start_block ..`` of the prefix ``tokens`` (or ``keys``); ``kv`` is ``shape`` in ``dtype``."""

    op = "put"
    schema = {
        "ns": F.text,
        **NAMED,
        "start_block": F.nonneg_int,
        "shape": F.shape,
        "dtype": F.text,
        "session": F.opt_session,
    }
    payload = "kv"
    ns: str
    shape: tuple[int, ...]
    dtype: str
    tokens: np.ndarray | None = None
    kv: Buffer = None
    start_block: int = 0
    session: str | None = None
    keys: bytes | None = None
    parent: bytes | None = None


@dataclass(frozen=True)
class Evict(Message):
    """Evict what matches every given filter (``all`` alone matches everything)."""

    op = "evict"
    schema = {
        "session": F.opt_session,
        "older_than": F.opt_number,
        "tier": F.opt_text,
        "namespace": F.opt_text,
        "model": F.opt_text,
        "tenant": F.opt_text,
        "all": F.boolean,
        "dry_run": F.boolean,
    }
    session: str | None = None
    older_than: float | None = None
    tier: str | None = None
    namespace: str | None = None
    model: str | None = None
    tenant: str | None = None
    all: bool = False
    dry_run: bool = False


@dataclass(frozen=True)
class Stats(Message):
    op = "stats"


@dataclass(frozen=True)
class Inspect(Message):
    """No fields: every session. ``session``: that session. ``ns`` + ``tokens``: where each block is."""

    op = "inspect"
    schema = {"session": F.opt_session, "ns": F.opt_text, "tokens": F.opt_tokens}
    session: str | None = None
    ns: str | None = None
    tokens: np.ndarray | None = None


@dataclass(frozen=True)
class Prefetch(Message):
    """Bring blocks ``start_block .. start_block+max_blocks-1`` of the session's chain (default: all)
    up into ``to``; the reply (DataOk) is a PrefetchResult as a map."""

    op = "prefetch"
    schema = {"session": F.session, "to": F.text, "start_block": F.nonneg_int, "max_blocks": F.opt_int}
    session: str
    to: str = "ram"
    start_block: int = 0
    max_blocks: int | None = None


@dataclass(frozen=True)
class Flush(Message):
    """Wait (at most ``timeout`` seconds) until every block stored before it is on nvme and LMDB is
    synced to disk. A reply with ``durable`` true is the durable acknowledgement."""

    op = "flush"
    schema = {"timeout": F.opt_number}
    timeout: float | None = None


@dataclass(frozen=True)
class Pin(Message):
    """Pin the held leading blocks of ``tokens`` for ``lease`` seconds (capped at the daemon's pin
    lease): neither evicted nor demoted until ``release`` or the lease ends."""

    op = "pin"
    schema = {"ns": F.text, "tokens": F.tokens, "lease": F.opt_number}
    ns: str
    tokens: np.ndarray
    lease: float | None = None


@dataclass(frozen=True)
class Release(Message):
    """End the pin ``handle`` (from a pin reply) before its lease runs out."""

    op = "release"
    schema = {"handle": F.nonneg_int}
    handle: int


@dataclass(frozen=True)
class Locate(Message, Named):
    """Shared memory, phase one of a get: pin blocks ``start_block ..`` of the prefix (at most
    ``max_blocks``) and say where their bytes are. Blocks in ``tiers`` (the shared pools the client
    mapped) are located in place; others are decoded by the daemon into a staging range. End it with
    ``finish``; the lease ends it anyway."""

    op = "locate"
    schema = {
        "ns": F.text,
        **NAMED,
        "start_block": F.nonneg_int,
        "max_blocks": F.opt_int,
        "tiers": F.text_list,
    }
    ns: str
    tiers: list[str]
    tokens: np.ndarray | None = None
    start_block: int = 0
    max_blocks: int | None = None
    keys: bytes | None = None
    parent: bytes | None = None


@dataclass(frozen=True)
class Finish(Message):
    """Shared memory, phase two of a get: the client copied ``used`` leading blocks of the locate
    ``handle`` (those after came back moved, or were not wanted); the daemon lets go of them."""

    op = "finish"
    schema = {"handle": F.nonneg_int, "used": F.nonneg_int}
    handle: int
    used: int


@dataclass(frozen=True)
class Reserve(Message):
    """Shared memory, phase one of a put: a staging range of ``nbytes`` for this client to write
    K/V into, held until ``commit`` or the lease ends."""

    op = "reserve"
    schema = {"nbytes": F.nonneg_int}
    nbytes: int


@dataclass(frozen=True)
class Commit(Message, Named):
    """Shared memory, phase two of a put: store the ``shape`` K/V the client wrote at the start of
    the staging range ``handle`` as blocks ``start_block ..`` of ``tokens`` (a put without payload);
    the range is given back, or with ``keep`` kept for the client's next chunk (its lease starts
    again; ``finish`` gives it back). A client's commits run one at a time, in the order sent. The
    reply is a put's."""

    op = "commit"
    schema = {
        "ns": F.text,
        **NAMED,
        "start_block": F.nonneg_int,
        "shape": F.shape,
        "dtype": F.text,
        "session": F.opt_session,
        "handle": F.nonneg_int,
        "keep": F.boolean,
    }
    ns: str
    shape: tuple[int, ...]
    dtype: str
    handle: int
    tokens: np.ndarray | None = None
    start_block: int = 0
    session: str | None = None
    keep: bool = False
    keys: bytes | None = None
    parent: bytes | None = None


REQUESTS: dict[str, type[Message]] = {
    c.op: c
    for c in (
        Hello,
        Ping,
        Lookup,
        Get,
        Put,
        Evict,
        Stats,
        Inspect,
        Prefetch,
        Flush,
        Pin,
        Release,
        Locate,
        Finish,
        Reserve,
        Commit,
    )
}


# ---------------------------------------------------------------- replies


@dataclass(frozen=True)
class HelloOk(Message):
    op = "hello"
    schema = {"ns": F.text, "limits": F.a_map, "server": F.text, "shm": F.opt_map}
    ns: str
    limits: dict[str, Any]
    server: str = ""
    shm: dict[str, Any] | None = None  # the shared-memory offer (kvstore.shm.plane.SharedPlane.offer)


@dataclass(frozen=True)
class Pong(Message):
    op = "ping"
    schema = {"server": F.text, "pid": F.nonneg_int, "time": F.opt_number}
    server: str
    pid: int
    time: float | None = None


@dataclass(frozen=True)
class LookupOk(Message):
    op = "lookup"
    schema = {"matched_blocks": F.nonneg_int, "matched_tokens": F.nonneg_int, "tiers": F.a_list}
    matched_blocks: int
    matched_tokens: int
    tiers: list[str]


@dataclass(frozen=True)
class GetOk(Message):
    """``blocks`` blocks from ``start_block``, as one ``[L, 2, blocks*T, H, D]`` payload (none when 0)."""

    op = "get"
    schema = {"start_block": F.nonneg_int, "blocks": F.nonneg_int, "tiers": F.a_list}
    payload = "kv"
    start_block: int
    blocks: int
    tiers: list[str]
    kv: Buffer = None

    @classmethod
    def payload_count(cls, header: dict[str, Any]) -> int:
        return 1 if header.get("blocks") else 0


@dataclass(frozen=True)
class PutOk(Message):
    """``failed`` lists ``[block index, code, message]`` for every block that was not stored."""

    op = "put"
    schema = {"stored": F.nonneg_int, "present": F.nonneg_int, "failed": F.a_list, "deferred": F.nonneg_int}
    stored: int
    present: int
    failed: list[list[Any]]
    deferred: int = 0


@dataclass(frozen=True)
class EvictOk(Message):
    op = "evict"
    schema = {
        "blocks": F.nonneg_int,
        "bytes_freed": F.a_map,
        "moved": F.nonneg_int,
        "keys": F.a_list,
        "not_done": F.opt_text,
        "displaced": F.opt_int,
    }
    blocks: int
    bytes_freed: dict[str, int]
    moved: int
    keys: list[bytes]
    not_done: str | None = None  # a part not done, and why (see results.EvictResult)
    displaced: int | None = None  # other blocks the moves pushed out of the store (EvictResult)


@dataclass(frozen=True)
class DataOk(Message):
    """A reply whose body is plain data (stats, inspect, prefetch)."""

    op = "data"
    schema = {"data": F.anything}
    data: Any


@dataclass(frozen=True)
class ErrorReply(Message):
    """The request failed; ``code`` is stable (see protocol.ERROR_CODES), ``message`` says why and the fix."""

    op = "error"
    schema = {"code": F.text, "message": F.text}
    code: str
    message: str


@dataclass(frozen=True)
class FlushOk(Message):
    """``durable``: everything stored before the flush is on nvme and synced (false: ``timeout`` passed
    first; nothing is lost, flush again). ``settled``, not durable: the flush did not run out of time,
    something could not be written (nvme full of blocks it keeps, a disk error): flushing again at
    once changes nothing until room comes back or the disk takes writes again."""

    op = "flush"
    schema = {"durable": F.boolean, "settled": F.boolean}
    durable: bool
    settled: bool = False


@dataclass(frozen=True)
class PinOk(Message):
    """``blocks`` leading blocks are pinned under ``handle`` for ``lease`` seconds."""

    op = "pin"
    schema = {"handle": F.nonneg_int, "blocks": F.nonneg_int, "lease": F.opt_number}
    handle: int
    blocks: int
    lease: float | None = None

    def give_back(self) -> Message | None:
        return Release(handle=self.handle) if self.blocks else None  # (nothing pinned: no handle)


@dataclass(frozen=True)
class ReleaseOk(Message):
    """``released``: the pin was still held (false: unknown handle, or its lease had ended)."""

    op = "release"
    schema = {"released": F.boolean}
    released: bool


@dataclass(frozen=True)
class LocateOk(Message):
    """Where blocks ``start_block ..`` are: per block ``[segment, extents, pages, gens]`` (segment: an
    index into the hello offer's segments, or -1 for this client's ``staging`` segment, named as
    ``[path, size]``; extents: (offset, length) pairs, int64 little-endian; pages/gens: the pages
    whose generations (uint64) the client checks after copying; empty for staging). ``rest``: held
    blocks after these that did not fit in staging (read them over the socket, or locate again).
    ``instance``: the offer these refer to. ``handle``: for ``finish``."""

    op = "locate"
    schema = {
        "handle": F.nonneg_int,
        "instance": F.text,
        "start_block": F.nonneg_int,
        "blocks": F.a_list,
        "tiers": F.a_list,
        "lease": F.opt_number,
        "staging": F.opt_list,
        "rest": F.nonneg_int,
    }
    handle: int
    instance: str
    start_block: int
    blocks: list[list[Any]]
    tiers: list[str]
    lease: float | None = None
    staging: list[Any] | None = None
    rest: int = 0

    def give_back(self) -> Message:
        return Finish(handle=self.handle, used=0)


@dataclass(frozen=True)
class FinishOk(Message):
    op = "finish"
    schema = {"released": F.boolean}
    released: bool


@dataclass(frozen=True)
class ReserveOk(Message):
    """``nbytes`` at ``offset`` of this client's staging segment (``path``, ``size`` bytes), under
    ``handle``."""

    op = "reserve"
    schema = {
        "handle": F.nonneg_int,
        "instance": F.text,
        "offset": F.nonneg_int,
        "nbytes": F.nonneg_int,
        "lease": F.opt_number,
        "path": F.text,
        "size": F.nonneg_int,
    }
    handle: int
    instance: str
    offset: int
    nbytes: int
    path: str
    size: int
    lease: float | None = None

    def give_back(self) -> Message:
        return Finish(handle=self.handle, used=0)


REPLIES: dict[str, type[Message]] = {
    "hello": HelloOk,
    "ping": Pong,
    "lookup": LookupOk,
    "get": GetOk,
    "put": PutOk,
    "evict": EvictOk,
    "stats": DataOk,
    "inspect": DataOk,
    "prefetch": DataOk,
    "flush": FlushOk,
    "pin": PinOk,
    "release": ReleaseOk,
    "locate": LocateOk,
    "finish": FinishOk,
    "reserve": ReserveOk,
    "commit": PutOk,
}
