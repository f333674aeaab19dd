"""The client's K/V over the daemon's socket, chunk by chunk: any host, and a tcp or CURVE client's only path.

::

    get / read_into   Lookup first when the prefix is longer than one chunk (to size the reads), then
                      Get chunk by chunk, ``window`` in flight; each reply's K/V written where it goes
                      as it arrives. The result ends at the first chunk that came back short.
    put               Put chunk by chunk, one at a time (the store refuses a chunk whose parent block
                      is not stored yet).

A chunk is ``chunk_blocks`` blocks (default: as many as fit in CHUNK_BYTES), fewer when the daemon's
message limit says so. The caller (KVStoreClient) holds its lock and has said hello; nothing here is
thread-safe on its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.chains import Chain, TokenChain
from kvstore.connection import Connection
from kvstore.hostmem import HostBuffers
from kvstore.keys import Namespace
from kvstore.kvbuffers import KVTarget, empty_kv, write_target
from kvstore.memcopy import copy_into
from kvstore.results import FailedBlock, GetResult, LookupResult, PutResult
from kvstore.wire.errors import RemoteProtocolError
from kvstore.wire.messages import Get, GetOk, Lookup, LookupOk, Message, Put, PutOk
from kvstore.wire.protocol import payload_tensor, tensor_payload

CHUNK_BYTES = 128 * 2**20  # K/V bytes per message: a 4K-token SmolLM2 prefix (94 MB) goes in one
WINDOW = 2  # get chunks in flight


class PutTally:
    """A put's replies (and the results of its parts), added up into one PutResult."""

    def __init__(self) -> None:
        self.stored = self.present = self.deferred = self.replies = 0
        self.failed: list[FailedBlock] = []

    def add(self, reply: Message | PutResult) -> None:
        if isinstance(reply, PutResult):
            self.failed.extend(reply.failed)
        else:
            assert isinstance(reply, PutOk)
            self.failed.extend(_failed_block(f) for f in reply.failed)
            self.replies += 1
        self.stored += reply.stored
        self.present += reply.present
        self.deferred += reply.deferred

    def result(self) -> PutResult:
        return PutResult(self.stored, self.present, sorted(set(self.failed)), self.deferred)


def _failed_block(entry: object) -> FailedBlock:
    """One ``[block index, code, message]`` of a PutOk's ``failed``; RemoteProtocolError for another shape."""
    if (
        not isinstance(entry, list)
        or len(entry) != 3
        or isinstance(entry[0], bool)
        or not isinstance(entry[0], int)
        or not all(isinstance(x, str) for x in entry[1:])
    ):
        raise RemoteProtocolError(
            "bad_header",
            f"the daemon's put reply is malformed: a failed block is {entry!r:.60}, not [index, code, "
            "message]; is the endpoint a kvstore daemon of this version?",
        )
    return FailedBlock(entry[0], entry[1], entry[2])


