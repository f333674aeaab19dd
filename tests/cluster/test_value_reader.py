"""Values read off a node's socket into memory of their own (``by_node(..., values=True)``): against the
real cluster, and byte by byte against a socket pair where a node's misbehaviour has to be staged."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError, InvalidResponse, ResponseError, TimeoutError

from kvstore.tiers.cluster_client import by_node, open_client
from kvstore.tiers.cluster_format import ClusterNodes
from kvstore.tiers.cluster_values import HEAD_READ, Received, ValueReader
from tests.cluster.rediscluster import LocalCluster

SIZES = [0, 1, 100, HEAD_READ - 1, HEAD_READ, HEAD_READ + 5, 3 * 2**20 + 7]


@pytest.fixture
def filled(rc: LocalCluster) -> Iterator[tuple[RedisCluster, list[str], list[bytes | None]]]:
    """kvstore's client of the cluster, and keys on every master holding values of every size
    (around the header buffer's, and larger than a socket read), with absent keys between them."""
    client = open_client(ClusterNodes.parse(rc.urls, None, None), 2.0)
    names, values = [], []
    for i in range(4 * len(SIZES)):
        name = f"kvstore:test:{i}"
        value = os.urandom(SIZES[i % len(SIZES)]) if i % 4 != 3 else None
        if value is not None:
            client.set(name, value)
        names.append(name)
        values.append(value)
    assert len({rc.master_of(n) for n in names}) == 3
    yield client, names, values
    client.close()


def test_values_come_whole_in_memory_of_their_own_and_connections_stay_in_step(
    filled: tuple[RedisCluster, list[str], list[bytes | None]],
) -> None:
    client, names, values = filled
    got: list[memoryview | None] = []
    for command in (("GET",), ("GETEX", "PX", 60_000)):
        answers = by_node(client, [(command[0], n, *command[1:]) for n in names], values=True)
        assert answers is not None
        got = answers
        assert [None if v is None else bytes(v) for v in got] == values
        assert all(isinstance(v, memoryview) for v in got if v is not None)
    # each value owns its memory: one changed leaves the others and the next read alone
    first = next(v for v in got if v is not None and len(v))
    first[0] ^= 0xFF
    again = by_node(client, [("GET", n) for n in names], values=True)
    assert again is not None and [None if v is None else bytes(v) for v in again] == values
    # the connections went back with nothing left unread: the next answers are the right ones
    assert by_node(client, [("EXISTS", n) for n in names]) == [int(v is not None) for v in values]
    assert client.get(names[-2]) == values[-2]


def test_a_redirection_among_values_sends_the_read_to_the_pipeline_and_leaves_no_answer_unread(
    filled: tuple[RedisCluster, list[str], list[bytes | None]],
) -> None:
    client, names, values = filled
    manager = client.nodes_manager
    big = next(i for i, v in enumerate(values) if v is not None and len(v) > HEAD_READ)
    slot = client.keyslot(names[big])
    right = manager.slots_cache[slot][0]
    wrong = next(
        n for n in manager.nodes_cache.values() if n.server_type == "primary" and n.name != right.name
    )
    manager.slots_cache[slot] = [wrong]  # the map still names the old master, which answers MOVED
    assert by_node(client, [("GET", n) for n in names], values=True) is None
    manager.slots_cache[slot] = [right]
    got = by_node(client, [("GET", n) for n in names], values=True)
    assert got is not None and [None if v is None else bytes(v) for v in got] == values
    assert by_node(client, [("EXISTS", n) for n in names]) == [int(v is not None) for v in values]


def test_a_resp3_client_is_read_through_redis_py(
    rc: LocalCluster, filled: tuple[RedisCluster, list[str], list[bytes | None]]
) -> None:
    _, names, values = filled
    seeds = [ClusterNode("127.0.0.1", port) for port in rc.ports]  # some may be down after a failover test
    resp3 = RedisCluster(startup_nodes=seeds, protocol=3)
    try:
        got = by_node(resp3, [("GET", n) for n in names], values=True)
        assert got == values and all(isinstance(v, bytes) for v in got if v is not None)
    finally:
        resp3.close()


class Node:
    """One end of a socket pair standing for a node: ``send`` writes there, in pieces if asked."""

    def __init__(self, timeout: float = 2.0) -> None:
        self.ours, self.node = socket.socketpair()
        self.ours.settimeout(timeout)
        self.reader = ValueReader(self.ours)

    def send(self, data: bytes, piece: int | None = None) -> threading.Thread:
        def run() -> None:
            for at in range(0, len(data), piece or len(data) or 1):
                self.node.sendall(data[at : at + (piece or len(data))])
                if piece:
                    time.sleep(0.0005)  # a read apiece

        t = threading.Thread(target=run)
        t.start()
        return t

    def close(self) -> None:
        self.ours.close()
        self.node.close()


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def test_answers_split_anywhere_are_read_whole(node: Node) -> None:
    big = os.urandom(HEAD_READ * 3 + 11)
    answers = b"$5\r\nhello\r\n$-1\r\n-MOVED 12 127.0.0.1:7000\r\n$0\r\n\r\n$%d\r\n%s\r\n$2\r\nok\r\n" % (
        len(big),
        big,
    )
    for piece in (4097, HEAD_READ + 3, None):  # headers and values split across reads, and not
        t = node.send(answers, piece)
        got = [node.reader.reply() for _ in range(6)]
        t.join()
        node.reader.finish()
        assert [bytes(v) if isinstance(v, memoryview) else v for v in got[:2]] == [b"hello", None]
        assert isinstance(got[2], ResponseError) and "MOVED" in str(got[2])
        assert [bytes(v) for v in got[3:]] == [b"", big, b"ok"]  # type: ignore[arg-type]


def test_small_answers_byte_by_byte(node: Node) -> None:
    t = node.send(b"$3\r\nabc\r\n$-1\r\n$1\r\nz\r\n", piece=1)
    got = [node.reader.reply() for _ in range(3)]
    t.join()
    node.reader.finish()
    assert [None if v is None else bytes(v) for v in got] == [b"abc", None, b"z"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"+OK\r\n", "no value"),
        (b":1\r\n", "no value"),
        (b"$abc\r\n", "no value"),
        (b"$3\r\nabcX\r\n", "does not end where its length says"),
        (b"$" + b"9" * 40_000, "runs on"),
    ],
)
def test_an_answer_that_is_no_value_is_refused(node: Node, answer: bytes, says: str) -> None:
    node.send(answer).join()
    with pytest.raises(InvalidResponse, match=says):
        node.reader.reply()


