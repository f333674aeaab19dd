"""The client library: ``KVStoreClient``.

::

    with KVStoreClient(endpoint, model="smollm2-135m-instruct", layout=layout) as c:
        c.lookup(ids).matched_tokens     # leading tokens the daemon holds, block-aligned
        c.put(ids, kv, session="conv")   # kv [L, 2, T, H, D]; the full blocks are stored
        r = c.get(ids)                   # r.kv [L, 2, r.matched_tokens, H, D]

Long prefixes stream in chunks of ``chunk_blocks`` blocks (default: as many
as fit in socket_path.CHUNK_BYTES, and in the daemon's message limit): ``get`` keeps
``window`` chunks in flight and fills one preallocated tensor chunk by chunk
(a prefix that fits one message comes back as the received frame itself, not
copied); ``put`` copies one chunk at a time out of ``kv`` and sends the next
when the previous is stored (the store refuses a chunk whose parent block is
not stored yet).

Same host (an ``ipc://`` daemon of this user, by default): K/V never crosses
the socket. The hello reply offers the daemon's shared segments; ``get`` and
``get_into`` locate the blocks (the daemon pins them by lease), copy raw
blocks or decode frames from the mapped pools straight into the destination,
check the pages' generations and finish; ``put`` and ``put_from`` reserve a
staging range, write into it and commit. A block whose pages were reused
meanwhile is a miss (the result ends before it), never served. A daemon that
restarted is seen in the next hello (a new instance): the client maps the new
segments, or falls back to the socket when it cannot.

Every reply is awaited at most ``timeout`` seconds. Idempotent calls
(everything but a real evict) are then re-sent on a fresh socket after a new
hello, up to ``retries`` times, so a daemon restart is invisible to the caller;
the worst case is ``(retries + 1) * timeout``. A client may be shared by
threads: calls take turns. Error replies raise the kvstore.errors class of
their code (with ServerError mixed in); a lost daemon raises RequestTimeout.

The public API and its contracts live here (the operator calls in client_operator.py, the checks of
the arguments in client_args.py); the connection's mechanics in connection.py, K/V over the socket in
socket_path.py, K/V through shared memory in shm/client_path.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import zmq

from kvstore.chains import Chain, KeyChain, TokenChain, as_chain
from kvstore.client_args import count_arg, device_arg, endpoint_arg, seconds_arg, start_arg
from kvstore.client_operator import OperatorCalls
from kvstore.connection import Connection
from kvstore.daemon.auth import ClientKeys
from kvstore.errors import InvalidNamespace, LayoutError
from kvstore.hostmem import HostBuffers
from kvstore.keys import Namespace, TokenInput
from kvstore.kvbuffers import KVTarget, PagedKV, check_target, empty_kv, target_tokens
from kvstore.layout import KVLayout
from kvstore.results import GetResult, LookupResult, PutResult
from kvstore.shm.client_path import SharedPath
from kvstore.socket_path import WINDOW, SocketPath
from kvstore.wire.errors import DeadlinePassed, LocalProtocolError
from kvstore.wire.messages import (
    Message,
    Ping,
    Pong,
)

# a same-host get into a fresh host tensor reserves the whole prompt's K/V without asking first (the
# pages are touched only where written); past this many bytes it asks how much is held, then reserves
# that: a 128K-token prompt of a 70B model is 40 GiB, of which one block may be stored
SIZE_BY_LOOKUP = 1 << 30


class KVStoreClient(OperatorCalls):
    """A connection to a kvstore daemon for one namespace (``model``, ``layout``, ``tenant``, ``revision``).

    ``model``/``layout`` may be left out for an operator's client (ping, stats,
    evict, sessions, inspect, prefetch). Construction does no network I/O (it
    reads key files); the first call connects and says hello.

    CURVE (tcp daemons with ``curve_secret_key``): ``curve_server_key`` is the
    daemon's public key, ``curve_secret_key`` this client's secret key
    (``curve_public_key`` is derived from it; given, it must match). Each is
    a Z85 key or the path of a key file written by ``kvstore keygen`` (secret
    files must be private: mode 0600). Without them, a ``tcp://`` client reads
    ``KVSTORE_CURVE_SERVER_KEY``, ``KVSTORE_CURVE_SECRET_KEY`` and
    ``KVSTORE_CURVE_PUBLIC_KEY`` (so the ``kvstore`` CLI works over tcp); ipc
    clients never use CURVE from the environment. The daemon confines a CURVE
    client to the tenant its key is listed with: ``tenant`` must be that
    tenant (a hello for another raises Forbidden), and evict, inspect, stats
    and prefetch see only that tenant's sessions and blocks. A key the daemon
    does not list gets no answer at all: calls raise RequestTimeout. Raises
    ConfigError for a bad key, a secret file others can read, a server key
    without a secret key, or an endpoint only a daemon can use (``tcp://*:5555``).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        model: str | None = None,
        layout: KVLayout | None = None,
        tenant: str = "default",
        timeout: float = 5.0,
        *,
        revision: str = "",
        retries: int = 2,
        chunk_blocks: int | None = None,
        window: int = WINDOW,
        context: zmq.Context | None = None,
        curve_server_key: str | bytes | None = None,
        curve_secret_key: str | bytes | None = None,
        curve_public_key: str | bytes | None = None,
        shared_memory: bool | None = None,
        wait_when_busy: bool = True,
    ) -> None:
        """``shared_memory``: None (default) uses the daemon's shared memory when it offers it (an
        ``ipc://`` daemon of this user); False always uses the socket. ``wait_when_busy``: a ``busy``
        answer (the daemon over a budget) is asked again, pausing, for up to ``timeout``; False
        raises it at once (a caller that would rather recompute than wait)."""
        if (model is None) != (layout is None):
            raise InvalidNamespace("give both model and layout (or neither, for an operator's client)")
        timeout = seconds_arg("timeout", timeout)
        retries = count_arg("retries", retries)
        window = count_arg("window", window, least=1)
        chunk_blocks = count_arg("chunk_blocks", chunk_blocks, least=1, none=True)
        self.namespace = (
            None
            if model is None or layout is None
            else Namespace(model=model, layout=layout, tenant=tenant, revision=revision)
        )
        self.endpoint = endpoint_arg(endpoint)
        curve = ClientKeys.resolve(self.endpoint, curve_server_key, curve_secret_key, curve_public_key)
        want_shm = self.endpoint.startswith("ipc://") and curve is None and shared_memory is not False
        self._conn = Connection(
            self.endpoint,
            timeout=timeout,
            retries=retries,
            namespace=self.namespace,
            context=context,
            curve=curve,
            shared_memory=want_shm,
            wait_when_busy=wait_when_busy,
        )
        self._lock = threading.RLock()  # one call at a time: the paths below are not thread-safe
        # get results' host memory, handed out again once the caller has dropped a result (hostmem.py)
        self._buffers = HostBuffers()
        self._socket = SocketPath(self._conn, chunk_blocks=chunk_blocks, window=window, buffers=self._buffers)
        self._shm = SharedPath(self._conn, self._socket)

    # ------------------------------------------------------------------ plumbing

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, abort: bool = False) -> None:
        """Close the connection and unmap shared memory, once a call another thread runs on this
        client is over; ``abort``: that call ends now (it raises ClientClosed), not after its
        time-outs and retries (an engine shutting down while the daemon does not answer)."""
        if not self._lock.acquire(blocking=False):
            if abort:
                self._conn.abort()
            self._lock.acquire()
        try:
            self._conn.close()
            self._shm.close()
            self._buffers.close()
        finally:
            self._lock.release()

    @property
    def shared_memory(self) -> bool:
        """Whether K/V moves through shared memory (as of the last hello; False before the first call
        and once closed)."""
        with self._held():
            return self._shm.mapping() is not None

    @property
    def timeout(self) -> float:
        """Seconds a call waits for each reply."""
        return self._conn.timeout

    @property
    def retries(self) -> int:
        """Times a call that timed out is sent again (``timeout`` each)."""
        return self._conn.retries

    @property
    def wait_when_busy(self) -> bool:
        """Whether a ``busy`` answer is asked again (for up to ``timeout``) rather than raised."""
        return self._conn.wait_when_busy

    @property
    def max_tokens(self) -> int | None:
        """The daemon's max_tokens_per_request, as its last hello said (None before the first call):
        a lookup, get or put naming more tokens is refused before it is sent."""
        limits = self._conn.limits
        return None if limits is None else limits.max_tokens

    def _ns(self) -> Namespace:
        if self.namespace is None:
            raise InvalidNamespace("this client has no namespace; pass model= and layout= to KVStoreClient")
        return self.namespace

    def _names(self, token_ids: TokenInput | Chain) -> Chain:
        """Token ids (or a chain of engine keys) as a chain, within the daemon's limits."""
        names = as_chain(token_ids)
        limits = self._conn.limits
        n = names.tokens_named(self._ns().layout.block_tokens)
        if limits is not None and n > limits.max_tokens:
            what = "token ids" if isinstance(names, TokenChain) else "tokens' worth of engine keys"
            raise LocalProtocolError(
                "too_many_tokens",
                f"{n} {what}, over the daemon's max_tokens_per_request {limits.max_tokens}",
            )
        return names

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The client's lock (one call at a time), waited for no longer than the calling thread's
        deadline (``within``): a call another thread runs meanwhile does not take this one's budget."""
        left = self._conn.left()
        if not self._lock.acquire(timeout=-1 if left is None else min(max(0.0, left), threading.TIMEOUT_MAX)):
            raise DeadlinePassed(
                f"the caller's time ran out while another thread's call to {self.endpoint} held this client"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _call(self, msg: Message, *, idempotent: bool = True) -> Message:
        with self._held():
            return self._conn.call(msg, idempotent=idempotent)

    def within(self, seconds: float) -> contextlib.AbstractContextManager[None]:
        """``with client.within(s):`` every call this thread makes meanwhile ends within ``s``
        seconds from now, whatever its timeout, retries, waits on a busy daemon and on another
        thread's call on this client would take (DeadlinePassed, not retried); a put or get of many
        chunks included. For a caller with a budget of its own (an engine hook)."""
        return self._conn.until(time.monotonic() + seconds)

    # ------------------------------------------------------------------ data path

    def ping(self) -> dict[str, Any]:
        """The daemon's identity and the round trip in seconds."""
        t0 = time.perf_counter()
        reply = self._call(Ping())
        assert isinstance(reply, Pong)
        return {"server": reply.server, "pid": reply.pid, "rtt": time.perf_counter() - t0}

    def lookup(self, token_ids: TokenInput | Chain) -> LookupResult:
        """How many leading tokens of ``token_ids`` the daemon holds (whole blocks). Changes nothing.

        Every data call takes, in place of token ids, a KeyChain: blocks named by an engine's own
        chained page keys (``lookup_keys``, ``get_into_keys``, ``put_from_keys``)."""
        ns = self._ns()
        with self._held():
            self._conn.ensure_hello()
            return self._socket.lookup(ns, self._names(token_ids))

    def get(self, token_ids: TokenInput | Chain, *, device: torch.device | str = "cpu") -> GetResult:
        """The K/V of the longest stored prefix of ``token_ids``: ``kv`` is ``[L, 2, matched, H, D]`` or None.

        Same host, the blocks are copied or decoded from shared memory into one tensor on ``device``
        (``get_into`` a fresh tensor; a match shorter than the prompt is a view of it). Over the
        socket a prefix longer than one chunk is looked up first, then fetched chunk by chunk. A block
        evicted between the lookup and its read shortens the result to the blocks before it.
        """
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        device = device_arg(device)
        with self._held():
            self._conn.ensure_hello()
            tokens = self._names(token_ids)
            if self._shm.mapping() is not None:
                # host memory is reserved, not touched, until written: no lookup needed to size it,
                # unless the whole prompt's K/V is more than a host could reserve for one result
                total = tokens.blocks(T)
                if device.type != "cpu" or total * layout.block_nbytes > SIZE_BY_LOOKUP:
                    total = self._socket.lookup(ns, tokens).matched_blocks
                if total == 0:
                    return GetResult(0, 0, None, [])
                out = empty_kv(layout.shape(total * T), layout.torch_dtype, device, self._buffers)
                read = self._shm.read_into(ns, tokens, out, total)
                if read is not None:
                    matched, tiers = read
                    if matched == 0:
                        return GetResult(0, 0, None, [])
                    kv = out if matched == total else out[:, :, : matched * T]
                    return GetResult(matched, matched * T, kv, tiers)
            return self._socket.get(ns, tokens, device)

    def get_into(self, token_ids: TokenInput | Chain, out: KVTarget, *, start: int = 0) -> GetResult:
        """Fill ``out`` with the K/V of the longest stored prefix of ``token_ids`` (at most as many
        tokens as ``out`` holds): a tensor ``[L, 2, T, H, D]`` on any device, or a PagedKV (an
        engine's paged buffers and the slots of this sequence's tokens). Returns the match; ``kv`` is
        the filled part of a tensor ``out`` (None for a PagedKV). Tokens past the match may have been
        written and hold nothing meaningful.

        ``start``: the caller holds tokens before it already; they are neither fetched (whole blocks)
        nor written, and the match counts them as held (it is never shorter than the block holding
        ``start``). A tensor ``out`` needs a block-aligned ``start``.

        Same host, the blocks are copied or decoded straight from shared memory into ``out`` (on a GPU
        ``out``, frames cross PCIe compressed and are decoded there); otherwise they come over the
        socket chunk by chunk, each written into ``out`` as it arrives."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        check_target(out, layout, "get_into out", written=True)
        start = start_arg(start)
        if start % T and not isinstance(out, PagedKV):
            raise LayoutError(f"start {start} must be a multiple of {T} for a tensor out")
        first = start // T
        if isinstance(out, PagedKV) and start > out.floor:
            out = out.above(start)
        with self._held():
            self._conn.ensure_hello()
            tokens = self._names(token_ids)
            total = min(tokens.blocks(T), target_tokens(out) // T)
            if total <= first:
                return GetResult(min(first, total), min(first, total) * T, None, [])
            got = self._shm.read_into(ns, tokens, out, total, first)
            if got is None:
                got = self._socket.read_into(ns, tokens, out, total, first)
        matched, tiers = got
        kv = out[:, :, : matched * T] if isinstance(out, torch.Tensor) and matched else None
        return GetResult(matched, matched * T, kv, tiers)

    def put_from(
        self, token_ids: TokenInput | Chain, src: KVTarget, session: str | None = None, *, start: int = 0
    ) -> PutResult:
        """Store the full blocks of ``token_ids`` whose K/V ``src`` holds: a tensor ``[L, 2, T, H, D]``
        on any device, or a PagedKV (an engine's paged buffers and this sequence's slots). Same host,
        the K/V is written once into shared staging and committed; otherwise it goes over the socket.

        ``start``: blocks wholly before it were stored already (an engine saving as it computes);
        they are neither read nor sent. Their parents must be in the store for the rest to match."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        check_target(src, layout, "put_from src")
        names = as_chain(token_ids)
        if isinstance(src, torch.Tensor):  # a PagedKV holds what its slots name: as much is stored
            _covers(src, names, T, "src")
        total = min(names.blocks(T), target_tokens(src) // T)
        first = start_arg(start) // T
        if total <= first:
            return PutResult(0, 0, [])
        with self._held():
            self._conn.ensure_hello()
            tokens = self._names(names.head(total, T))
            done = self._shm.put(ns, tokens, src, total, session, first)
            if done is None:
                done = self._socket.put_from(ns, tokens, src, total, session, first)
            return done

    def put(self, token_ids: TokenInput | Chain, kv: torch.Tensor, session: str | None = None) -> PutResult:
        """Store the full blocks of ``token_ids`` whose K/V ``kv`` (``[L, 2, T, H, D]``) holds: T covers
        every full block of them (LayoutError else), the tokens past the last full block may be absent.

        Returns how many blocks were stored, were already present, and which
        failed and why (block index, code, message). A trailing partial block is
        not stored: the engine recomputes it.
        """
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        names = as_chain(token_ids)
        if not isinstance(kv, torch.Tensor):
            raise LayoutError(f"kv must be a tensor [L, 2, T, H, D], got {type(kv).__name__}")
        check_target(kv, layout, "kv")
        _covers(kv, names, T, "kv")
        total = names.blocks(T)
        if total == 0:
            return PutResult(0, 0, [])
        with self._held():
            self._conn.ensure_hello()
            if self._shm.mapping() is not None:
                return self.put_from(names, kv, session)
            return self._socket.put(ns, self._names(names.head(total, T)), kv, total, session)

    # ------------------------------------------------------------------ engine page keys

    def lookup_keys(self, keys: Sequence[bytes | str], prefix: Sequence[bytes | str] = ()) -> LookupResult:
        """How many leading pages of ``keys`` the daemon holds: an engine's own chained page keys
        (SGLang's page hashes: 64 hex digits or 32 bytes each), one block each, walked from the
        first and stopping at the first miss. ``prefix``: the keys of the pages before them (only the
        last matters, and only to a put: a page's identity is its key). Namespaced like token blocks:
        the same key in another namespace or tenant is another block. Raises InvalidTokens for a
        malformed key. Changes nothing."""
        return self.lookup(KeyChain.of(keys, prefix))

    def get_into_keys(
        self,
        keys: Sequence[bytes | str],
        out: KVTarget,
        prefix: Sequence[bytes | str] = (),
        *,
        start: int = 0,
    ) -> GetResult:
        """``get_into`` for the pages named by ``keys`` (see ``lookup_keys``): block ``i`` of ``out``
        gets page ``keys[i]``, as far as the leading pages are held."""
        return self.get_into(KeyChain.of(keys, prefix), out, start=start)

    def put_from_keys(
        self,
        keys: Sequence[bytes | str],
        src: KVTarget,
        prefix: Sequence[bytes | str] = (),
        session: str | None = None,
        *,
        start: int = 0,
    ) -> PutResult:
        """``put_from`` for the pages named by ``keys`` (see ``lookup_keys``): block ``i`` of ``src`` is
        stored as page ``keys[i]``, the child of page ``keys[i - 1]``, and the first the child of the
        last of ``prefix`` (which must be stored: else the put fails ``missing_parent``) or of the
        namespace root."""
        return self.put_from(KeyChain.of(keys, prefix), src, session, start=start)


def _covers(kv: torch.Tensor, names: Chain, T: int, what: str) -> None:
    """LayoutError unless ``kv`` holds the tokens of every full block ``names`` names: the blocks past
    it would go unstored, and nothing would say so."""
    if kv.shape[2] // T < names.blocks(T):
        raise LayoutError(
            f"{what} holds {kv.shape[2]} tokens, fewer than the {names.blocks(T) * T} of the full blocks "
            f"the {names.tokens_named(T)} token ids name: pass the ids of the tokens {what} holds"
        )