class SocketPath:
    """Lookups, gets and puts of K/V as message payloads on ``conn``."""

    def __init__(
        self,
        conn: Connection,
        *,
        chunk_blocks: int | None = None,
        window: int = WINDOW,
        buffers: HostBuffers | None = None,
    ) -> None:
        """``buffers``: where a result received in chunks is put together (None: fresh memory)."""
        self._conn = conn
        self._buffers = buffers
        self.chunk_blocks = chunk_blocks if chunk_blocks is None else max(1, chunk_blocks)
        self.window = max(1, window)

    def chunk(self, ns: Namespace, names: Chain) -> int:
        """Blocks per message: ``chunk_blocks`` (or CHUNK_BYTES worth), fewer if the daemon's limit says so."""
        limits, layout = self._conn.limits, ns.layout
        blocks = self.chunk_blocks or max(1, CHUNK_BYTES // layout.block_nbytes)
        if limits is None:
            return blocks
        named = 4 * len(names.tokens) if isinstance(names, TokenChain) else len(names.keys_raw)
        room = (limits.max_message_bytes - named - 4096) // layout.block_nbytes  # 4096: header fields
        return max(1, min(blocks, room))

    def lookup(self, ns: Namespace, tokens: Chain) -> LookupResult:
        reply = self._conn.call(Lookup(ns=ns.id, **tokens.fields()), idempotent=True)
        assert isinstance(reply, LookupOk)
        return LookupResult(reply.matched_blocks, reply.matched_tokens, list(reply.tiers))

    def get(self, ns: Namespace, tokens: Chain, device: torch.device | str) -> GetResult:
        """The longest stored prefix of ``tokens`` as one tensor on ``device``, filled chunk by chunk (a
        prefix that fits one message on the CPU is the received frame itself, not copied)."""
        layout, T = ns.layout, ns.layout.block_tokens
        chunk = self.chunk(ns, tokens)
        total = tokens.blocks(T)
        if total > chunk:
            total = self.lookup(ns, tokens).matched_blocks
        if total == 0:
            return GetResult(0, 0, None, [])
        starts = list(range(0, total, chunk))
        out: torch.Tensor | None = None
        tiers: list[list[str]] = [[] for _ in starts]
        got = [0] * len(starts)

        def on_reply(i: int, reply: Message) -> None:
            nonlocal out
            assert isinstance(reply, GetOk)
            got[i], tiers[i] = reply.blocks, list(reply.tiers)
            if reply.blocks == 0:
                return
            part = payload_tensor(reply.kv, layout.shape(reply.blocks * T), layout.torch_dtype)
            if len(starts) == 1 and torch.device(device).type == "cpu":
                out = part  # one chunk: the tensor is the received frame, no copy
                return
            if out is None:
                out = empty_kv(layout.shape(total * T), layout.torch_dtype, device, self._buffers)
            s = starts[i] * T
            copy_into(out[:, :, s : s + reply.blocks * T], part)

        self._fetch(ns, tokens, starts, chunk, total, on_reply)
        matched = _matched(starts, got, chunk, total, 0)
        if matched == 0 or out is None:
            return GetResult(0, 0, None, [])
        kv = out if out.shape[2] == matched * T else out[:, :, : matched * T]
        if kv.device != torch.device(device):
            kv = kv.to(device)
        return GetResult(matched, matched * T, kv, [t for ts in tiers for t in ts][:matched])

    def read_into(
        self, ns: Namespace, tokens: Chain, out: KVTarget, total: int, first: int = 0
    ) -> tuple[int, list[str]]:
        """Blocks ``first .. total-1`` into ``out``, each chunk written as it arrives. Returns the blocks
        matched from block 0 and the tiers of those from ``first``."""
        layout, T = ns.layout, ns.layout.block_tokens
        chunk = self.chunk(ns, tokens)
        if total - first > chunk:
            total = min(total, self.lookup(ns, tokens).matched_blocks)
        if total <= first:
            return first, []
        starts = list(range(first, total, chunk))
        got = [0] * len(starts)
        tiers: list[list[str]] = [[] for _ in starts]

        def on_reply(i: int, reply: Message) -> None:
            assert isinstance(reply, GetOk)
            got[i], tiers[i] = reply.blocks, list(reply.tiers)
            if reply.blocks:
                part = payload_tensor(reply.kv, layout.shape(reply.blocks * T), layout.torch_dtype)
                write_target(out, starts[i] * T, part)

        self._fetch(ns, tokens, starts, chunk, total, on_reply)
        if out.device.type == "cuda":  # the replies' host bytes live until the copies out of them ran
            torch.cuda.current_stream(out.device).synchronize()
        matched = _matched(starts, got, chunk, total, first)
        return matched, [t for ts in tiers for t in ts][: matched - first]

    def _fetch(
        self,
        ns: Namespace,
        tokens: Chain,
        starts: list[int],
        chunk: int,
        total: int,
        on_reply: Callable[[int, Message], None],
    ) -> None:
        T = ns.layout.block_tokens

        def make(i: int) -> Message:
            s = starts[i]
            n = min(chunk, total - s)
            return Get(ns=ns.id, **tokens.head(s + n, T).fields(), start_block=s, max_blocks=n)

        self._conn.pipeline(len(starts), make, on_reply, idempotent=True, window=self.window)

    def put(
        self, ns: Namespace, tokens: Chain, kv: torch.Tensor, total: int, session: str | None, first: int = 0
    ) -> PutResult:
        """Blocks ``first .. total-1`` of ``kv`` ([L, 2, T, H, D]), one chunk at a time."""
        layout, T = ns.layout, ns.layout.block_tokens
        tally = PutTally()
        chunk = self.chunk(ns, tokens)
        starts = list(range(first, total, chunk))

        def make(i: int) -> Message:
            s, e = starts[i], min(starts[i] + chunk, total)
            part = kv[:, :, s * T : e * T]
            return Put(
                ns=ns.id,
                **tokens.head(e, T).fields(),
                start_block=s,
                shape=tuple(part.shape),
                dtype=layout.dtype,
                kv=tensor_payload(part),
                session=session,
            )

        # one chunk at a time: the store refuses a chunk whose parent block is not stored yet
        self._conn.pipeline(len(starts), make, lambda _, reply: tally.add(reply), idempotent=True, window=1)
        return tally.result()

    def put_from(
        self, ns: Namespace, tokens: Chain, src: KVTarget, total: int, session: str | None, first: int = 0
    ) -> PutResult:
        """``put`` of a tensor or a PagedKV (whose blocks from ``first`` on are gathered into one tensor)."""
        return self.put(ns, tokens, as_tensor(src, ns, total, first), total, session, first)


def as_tensor(src: KVTarget, ns: Namespace, total: int, first: int = 0) -> torch.Tensor:
    """``src``'s first ``total`` blocks as a tensor (a PagedKV's blocks from ``first`` on are gathered
    into one; those before are left unset)."""
    if isinstance(src, torch.Tensor):
        return src
    layout = ns.layout
    T = layout.block_tokens
    out = empty_kv(layout.shape(total * T), layout.torch_dtype, "cpu")
    src.read(first * T, out[:, :, first * T :])
    return out


def _matched(starts: list[int], got: list[int], chunk: int, total: int, first: int) -> int:
    """Blocks matched from block 0: the result ends at the first chunk that came back short."""
    matched = first
    for i, s in enumerate(starts):
        matched = s + got[i]
        if got[i] < min(chunk, total - s):
            break
    return matched