def test_more_than_was_asked_for_is_refused(node: Node) -> None:
    node.send(b"$1\r\na\r\n$1\r\nb\r\n").join()
    time.sleep(0.05)
    assert bytes(node.reader.reply()) == b"a"  # type: ignore[arg-type]
    with pytest.raises(InvalidResponse, match="more than"):
        node.reader.finish()


def test_a_node_that_stops_mid_value_times_out_and_one_that_closes_is_a_connection_error() -> None:
    slow = Node(timeout=0.2)
    try:
        slow.send(b"$100\r\n" + b"x" * 40).join()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            slow.reader.reply()
        assert time.monotonic() - t0 < 2.0
    finally:
        slow.close()
    gone = Node()
    try:
        gone.send(b"$100\r\n" + b"x" * 40).join()
        gone.node.close()
        with pytest.raises(ConnectionError, match="closed"):
            gone.reader.reply()
    finally:
        gone.ours.close()


def test_a_node_that_trickles_its_answer_times_out_at_the_reads_deadline() -> None:
    """Each piece within the socket's time-out (0.5 s), the whole answer never: the read ends at its
    deadline (1 s), not after as many time-outs as the node has pieces; the socket's own time-out is
    the connection's again after each receive."""
    slow = Node(timeout=0.5)
    stop = threading.Event()

    def trickle() -> None:
        slow.node.sendall(b"$1000\r\n")
        while not stop.wait(0.2):
            try:
                slow.node.sendall(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle)
    t.start()
    try:
        reader = ValueReader(slow.ours, deadline=time.monotonic() + 1.0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.reply()
        assert 0.8 < time.monotonic() - t0 < 1.6
        assert slow.ours.gettimeout() == 0.5
    finally:
        stop.set()
        t.join()
        slow.close()


def test_a_value_longer_than_its_tail_has_its_last_bytes_received_into_it(node: Node) -> None:
    big = os.urandom(HEAD_READ * 2 + 9)
    answers = b"$%d\r\n%s\r\n$4\r\nabcd\r\n$6\r\nheader\r\n$-1\r\n" % (len(big), big)
    tails = [memoryview(bytearray(HEAD_READ + 1)), memoryview(bytearray(8)), memoryview(bytearray(2)), None]
    t = node.send(answers, 4097)
    got = [node.reader.reply(tail) for tail in (*tails[:3], memoryview(bytearray(4)))]
    t.join()
    node.reader.finish()
    first, short, cut, absent = got
    assert isinstance(first, Received) and first.tail.obj is tails[0].obj  # type: ignore[union-attr]
    assert bytes(first.head) == big[: -(HEAD_READ + 1)] and bytes(tails[0]) == big[-(HEAD_READ + 1) :]  # type: ignore[arg-type]
    assert bytes(first.joined()) == big
    assert isinstance(short, memoryview) and bytes(short) == b"abcd"  # no longer than its tail: whole
    assert isinstance(cut, Received) and (bytes(cut.head), bytes(cut.tail)) == (b"head", b"er")
    assert absent is None
