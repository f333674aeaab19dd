"""The redis-py client of the cluster tier, and why a call to it failed, in words an operator acts on.

``open_client(nodes, timeout)`` builds a ``RedisCluster`` over the seed nodes. When
no seed gives it the topology, redis-py reports only the *last* seed's error:
with seeds ``[a, b, dead]`` and a wrong password, that is "connection refused"
from ``dead``, hiding the refusal that ``a`` and ``b`` gave. So on that failure
each seed is asked once on its own and the most telling error is raised
instead::

    credentials refused  >  TLS not trusted  >  other errors  >  time-out  >  connection refused

``reason(err)`` is the one line that goes to the log and to ``stats``.

``by_node(client, commands)`` sends single-key reads straight to the nodes: grouped by the master
of each key's slot, written to every node before any answer is read (one round trip in all, as
redis-py's ClusterPipeline does), for a third of the pipeline's Python work per command (32
EXISTS: 1.0 ms instead of 2.5 ms on loopback). A lookup that the cluster answers is one such round
trip, and an engine asks one on every request.

``by_node(..., values=True)`` (GETEX answers: the blocks a read fetches) reads each value off the
socket itself (cluster_values.py), into memory of its own: 32 values of 1.47 MB from 3 nodes on
loopback (tests/cluster/rediscluster.py) took 13.5 ms and 10.0 ms of CPU through hiredis, 10.1 ms
and 6.0 ms of CPU so, which leaves the daemon's cores to checking the frames. ``tails``: a value's
last bytes go straight into the caller's memory (where its block goes: kvstore/store/cluster_reads.py).
A connection in RESP3, or one whose socket redis-py does not expose, is read through redis-py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.tiers.cluster_format import ClusterNodes
from kvstore.tiers.cluster_values import ValueReader, raw_socket

# bytes a connection reads from its socket at a time (redis-py's default: 64 KiB): a block's value is
# ~0.4-1.5 MB, and each read is a trip through redis-py's Python and hiredis's buffer; 32 values of
# 1.5 MB from one node on loopback: 54 ms at 64 KiB a read, 33-35 ms at 1 MiB (4 MiB: no faster).
# Each connection holds a buffer this size.
READ_SIZE = 1 << 20


class ClusterUnavailable(KVStoreError):
    """The cluster cannot be reached or refused the credentials (the message says which)."""

    code = "cluster_unavailable"


def open_client(nodes: ClusterNodes, timeout: float) -> Any:
    """A redis-py RedisCluster over ``nodes``, connected: one try per call, so a call costs at most
    ``timeout`` (the tier retries later by itself, on a fresh client that reads the topology anew).
    Raises redis-py's error, or the most telling seed's error when no seed could be used."""
    try:
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.exceptions import RedisClusterException
        from redis.retry import Retry
    except ImportError:  # pragma: no cover - a dependency of kvstore[cluster]
        raise ClusterUnavailable(
            "the cluster tier needs redis-py: pip install 'kvstore[cluster]' (or redis>=5.3)"
        ) from None
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in nodes.hosts],
            retry=Retry(NoBackoff(), 0),  # one try: a failure marks the tier down, a new client reconnects
            require_full_coverage=False,
            **_connection_kwargs(nodes, timeout),
        )
    except RedisClusterException as e:
        if len(nodes.hosts) < 2 or "cannot be connected" not in str(e):
            raise
        raise _most_telling(_seed_errors(nodes, timeout)) or e from None


def by_node(
    client: Any,
    commands: Sequence[tuple[Any, ...]],
    *,
    values: bool = False,
    tails: Sequence[memoryview | None] = (),
    deadline: float | None = None,
) -> list[Any] | None:
    """The answers to ``commands`` (each ``(NAME, key, *args)``: a command on one key), in order, in one
    round trip: the commands grouped by the master of each key's slot in ``client``'s map, written to
    every node before any answer is read. None: ``client`` is not a RedisCluster, its map names no
    node for a slot, or a node answered with a redirection (a slot moved under a resharding or a
    failover, ``redirected``): ask again through ``client.pipeline()``, which follows redirections
    and reads the topology anew. Another error answer (WRONGTYPE) is that command's answer.
    A connection error or time-out is raised as redis-py raises it (the tier is down).

    ``values``: every command answers a value or nil (GET, GETEX); each value comes as a memoryview
    of memory of its own, read off the socket directly (the module says why). ``tails[i]`` (a
    writable byte view, or None): a value of command ``i`` longer than it comes as ``Received``, its
    last bytes received into it (a block's payload straight into the block's place); the memory
    may be written whatever the answer (a shorter value, nil, an error, a failure). ``deadline``
    (time.monotonic()): values not all read by then raise redis-py's TimeoutError.

    A connection goes back to its pool only with every answer sent on it read, or disconnected:
    one left with an answer unread would hand that answer to the next command sent on it."""
    from redis.cluster import RedisCluster
    from redis.exceptions import ResponseError

    if not isinstance(client, RedisCluster) or not commands:
        return None
    manager = client.nodes_manager

    groups: dict[str, tuple[Any, list[int]]] = {}
    try:
        for i, command in enumerate(commands):
            node = manager.get_node_from_slot(client.keyslot(command[1]))
            groups.setdefault(node.name, (node, []))[1].append(i)
        # every node's pool before anything is sent (a node the map learnt from a redirection has none yet)
        plan = [
            (client.get_redis_connection(node).connection_pool, indices) for node, indices in groups.values()
        ]
    except Exception:  # noqa: BLE001 - a slot no node covers, a node not reachable: the cluster pipeline says why
        return None
    out: list[Any] = [None] * len(commands)
    taken: list[tuple[Any, Any, list[int]]] = []  # (pool, connection, indices) per node
    moved = False
    try:
        for pool, indices in plan:
            conn = pool.get_connection()
            taken.append((pool, conn, indices))
            conn.send_packed_command(conn.pack_commands([commands[i] for i in indices]), check_health=False)
        for _, conn, indices in taken:
            sock = raw_socket(conn) if values else None
            if sock is not None:
                reader = ValueReader(sock, deadline)
                for i in indices:
                    answer = reader.reply(tails[i] if i < len(tails) else None)
                    if isinstance(answer, ResponseError) and redirected(answer):
                        moved = True
                    else:
                        out[i] = answer  # another error (WRONGTYPE): the caller's to judge
                reader.finish()
                continue
            for i in indices:  # every answer is read, errors too: the connection stays in step
                try:
                    out[i] = conn.read_response()
                except ResponseError as err:
                    if redirected(err):
                        moved = True
                    else:
                        out[i] = err
    except BaseException:
        for _, conn, _ in taken:  # answers may be left unread on them
            conn.disconnect()
        raise
    finally:
        for pool, conn, _ in taken:
            pool.release(conn)
    return None if moved else out


def redirected(err: Exception) -> bool:
    """Whether an error answer says to ask elsewhere or later (a slot moved or moving, a node not
    ready): asked again through redis-py, which follows these. Other errors answer the command."""
    from redis.exceptions import AskError, ClusterDownError, MasterDownError, MovedError, TryAgainError

    if isinstance(err, (AskError, ClusterDownError, MasterDownError, MovedError, TryAgainError)):
        return True
    word = str(err).split(" ", 1)[0]
    return word in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "LOADING")


def wrong_type(answer: Any) -> bool:
    """Whether ``answer`` is Redis's refusal to read a key holding another type (not a string)."""
    return isinstance(answer, Exception) and str(answer).startswith("WRONGTYPE")


