"""The kvstore wire protocol, without I/O (in the manner of h11).

Every message is a list of frames::

    frame 0   msgpack map {"v": PROTOCOL_VERSION, "op": str, "id": int, ...fields}
    frame 1   (put requests, get replies with blocks > 0) raw K/V bytes [L, 2, n*T, H, D]

A ``ClientProtocol`` turns typed requests into frames and frames back into
typed replies, matching them by request id (replies may come out of order).
A ``ServerProtocol`` turns frames into validated requests (or a
RemoteProtocolError carrying the code of the error reply to send), registers
namespaces (``hello``; registry.py) and counts each peer's requests in flight.
Moving frames is the job of client.py and server.py; tests join the two
objects in memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from kvstore.errors import LayoutError
from kvstore.keys import Namespace
from kvstore.layout import DTYPES, dtype_name
from kvstore.wire.errors import LocalProtocolError, RemoteProtocolError
from kvstore.wire.messages import (
    REPLIES,
    REQUESTS,
    Buffer,
    Commit,
    ErrorReply,
    Get,
    Hello,
    HelloOk,
    Locate,
    Message,
    Named,
    Put,
)
from kvstore.wire.registry import NAMESPACES_PER_TENANT, NamespaceRegistry

PROTOCOL_VERSION = 1
# requests whose replies hold something until given back (a lease, a pin): a reply read after its
# caller stopped waiting (on the same socket) is given back then, not left until its lease lapses
HOLDING = frozenset(op for op, cls in REPLIES.items() if cls.give_back is not Message.give_back)
CUT_KEPT = 256  # forgotten requests of those kinds whose late replies are still looked for


def tensor_payload(kv: torch.Tensor) -> Buffer:
    """The bytes of ``kv`` (on the CPU, contiguous) as a buffer zmq can send without copying."""
    # (a lazily negated or conjugated view holds other bytes than its values: resolved first)
    kv = kv.detach().to("cpu").resolve_neg().resolve_conj().contiguous()
    return kv.view(-1).view(torch.uint8).numpy()


def payload_tensor(buf: Buffer, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the bytes of a received frame (no copy when the frame is writable)."""
    raw: Any = getattr(buf, "buffer", buf)
    view = memoryview(raw)
    if view.readonly:  # bytes (in-memory use); zmq frames are writable
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=dtype).view(shape)


