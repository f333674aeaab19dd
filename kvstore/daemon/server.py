"""The kvstore daemon: a ZeroMQ ROUTER loop in front of the store.

::

    clients (DEALER) ──► ROUTER ─ loop thread ─► ThreadPoolExecutor ─► Handlers ─► Store
                          ▲          ▲  (validate, hello, ping inline)        │
                          └──────────┴──── inproc PULL ◄── PUSH (one per worker) ◄┘

The loop thread owns both sockets and never waits on LMDB or codec work: it
validates frames (ServerProtocol), answers hello and ping itself, answers a
lookup, and a same-host locate of blocks the shared pools hold, itself when
the store's lock is free that instant (``try_lookup``, ``try_locate``: both
read only the in-memory index), hands every other request to a worker, and
forwards replies as workers finish them, out of order, each
carrying its request id. zmq sockets are not thread-safe, so each worker
thread sends its replies through its own inproc PUSH socket.

Authentication: with ``[server] curve_secret_key`` the tcp ROUTER is a CURVE
server; a ZAP handler thread (kvstore.daemon.auth) admits only the keys of
``curve_allowed_keys`` and stamps each connection with its tenant, which the
loop reads from every message and confines the request to (kvstore.daemon.tenancy).

Start-up (``serve``)::

    lock the endpoint (kvstore.daemon.endpoint)      quick; a second daemon is refused here
    bind, answer every request "starting"            clients wait and retry (kvstore.connection)
    build the store on a thread (pools, index)       logged: tier sizes, blocks to read back, progress
    serve                                            logged: elapsed time

SIGTERM/SIGINT: stop accepting (new requests get ``shutting_down``), finish
the requests in flight, flush the write-through queue and close LMDB
(``Store.close``), remove the socket file (if it is still the one bound),
release the endpoint's lock, exit 0. A stop while the store is being built
waits for it to be built, then closes it.

Longer than most modules: the event loop, the worker hand-off and the start/stop sequence
share the sockets this class owns (dispatch.py, budget.py, outbox.py, startup.py and endpoint.py
hold what could go; process.py runs it as the daemon process).
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq

from kvstore.config import Config
from kvstore.daemon.auth import OPERATOR, ServerAuth
from kvstore.daemon.budget import InflightBudget
from kvstore.daemon.dispatch import Dispatch
from kvstore.daemon.endpoint import ipc_path, remove_socket, socket_identity
from kvstore.daemon.handlers import Handlers
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.outbox import SNDHWM, Outbox, Sent
from kvstore.daemon.pin_quota import PinQuota
from kvstore.daemon.startup import Startup
from kvstore.daemon.tenancy import admit
from kvstore.daemon.zap import ZapHandler, peer_tenant
from kvstore.errors import KVStoreError
from kvstore.units import format_bytes
from kvstore.wire.errors import RemoteProtocolError
from kvstore.wire.messages import ErrorReply, Hello, Message, Ping, Pong
from kvstore.wire.protocol import (
    MAX_FRAMES,
    PROTOCOL_VERSION,
    Limits,
    Request,
    ServerProtocol,
    encode,
    nbytes,
    read_header,
    reply_frames,
)

if TYPE_CHECKING:
    from kvstore.results import NamespaceUsage
    from kvstore.shm.plane import SharedPlane
    from kvstore.store.engine import Store

log = logging.getLogger("kvstore.daemon.server")

EXIT_OK, EXIT_REFUSED, EXIT_CONFIG = 0, 1, 2  # (the codes of `kvstore serve`: README, Exit codes)
DRAIN_TIMEOUT = 60.0  # seconds to finish in-flight requests after a stop signal
PROGRESS_EVERY = 5.0  # seconds between "still starting" log lines
POLL_MS = 100  # how soon the loop notices a stop request
HEARTBEAT_MS = 10_000  # how often each connection is pinged (ZMTP heartbeat; clients answer unasked)
HEARTBEAT_TIMEOUT_MS = 60_000  # a connection with no traffic this long after a ping is closed
BATCH = 64  # messages taken from a socket per wake-up, so neither side starves the other


class _LateStore:
    """What metrics read the store through: the store once built; until then a scrape says kvstore_up 0."""

    def __init__(self) -> None:
        self.store: Store | None = None

    def stats(self) -> Any:
        if self.store is None:
            raise KVStoreError("the daemon is starting")
        return self.store.stats()

    def usage(self) -> list[NamespaceUsage]:
        return [] if self.store is None else self.store.usage()


class Server:
    """One daemon instance serving a store on ``config.server.endpoint``. ``run`` blocks until stopped.

    ``store``: the store to serve, or None when ``run`` is to build it (``open_store``) after
    binding; until then every request is answered ``starting``.
    """

    def __init__(
        self,
        config: Config,
        store: Store | None,
        ctx: zmq.Context | None = None,
        *,
        auth: ServerAuth | None = None,
    ) -> None:
        """``auth``: the CURVE keys, loaded from ``config`` when not given (ConfigError if they are bad)."""
        self.config = config
        self.store: Store | None = None
        self.ctx = ctx or zmq.Context()
        cfg = config.server
        # loaded here too, so that a Server built without serve() never listens unauthenticated by mistake
        self.auth = auth or ServerAuth.from_config(cfg.endpoint, cfg.curve_secret_key, cfg.curve_allowed_keys)
        self.limits = Limits(
            max_message_bytes=cfg.max_message_bytes,
            max_tokens=cfg.max_tokens_per_request,
            max_inflight=cfg.max_inflight_per_client,
        )
        self.proto = ServerProtocol(
            self.limits,
            server=f"kvstore/{PROTOCOL_VERSION}",
            namespaces_per_tenant=cfg.max_namespaces_per_tenant,
        )
        self.handlers: Handlers | None = None
        self.plane: SharedPlane | None = None  # set by open_store before the store is attached
        self._offer: dict[str, Any] | None = None
        self.budget = InflightBudget(
            cfg.max_inflight_bytes, cfg.max_inflight_bytes_per_tenant, cfg.max_queued_requests
        )
        self.dispatch = Dispatch(
            self.budget, self.proto, self._submit
        )  # the requests on workers and their charges
        self._workers: ThreadPoolExecutor | None = None
        self._outbox: Outbox | None = None  # the router's, while run() serves
        self._store_ref = _LateStore()
        self.metrics = Metrics(self._store_ref, usage=self._store_ref.usage)
        self.startup: Startup | None = None
        self.exit_code = EXIT_OK
        if store is not None:
            self._attach(store)
        self._stop_reason: str | None = None
        self._local = threading.local()
        self._worker_sockets: list[zmq.Socket] = []
        self._sockets_lock = threading.Lock()
        self._replies = f"inproc://kvstore-replies-{id(self):x}"
        self._started = time.time()
        self.requests = self.errors = 0

    def stop(self, reason: str) -> None:
        """Ask the loop to stop (safe from a signal handler or another thread)."""
        self._stop_reason = self._stop_reason or reason

    def info(self) -> dict[str, Any]:
        """Counters for ``stats`` (read from worker threads; plain ints, so a snapshot is consistent enough)."""
        return {
            "endpoint": self.config.server.endpoint,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "uptime": time.time() - self._started,
            "requests": self.requests,
            "errors": self.errors,
            "inflight": self.dispatch.outstanding,
            "replies_waiting": 0 if self._outbox is None else self._outbox.parked,
            "replies_dropped": 0 if self._outbox is None else self._outbox.dropped,
            "clients": len(self.proto.inflight),
            "namespaces": len(self.proto.namespaces),
            "namespaces_expired": self.proto.expired,
            "workers": self.config.server.workers,
            "limits": self.limits.to_dict(),
            "put_failed_blocks": 0 if self.handlers is None else self.handlers.failed_blocks,
            "shm": None if self.plane is None else self.plane.stats(),
        }

    def _attach(self, store: Store) -> None:
        """Serve ``store`` from now on (loop thread, or before ``run``)."""
        cfg = self.config.server
        self.handlers = Handlers(
            store,
            self.info,
            max_lease=self.config.policy.pin_lease,
            pin_quota=PinQuota(pins=cfg.max_pins_per_tenant, blocks=cfg.max_pinned_blocks_per_tenant),
            plane=self.plane,
        )
        self._offer = None if self.plane is None else self.plane.offer()
        self._store_ref.store = store
        self.store = store
        self.proto.registry.holds = store.holds_namespace  # a registration whose blocks all went can go

    def run(self, open_store: Callable[[], Store] | None = None) -> int:
        """Bind, build the store if there is none yet (``open_store``, on a thread, answering every
        request ``starting`` meanwhile), serve until ``stop``, then drain and close everything.

        Returns the exit code: EXIT_REFUSED when ``open_store`` raised a KVStoreError or OSError
        (logged as a refusal, one line). Raises zmq.ZMQError when the endpoint cannot be bound.
        """
        if self.store is None and open_store is None:
            raise ValueError("a Server built without a store needs open_store")
        router = self.ctx.socket(zmq.ROUTER)
        router.linger = 1000  # let the last replies leave on close
        # a hard cap far above the soft limit: bigger frames cost the peer its connection, smaller
        # ones over max_message_bytes get a too_large reply
        router.setsockopt(zmq.MAXMSGSIZE, 2 * self.limits.max_message_bytes + self.limits.max_header_bytes)
        # a peer that stops answering (a part of a large message sent and nothing more, or gone
        # without a close) is disconnected, and what it held is freed
        router.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        router.setsockopt(zmq.HANDSHAKE_IVL, HEARTBEAT_TIMEOUT_MS)
        self._outbox = Outbox(router, hwm=min(self.limits.max_inflight, SNDHWM))
        pull = self.ctx.socket(zmq.PULL)
        pull.bind(self._replies)
        zap: ZapHandler | None = None
        try:
            if self.auth is not None:  # the ZAP handler is up before the first handshake can start
                self.auth.secure(router)
                zap = self.auth.handler()
                zap.start(self.ctx)
            router.bind(self.config.server.endpoint)
            if re.search(r":(0|\*)$", self.config.server.endpoint):  # "any free port": say which one
                bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self.config = replace(self.config, server=replace(self.config.server, endpoint=bound))
        except BaseException:
            router.close(linger=0)
            pull.close(linger=0)
            if zap is not None:
                zap.stop()
            raise
        path = ipc_path(self.config.server.endpoint)
        identity = None
        if path is not None:
            os.chmod(path, 0o600)
            identity = socket_identity(path)
        workers = ThreadPoolExecutor(
            self.config.server.workers, thread_name_prefix="kvstore-worker", initializer=self._init_worker
        )
        self._workers = workers
        try:
            if self.store is None:
                assert open_store is not None
                self.startup = Startup(self.config, open_store)
                self.startup.begin()
            else:
                self._serving()
            self._loop(router, pull)
        finally:
            workers.shutdown(wait=True)
            self.metrics.stop()
            while self.dispatch.outstanding and self._forward(pull):
                pass
            flush_until = time.monotonic() + 1.0  # replies parked for clients still reading get a moment
            while self._outbox is not None and self._outbox.parked and time.monotonic() < flush_until:
                self._outbox.retry()
                time.sleep(self._outbox.wait(0.01))
            with self._sockets_lock:
                for s in self._worker_sockets:
                    s.close(linger=0)
            pull.close(linger=0)
            router.close()
            if zap is not None:
                zap.stop()
            if path is not None and not remove_socket(path, identity):
                log.warning("%s is no longer the socket this daemon bound; left in place", path)
        return self.exit_code

    def _serving(self) -> None:
        """The store is ready: metrics on, the start logged. Raises KVStoreError for a busy metrics port."""
        metrics_url = self.metrics.start(self.config.server.metrics_port)
        self._log_start(metrics_url)

    def _check_startup(self) -> None:
        """On the loop: attach the store once built, or stop when building it failed."""
        startup = self.startup
        if startup is None or self.handlers is not None:
            return
        startup.progress(PROGRESS_EVERY)
        if not startup.done():
            return
        try:
            store = startup.result()
        except (KVStoreError, OSError) as e:
            log.error("refusing to start: %s", startup.refusal(e))
            self.exit_code = EXIT_REFUSED
            self.stop("start failed")
            return
        except Exception:
            log.exception("refusing to start: building the store failed")
            self.exit_code = EXIT_REFUSED
            self.stop("start failed")
            return
        self._attach(store)
        try:
            self._serving()
        except KVStoreError as e:
            log.error("refusing to start: %s", e)
            self.exit_code = EXIT_REFUSED
            self.stop("start failed")

    def _loop(self, router: zmq.Socket, pull: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        assert self._outbox is not None
        outbox = self._outbox
        mailbox = router.getsockopt(zmq.FD)  # readable when the socket has commands: a pipe with room
        watching = False
        deadline = None
        while True:
            self._check_startup()
            if self._stop_reason is not None and self.startup is not None and not self.startup.done():
                pass  # the store cannot be abandoned half built: wait for it, then close it
            elif self._stop_reason is not None:
                if deadline is None:
                    log.info(
                        "stopping (%s): finishing %d request(s) in flight",
                        self._stop_reason,
                        self.dispatch.outstanding,
                    )
                    deadline = time.monotonic() + DRAIN_TIMEOUT
                if self.dispatch.outstanding == 0:
                    return
                if time.monotonic() > deadline:
                    log.warning(
                        "%d request(s) still running after %.0fs; waiting for them to end",
                        self.dispatch.outstanding,
                        DRAIN_TIMEOUT,
                    )
                    return
            # parked replies are tried when their peer's turn comes (kvstore.daemon.outbox)
            if bool(outbox.parked) != watching:
                watching = not watching
                if watching:
                    poller.register(mailbox, zmq.POLLIN)
                else:
                    poller.unregister(mailbox)
            events = dict(poller.poll(math.ceil(1000 * outbox.wait(POLL_MS / 1000))))
            if outbox.parked:  # before new requests: what leaves frees budget for them
                outbox.retry()
            if pull in events:
                self._forward(pull)
            if router in events:
                for _ in range(BATCH):
                    try:
                        first: Any = router.recv(zmq.NOBLOCK, copy=self.auth is None)  # a Frame has User-Id
                    except zmq.Again:
                        break
                    peer: bytes = first if self.auth is None else first.bytes
                    tenant = None if self.auth is None else peer_tenant(first)
                    frames: list[Any] = []
                    count = size = 0
                    while router.rcvmore:  # the header is small: copied; payloads stay zmq frames
                        frame = router.recv(copy=not frames)
                        count, size = count + 1, size + nbytes(frame)
                        # past what any request holds, frames are taken off the socket and let go:
                        # a message of many frames each under the frame cap holds no more than that
                        if count == 1 or (count <= MAX_FRAMES and size <= self.limits.max_message_bytes):
                            frames.append(frame)
                    try:
                        self._on_request(peer, frames, tenant, (count, size))
                    except Exception as e:  # a bug in our checks must not end the daemon
                        log.exception("a request from %s broke the loop; answering internal", peer.hex())
                        self._answer_broken(peer, frames, e)

    def _on_request(
        self,
        peer: bytes,
        frames: list,
        tenant: str | None = None,
        received: tuple[int, int] | None = None,
    ) -> None:
        """Answer or dispatch one request; ``tenant``: the CURVE identity its connection authenticated as;
        ``received``: (frames, bytes) the message came in (``frames`` may keep fewer: see _loop)."""
        self.requests += 1
        arrived = time.perf_counter()
        before = self.proto.inflight.get(peer, 0)
        try:
            confined = None if self.auth is None or tenant in (None, OPERATOR) else tenant
            request = self.proto.receive(peer, frames, tenant=confined, received=received)
        except RemoteProtocolError as e:
            self.errors += 1
            self.metrics.observe(e.op or "invalid", time.perf_counter() - arrived, e.code)
            log.debug("rejected a request from %s: %s [%s]", peer.hex(), e.message, e.code)
            self._send(peer, self.proto.error(peer, e.request_id, e.code, e.message, done=False))
            return
        except Exception:
            self._uncount(peer, before)
            raise
        try:
            self._answer(peer, frames, tenant, request, arrived)
        except Exception:
            self._uncount(peer, before)
            raise

    def _uncount(self, peer: bytes, before: int) -> None:
        """A request of ``peer`` broke the loop (it is answered by _answer_broken): if it was counted in
        flight and neither answered nor handed to a worker, it is not in flight any more (else its
        client would be refused as busy after a few of these)."""
        if self.proto.inflight.get(peer, 0) > before:
            self.proto.done(peer)

    def _answer(
        self,
        peer: bytes,
        frames: list,
        tenant: str | None,
        request: Request,
        arrived: float,
    ) -> None:
        """Answer ``request`` (received and counted in flight) here, or hand it to a worker."""
        if self.auth is not None:
            request = replace(request, tenant=None if tenant == OPERATOR else tenant)
            denied = None
            if (
                tenant is None
            ):  # never expected (the ZAP handler names every tenant); refuse rather than trust
                denied = ErrorReply(
                    code="forbidden", message="the connection carries no authenticated tenant"
                )
            elif request.tenant is not None:
                denied = admit(request.msg, request.namespace, request.tenant)
            if denied is not None:
                self.errors += 1
                self.metrics.observe_reply(request.msg.op, time.perf_counter() - arrived, denied)
                self._send(peer, self.proto.reply(request, denied))
                return
        reply: Message
        if self._stop_reason is not None:
            reply = ErrorReply(code="shutting_down", message="the daemon is stopping; retry shortly")
        elif self.handlers is None:
            assert self.startup is not None
            reply = ErrorReply(code="starting", message=self.startup.message())
        elif isinstance(request.msg, Hello):
            # shared memory only for a client that asks, on this host's socket, not confined to a tenant
            offer = self._offer if request.msg.shm and request.tenant is None and self.auth is None else None
            reply = self.proto.welcome(request, shm=offer)
        elif isinstance(request.msg, Ping):
            reply = Pong(server=self.proto.server, pid=os.getpid(), time=time.time())
        else:
            inline = self.handlers.try_inline(request)
            if inline is not None:
                reply = inline
            else:  # to a worker, charged until its reply leaves (_forward), or busy
                refusal = self.dispatch.take(peer, request, frames, arrived)
                if refusal is None:
                    return
                reply = ErrorReply(code="busy", message=refusal)  # the frames are let go right here
        out = self.proto.reply(request, reply)
        self.metrics.observe_reply(request.msg.op, time.perf_counter() - arrived, reply)
        if isinstance(reply, ErrorReply) and reply.code != "starting":  # a wait, not a failure:
            self.errors += 1  # clients (and the CLI's readiness probe) ask again
        self._send(peer, out)  # a small reply: copying beats wrapping in zmq.Frames

    def _answer_broken(self, peer: bytes, frames: list, error: Exception) -> None:
        """Answer a request whose handling raised on the loop: with its id when its header can be
        read (the client waits for that id; without it, until its timeout)."""
        rid: int | None = None
        try:
            rid = read_header(frames[0], self.limits.max_header_bytes)[1] if frames else None
        except RemoteProtocolError as e:
            rid = e.request_id
        except Exception:  # unreadable: answered without an id
            pass
        message = f"the daemon failed on this request ({type(error).__name__}: {error}); see its log"
        self.errors += 1
        self.metrics.observe("invalid", 0.0, "internal")  # its op unknown here: counted as other
        try:
            self._send(peer, encode(rid, ErrorReply(code="internal", message=message)))
        except Exception:  # the answer is lost, the daemon is not
            log.exception("answering request %s from %s failed", rid, peer.hex())

    def _init_worker(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(self._replies)
        self._local.push = sock
        with self._sockets_lock:
            self._worker_sockets.append(sock)

    def _submit(self, request: Request, arrived: float, number: int) -> None:
        """Run a request Dispatch took on a worker (RuntimeError once the workers are shut down)."""
        assert self._workers is not None and self.handlers is not None
        self._workers.submit(self._work, self.handlers, request, arrived, number)

    def _work(self, handlers: Handlers, request: Request, arrived: float, charge: int) -> None:
        """Run on a worker thread: exactly one reply goes back for ``request``, whatever happens."""
        try:
            reply = handlers.handle(request)
            frames = reply_frames(request, reply)
            self.metrics.observe_reply(request.msg.op, time.perf_counter() - arrived, reply)
            if isinstance(reply, ErrorReply):
                self.errors += 1
        except BaseException as e:  # noqa: B036 - the reply must go out even then
            log.exception("encoding the reply to request %s failed", request.id)
            frames = encode(request.id, ErrorReply(code="internal", message=f"reply failed: {e}"))
            self.metrics.observe(request.msg.op, time.perf_counter() - arrived, "internal")
            self.errors += 1
        self._local.push.send_multipart([charge.to_bytes(8, "little"), request.peer, *frames], copy=False)

    def _forward(self, pull: zmq.Socket) -> int:
        """Send (or park: kvstore.daemon.outbox) up to BATCH replies workers finished; returns how many."""
        for n in range(BATCH):
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
            number = int.from_bytes(frames[0].bytes, "little")
            peer = frames[1].bytes
            now = self._send(peer, frames[2:], copy=False, sent=self.dispatch.sent(number, peer))
            self.dispatch.answered(number, parked=not now)
        return BATCH

    def _send(self, peer: bytes, frames: list[Any], *, copy: bool = True, sent: Sent | None = None) -> bool:
        """Send a reply now (True) or park it (kvstore.daemon.outbox)."""
        assert self._outbox is not None  # (set by run before the loop starts)
        return self._outbox.send(peer, frames, copy=copy, sent=sent)

    def _log_start(self, metrics_url: str | None) -> None:
        cfg = self.config
        try:
            tiers = ", ".join(
                f"{name} {format_bytes(t.used)} of {format_bytes(t.capacity)} ({t.blocks} blocks)"
                for name, t in self._store_ref.stats().tiers.items()
            )
        except Exception as e:  # logging must not stop the start
            tiers = f"? ({e})"
        log.info(
            "kvstore serving %s (protocol %s, pid %d, %d workers)",
            cfg.server.endpoint,
            PROTOCOL_VERSION,
            os.getpid(),
            cfg.server.workers,
        )
        log.info(
            "tiers: %s; hbm device %s, ram codec %s, nvme %s",
            tiers,
            cfg.hbm.resolved_device(),
            cfg.ram.codec,
            f"{cfg.nvme.path} ({cfg.nvme.codec}, write_through={cfg.nvme.write_through})"
            if cfg.nvme.enabled
            else "off",
        )
        log.info("limits: %s; metrics: %s", self.limits.to_dict(), metrics_url or "off")
        if self.auth is not None:
            tenants = sorted(set(self.auth.allowed.values()))
            log.info(
                "CURVE on: server public key %s; %d client key(s) allowed, tenants %s",
                self.auth.public_key.decode(),
                len(self.auth.allowed),
                ", ".join(tenants) or "none",
            )