def _connection_kwargs(nodes: ClusterNodes, timeout: float) -> dict[str, Any]:
    """What every connection to a node takes: the credentials, TLS and the time-outs."""
    return {
        "username": nodes.username,
        "password": nodes.password,
        "ssl": nodes.tls,
        "ssl_ca_certs": nodes.tls_files.ca,
        "ssl_certfile": nodes.tls_files.cert,
        "ssl_keyfile": nodes.tls_files.key,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "socket_read_size": READ_SIZE,
        # RESP2, said outright (redis-py 8 asks for RESP3 by default): what the value reader reads, and
        # no pushes from the server between the answers (nothing here uses RESP3's additions)
        "protocol": 2,
    }


def _seed_errors(nodes: ClusterNodes, timeout: float) -> list[Exception]:
    """Each seed's error on a plain PING with the tier's credentials and time-out (a seed that answers
    gives none). One try per seed (no retry, no backoff), all seeds at once: this costs about one
    time-out in all, however many seeds there are; a seed still not done by then counts as timed out."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # a PING reads no value: redis.Redis before redis-py 8 takes no socket_read_size (TypeError)
    kw = {k: v for k, v in _connection_kwargs(nodes, timeout).items() if k != "socket_read_size"}

    def ping(host: str, port: int) -> Exception | None:
        node = redis.Redis(host, port, retry=Retry(NoBackoff(), 0), **kw)
        try:
            node.ping()
        except Exception as e:  # noqa: BLE001 - every kind is ranked below
            return e
        finally:
            node.close()
        return None

    pool = ThreadPoolExecutor(len(nodes.hosts), thread_name_prefix="kvstore-cluster-seed")
    try:
        jobs = [pool.submit(ping, h, p) for h, p in nodes.hosts]
        # connect, then the answer to PING (and AUTH): each bounded by the time-out
        done, _ = wait(jobs, timeout=2 * timeout + 0.1)
        errors: list[Exception] = []
        for job, (host, port) in zip(jobs, nodes.hosts, strict=True):
            err = job.result() if job in done else TimeoutError(f"{host}:{port} did not answer in time")
            if err is not None:
                errors.append(err)
        return errors
    finally:
        pool.shutdown(wait=False)


def _most_telling(errors: list[Exception]) -> Exception | None:
    """The error a person can act on first (see the module's table); None for none."""

    def rank(e: Exception) -> int:
        r = reason(e)
        if r.startswith("the cluster refused the credentials"):
            return 0
        if r.startswith("the nodes' TLS certificate"):
            return 1
        if r.startswith("no answer within"):
            return 3
        if "Connection refused" in r or "Error 111" in r:
            return 4
        return 2

    return min(errors, key=rank, default=None)


def reason(err: Exception) -> str:
    """One line a person can act on, for the log and ``stats`` (never a password: redis-py's messages
    carry none)."""
    name = type(err).__name__
    text = str(err).splitlines()[0] if str(err) else ""
    if any(w in text for w in ("WRONGPASS", "NOAUTH", "username-password", "Authentication required")) or (
        name == "AuthenticationError"
    ):
        return "the cluster refused the credentials (check [cluster] username and password)"
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        return f"the nodes' TLS certificate is not trusted (set [cluster] tls_ca_file): {text}"
    if name in ("TimeoutError", "timeout"):
        return f"no answer within the time-out ({text or name})"
    return f"{name}: {text}" if text else name


def out_of_memory(result: object) -> bool:
    """A write refused because the node is at its ``maxmemory``."""
    return isinstance(result, Exception) and (
        type(result).__name__ == "OutOfMemoryError" or "OOM" in str(result) or "maxmemory" in str(result)
    )


def ttl_ms(seconds: float) -> int | None:
    """A TTL in milliseconds, as SET PX and PEXPIRE take it; None for no expiry (``ttl = "never"``)."""
    return None if math.isinf(seconds) else max(1, int(seconds * 1000))