@dataclass(frozen=True)
class Limits:
    """What one message may carry. The daemon enforces them and tells clients in the hello reply."""

    max_message_bytes: int = 512 * 2**20
    max_tokens: int = 131072
    max_inflight: int = 64

    @property
    def max_header_bytes(self) -> int:
        # room for the fields plus what names max_tokens tokens: a token id takes at most 5 bytes (a
        # msgpack uint32), an engine key 32 bytes and may name a block of one token
        return 65536 + 32 * self.max_tokens

    def to_dict(self) -> dict[str, int]:
        return {
            "max_message_bytes": self.max_message_bytes,
            "max_tokens": self.max_tokens,
            "max_inflight": self.max_inflight,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Limits:
        try:
            return cls(**{k: int(d[k]) for k in ("max_message_bytes", "max_tokens", "max_inflight")})
        except (KeyError, TypeError, ValueError) as e:
            raise RemoteProtocolError("bad_header", f"hello reply has malformed limits {d!r}") from e


MAX_FRAMES = 2  # a request's frames: its header and at most one payload


def nbytes(buf: Buffer) -> int:
    """Size in bytes of a frame or buffer."""
    n = getattr(buf, "nbytes", None)  # memoryview, numpy; bytes and zmq.Frame have len()
    return int(n) if n is not None else len(buf)


def encode(rid: int | None, msg: Message, op: str | None = None) -> list[Buffer]:
    """Frames of ``msg`` with request id ``rid``. ``op`` overrides the header op (replies echo the request's)."""
    header = {"v": PROTOCOL_VERSION, "op": op or msg.op, "id": rid, **msg.header_fields()}
    if isinstance(msg, ErrorReply):
        header["op"] = "error"
    return [msgpack.packb(header, use_bin_type=True), *msg.payload_frames()]


def _peek(frame: Buffer) -> tuple[int | None, str | None]:
    """(request id, op) from the first fields of a header too large to decode; None where not there
    (the op only when it is a request's: counted under it)."""
    unpacker = msgpack.Unpacker(raw=False)
    raw: Any = getattr(frame, "buffer", frame)
    unpacker.feed(bytes(memoryview(raw).cast("B")[:4096]))
    rid: int | None = None
    op: str | None = None
    try:
        for _ in range(min(unpacker.read_map_header(), 8)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if key == "id":
                ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64
                rid = value if ok else None
            elif key == "op" and isinstance(value, str) and value in REQUESTS:
                op = value
            if rid is not None and op is not None:
                break
    except Exception:  # noqa: BLE001 - garbage, or the first fields are long: what was read
        pass
    return rid, op


def _refused(code: str, message: str, frame: Buffer) -> RemoteProtocolError:
    """A refusal of a header too large to decode, with the id and op its first fields name."""
    rid, op = _peek(frame)
    return RemoteProtocolError(code, message, request_id=rid, op=op)


# a request's header: at most this many fields a map (its namespace's too), bytes a string
_REQUEST_BOUNDS = {"max_map_len": 64, "max_str_len": 65536}


def _not_msgpack(frame: Buffer, err: Exception) -> str:
    """Why frame 0 was refused: msgpack's reason (some of its errors carry none: their type then),
    and how the frame begins."""
    why = str(err) or type(err).__name__
    head = bytes(memoryview(frame).cast("B")[:16]).hex(" ")
    return f"frame 0 is not valid msgpack ({why}); it begins {head or 'empty'}"


def read_header(frame: Buffer, limit: int, max_list: int | None = None) -> tuple[dict[str, Any], int | None]:
    """Decode frame 0 into (fields, request id). Raises RemoteProtocolError (with the id when known).

    ``max_list``: a request's header (the daemon's side), whose longest list is its token ids; its
    maps, lists and strings are bounded as they are decoded, so that a header of millions of items
    (unknown fields, token ids past the limit) is refused before any of them is built or checked
    (the loop that reads it serves every client)."""
    size = nbytes(frame)
    if size > limit:
        raise _refused("too_large", f"header is {size} bytes, over the limit of {limit}", frame)
    bounds = {} if max_list is None else _REQUEST_BOUNDS | {"max_array_len": max(max_list, 16)}
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, **bounds)
    except ValueError as e:
        if max_list is None or "exceeds max" not in str(e):
            raise RemoteProtocolError("bad_message", _not_msgpack(frame, e)) from None
        if "max_array_len" in str(e):  # a request's only long list is its token ids
            raise _refused(
                "too_many_tokens", f"a list of more items than max_tokens_per_request {max_list} ({e})", frame
            ) from None
        raise _refused("too_large", f"header holds more than a request takes ({e})", frame) from None
    except Exception as e:  # msgpack raises many types on garbage
        raise RemoteProtocolError("bad_message", _not_msgpack(frame, e)) from None
    if not isinstance(header, dict):
        raise RemoteProtocolError(
            "bad_message", f"frame 0 must be a msgpack map, got {type(header).__name__}"
        )
    rid = header.pop("id", None)
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 2**64):
        raise RemoteProtocolError("bad_header", f"header id must be an unsigned integer, got {rid!r:.80}")
    version = header.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(
            "version",
            f"protocol version {version!r:.80} is not spoken here (this side speaks {PROTOCOL_VERSION}); "
            "upgrade the older of client and daemon",
            rid,
        )
    return header, rid


def _check_put_payload(msg: Put, exc: type[LocalProtocolError] | type[RemoteProtocolError]) -> None:
    """The payload of a put must hold exactly ``shape`` values of ``dtype``."""
    try:
        itemsize = DTYPES[dtype_name(msg.dtype)].itemsize
    except LayoutError as e:
        raise exc("layout", str(e)) from None
    expect = math.prod(msg.shape) * itemsize
    got = nbytes(msg.kv) if msg.kv is not None else 0
    if got != expect:
        raise exc(
            "bad_payload", f"put payload is {got} bytes; shape {list(msg.shape)} in {msg.dtype} is {expect}"
        )


def _check_named(msg: Named) -> None:
    """A request names its blocks by tokens or by engine keys: exactly one; ``parent`` only with keys."""
    if (msg.tokens is None) == (msg.keys is None):
        raise RemoteProtocolError(
            "bad_header", "give exactly one of 'tokens' (token ids) and 'keys' (engine page keys)"
        )
    if msg.parent is not None and msg.keys is None:
        raise RemoteProtocolError("bad_header", "'parent' (an engine page key) goes only with 'keys'")


def reply_frames(request: Request, msg: Message) -> list[Buffer]:
    """Frames answering ``request`` with ``msg`` (a reply of its op, or an ErrorReply). Pure: safe on any thread.

    Raises LocalProtocolError when ``msg`` does not answer that op.
    """
    if not isinstance(msg, (ErrorReply, REPLIES[request.msg.op])):
        raise LocalProtocolError("bad_header", f"{type(msg).__name__} does not answer {request.msg.op!r}")
    return encode(request.id, msg, op=request.msg.op)


@dataclass(frozen=True)
class Request:
    """A validated request from ``peer``; ``namespace`` is resolved from ``msg.ns`` when the op has one.

    ``tenant``: the tenant the connection authenticated as (CURVE), to which the
    request is confined (see kvstore.daemon.tenancy); None for a trusted connection.
    """

    peer: bytes
    id: int
    msg: Message
    namespace: Namespace | None = None
    tenant: str | None = None


class ServerProtocol:
    """The daemon's half: validation, namespaces, and requests in flight per peer. Not thread-safe."""

    def __init__(
        self,
        limits: Limits,
        server: str = "kvstore",
        *,
        namespaces_per_tenant: int = NAMESPACES_PER_TENANT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``namespaces_per_tenant``: how many of the MAX_NAMESPACES one tenant (a namespace's
        ``tenant`` field; a CURVE client can name only its own) may register. ``clock``: seconds,
        for how long a registration has been idle (NAMESPACE_IDLE)."""
        self.limits = limits
        self.server = server
        self.registry = NamespaceRegistry(namespaces_per_tenant, clock)
        self.inflight: dict[bytes, int] = {}

    @property
    def namespaces(self) -> dict[str, Namespace]:
        """The registered namespaces, by id (read only)."""
        return self.registry.namespaces

    @property
    def expired(self) -> int:
        """Registrations given up for being idle (NAMESPACE_IDLE)."""
        return self.registry.expired

    def receive(
        self,
        peer: bytes,
        frames: list[Buffer],
        *,
        tenant: str | None = None,
        received: tuple[int, int] | None = None,
    ) -> Request:
        """Validate a request; on success it counts as in flight until ``reply`` is called for it.

        Raises RemoteProtocolError (code and, when readable, the request id) for
        anything malformed or over a limit; nothing is then counted.
        """
        if not frames:
            raise RemoteProtocolError("bad_message", "empty message")
        header, rid = read_header(frames[0], self.limits.max_header_bytes, self.limits.max_tokens)
        op = header.pop("op", None)
        try:
            if rid is None:
                raise RemoteProtocolError("bad_header", "header has no request id")
            count, total = received if received is not None else (len(frames), sum(nbytes(f) for f in frames))
            if count > MAX_FRAMES:
                raise RemoteProtocolError(
                    "bad_frames", f"message of {count} frames; a request has at most {MAX_FRAMES}"
                )
            if total > self.limits.max_message_bytes:
                raise RemoteProtocolError(
                    "too_large",
                    f"message is {total} bytes, over max_message_bytes "
                    f"{self.limits.max_message_bytes}; send smaller chunks",
                )
            cls = REQUESTS.get(op) if isinstance(op, str) else None
            if cls is None:
                raise RemoteProtocolError(
                    "unknown_op", f"unknown op {op!r:.80}; ops are {', '.join(REQUESTS)}"
                )
            msg = cls.from_fields(header, list(frames[1:]))
            namespace = self._check(msg, tenant)
            if self.inflight.get(peer, 0) >= self.limits.max_inflight:
                raise RemoteProtocolError(
                    "busy",
                    f"{self.limits.max_inflight} requests already in flight "
                    "from this client; wait for replies",
                )
        except RemoteProtocolError as e:
            e.request_id = rid
            e.op = op if isinstance(op, str) and op in REQUESTS else None
            raise
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        return Request(peer, rid, msg, namespace)

    def _check(self, msg: Message, tenant: str | None) -> Namespace | None:
        """The request's own checks; ``tenant``: the one a CURVE client is confined to (None: not
        confined), whose requests see no namespace of another tenant, not even its layout."""
        tokens = getattr(msg, "tokens", None)
        if tokens is not None and len(tokens) > self.limits.max_tokens:
            raise RemoteProtocolError(
                "too_many_tokens",
                f"{len(tokens)} token ids, over max_tokens_per_request {self.limits.max_tokens}",
            )
        if isinstance(msg, Named):
            _check_named(msg)
        ns_id = getattr(msg, "ns", None)
        if ns_id is None:
            return None
        namespace = self.registry.get(ns_id, tenant)
        if namespace is None:
            raise RemoteProtocolError(
                "unknown_namespace", f"namespace {ns_id!r:.80} is not registered; send hello first"
            )
        layout = namespace.layout
        if isinstance(msg, (Put, Commit)):
            if (
                msg.dtype != layout.dtype
                or len(msg.shape) != 5
                or msg.shape[2] % layout.block_tokens
                or msg.shape != layout.shape(msg.shape[2])
            ):
                raise RemoteProtocolError(
                    "layout",
                    f"put of shape {list(msg.shape)} {msg.dtype} contradicts the "
                    f"namespace layout {layout.to_dict()}",
                )
            if isinstance(msg, Put):
                _check_put_payload(msg, RemoteProtocolError)
            blocks = msg.shape[2] // layout.block_tokens
            if blocks == 0 or msg.start_block + blocks > msg.chain.blocks(layout.block_tokens):
                raise RemoteProtocolError(
                    "invalid_argument",
                    f"put of {blocks} block(s) from block "
                    f"{msg.start_block} needs that many full blocks of tokens (or engine keys)",
                )
        if isinstance(msg, Named) and msg.keys is not None:
            named = msg.chain.tokens_named(layout.block_tokens)
            if named > self.limits.max_tokens:
                raise RemoteProtocolError(
                    "too_many_tokens",
                    f"{len(msg.keys) // 32} engine keys name {named} tokens, over "
                    f"max_tokens_per_request {self.limits.max_tokens}; send fewer keys per request",
                )
        if isinstance(msg, (Get, Locate)) and msg.max_blocks == 0:
            raise RemoteProtocolError(
                "invalid_argument", f"{msg.op} max_blocks must be at least 1 (or absent)"
            )
        self.registry.used(ns_id, stores=isinstance(msg, (Put, Commit)))
        return namespace

    def hello(self, request: Request, shm: dict[str, Any] | None = None) -> list[Buffer]:
        """Register the hello's namespace and return the reply frames (hello needs no worker).

        ``shm``: the shared-memory offer to make, when the client asked and may have it."""
        return self.reply(request, self.welcome(request, shm))

    def welcome(self, request: Request, shm: dict[str, Any] | None = None) -> HelloOk | ErrorReply:
        """``hello``'s reply, not yet framed (the caller counts it, then frames it with ``reply``)."""
        assert isinstance(request.msg, Hello)
        ns = request.msg.namespace
        if ns.layout.block_nbytes > self.limits.max_message_bytes:
            # such a block could never be put, and a get of one would be charged more than the daemon
            # lets all requests hold (kvstore.daemon.budget): one client's misses would turn others away
            return ErrorReply(
                code="invalid_argument",
                message=(
                    f"a block of this layout is {ns.layout.block_nbytes} bytes, over max_message_bytes "
                    f"{self.limits.max_message_bytes}: fewer tokens a block (block_tokens) or a smaller layout"
                ),
            )
        try:
            self.registry.register(ns)
        except RemoteProtocolError as e:
            return ErrorReply(code=e.code, message=e.message)
        return HelloOk(ns=ns.id, limits=self.limits.to_dict(), server=self.server, shm=shm)

    def reply(self, request: Request, msg: Message) -> list[Buffer]:
        """Frames answering ``request`` with ``msg``; the request stops counting as in flight."""
        frames = reply_frames(request, msg)
        self.done(request.peer)
        return frames

    def error(self, peer: bytes, rid: int | None, code: str, message: str, *, done: bool) -> list[Buffer]:
        """Frames of an error reply; ``done`` when it answers a request that was counted in flight."""
        if done:
            self.done(peer)
        return encode(rid, ErrorReply(code=code, message=message))

    def done(self, peer: bytes) -> None:
        """One request of ``peer`` was answered (by frames from ``reply_frames`` sent elsewhere)."""
        left = self.inflight.get(peer, 0) - 1
        if left > 0:
            self.inflight[peer] = left
        else:
            self.inflight.pop(peer, None)


class ClientProtocol:
    """The client's half: request ids and the replies they await. Not thread-safe."""

    def __init__(self) -> None:
        self._next_id = 1
        self.pending: dict[int, str] = {}  # request id -> op
        # forgotten requests whose late reply may hold a lease or pin (HOLDING), and the requests
        # that give back what such replies held, for the connection to send
        self._cut: dict[int, str] = {}
        self.unclaimed: list[Message] = []

    def send(self, msg: Message) -> tuple[int, list[Buffer]]:
        """Frames for ``msg`` under a fresh request id. Raises LocalProtocolError for an invalid message."""
        if msg.op not in REQUESTS or not isinstance(msg, REQUESTS[msg.op]):
            raise LocalProtocolError("unknown_op", f"{type(msg).__name__} is not a request")
        if isinstance(msg, Put):
            _check_put_payload(msg, LocalProtocolError)
        rid = self._next_id
        try:
            frames = encode(rid, msg)
        except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as e:
            # a field msgpack cannot carry (an integer past 64 bits, a string that is no UTF-8): the
            # caller's argument, named as such; nothing was sent
            raise LocalProtocolError(
                "invalid_argument", f"{type(msg).__name__}: an argument cannot be sent ({e})"
            ) from None
        self._next_id += 1
        self.pending[rid] = msg.op
        return rid, frames

    def receive(self, frames: list[Buffer]) -> tuple[int, Message] | None:
        """The (request id, reply) in ``frames``: a typed reply or an ErrorReply.

        Returns None for a reply to a request no longer awaited (it timed out
        and was forgotten). Raises RemoteProtocolError for a malformed reply.
        """
        if not frames:
            raise RemoteProtocolError("bad_message", "empty reply")
        header, rid = read_header(frames[0], 2**31)
        op = header.pop("op", None)
        if rid is None or rid not in self.pending:
            if rid is not None:
                self._late(rid, op, header, frames)
            return None
        expected = self.pending.pop(rid)
        cls = ErrorReply if op == "error" else REPLIES.get(expected)
        if cls is None or (op != "error" and op != expected):
            raise RemoteProtocolError("bad_header", f"reply op {op!r} to a {expected!r} request", rid)
        return rid, cls.from_fields(header, list(frames[1:]))

    def forget(self, rid: int, *, sent: bool = True) -> None:
        """Stop awaiting ``rid`` (its caller's time ran out, or it failed); a late reply to it read on
        this socket is dropped by ``receive``, and what it holds is queued to be given back
        (``unclaimed``). ``sent=False``: it never left; no reply is looked for."""
        op = self.pending.pop(rid, None)
        if sent and op in HOLDING:
            self._cut[rid] = op
            if len(self._cut) > CUT_KEPT:  # the oldest's reply is not coming: its lease lapses
                del self._cut[next(iter(self._cut))]

    def _late(self, rid: int, op: Any, header: dict[str, Any], frames: list[Buffer]) -> None:
        """A reply to the forgotten ``rid``: what it holds (a lease, a pin) is given back."""
        expected = self._cut.pop(rid, None)
        if expected is None or op != expected:
            return
        try:
            back = REPLIES[expected].from_fields(header, list(frames[1:])).give_back()
        except RemoteProtocolError:  # garbled: nothing to give back that could be named
            return
        if back is not None:
            self.unclaimed.append(back)
