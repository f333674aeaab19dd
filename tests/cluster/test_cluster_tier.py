"""The cluster tier on its own, against a real Redis Cluster: values, TTLs, sessions, faults."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError, FrameError
from kvstore.record import BlockRecord
from kvstore.store.cluster_admin import cluster_from_config
from kvstore.tiers.cluster import MARK_TTL_NEVER, ClusterUnavailable
from kvstore.tiers.cluster_client import by_node, open_client
from kvstore.tiers.cluster_format import ClusterNodes, TlsFiles, pack_value, record_of, unpack_value
from tests.cluster.conftest import ClusterFactory
from tests.cluster.rediscluster import LocalCluster

NS = "ns-1"
PARENT = b"p" * 32


def rec(i: int, parent: bytes = PARENT, ns: str = NS) -> BlockRecord:
    return BlockRecord(key=bytes([i]) * 32, parent=parent, namespace=ns, position=i, tokens=b"\x01\0\0\0" * 4)


def test_a_value_is_served_only_under_its_own_key_namespace_and_parent() -> None:
    r = rec(1)
    value = pack_value(r, b"frame-bytes")
    got, frame = unpack_value(r.key, value, NS, PARENT)
    assert got == r and bytes(frame) == b"frame-bytes"
    assert record_of(r.key, value) == r
    with pytest.raises(FrameError, match="names block"):
        unpack_value(b"\x02" * 32, value, NS, PARENT)  # copied under another key
    with pytest.raises(FrameError, match="another prefix or namespace"):
        unpack_value(r.key, value, "ns-2", PARENT)
    with pytest.raises(FrameError, match="another prefix or namespace"):
        unpack_value(r.key, value, NS, b"q" * 32)
    with pytest.raises(FrameError):
        unpack_value(r.key, value[:20], NS, PARENT)
    with pytest.raises(FrameError):
        unpack_value(r.key, b"XXXX" + value[4:], NS, PARENT)
    assert record_of(b"\x02" * 32, value) is None


def test_node_urls_are_checked_and_secrets_never_shown() -> None:
    n = ClusterNodes.parse(["redis://app:s3cret@cache-1:7000", "redis://cache-2"], None, None)
    assert n.hosts == (("cache-1", 7000), ("cache-2", 6379)) and not n.tls
    assert (n.username, n.password) == ("app", "s3cret")
    assert "s3cret" not in n.describe()
    assert ClusterNodes.parse(["rediss://h:1"], "u", "p").tls
    with pytest.raises(ConfigError, match="not a cluster node"):
        ClusterNodes.parse(["http://h:1"], None, None)
    with pytest.raises(ConfigError, match="mix of TLS"):
        ClusterNodes.parse(["rediss://h:1", "redis://h:2"], None, None)


@pytest.mark.parametrize("port", ["7000x", "70000", "0"])
def test_a_node_port_that_is_no_port_is_a_config_error(tmp_path: Path, port: str) -> None:
    with pytest.raises(ConfigError, match=f"'redis://:\\*\\*\\*@cache-1:{port}' has a port that is not"):
        ClusterNodes.parse([f"redis://:pw@cache-1:{port}"], None, None)
    path = tmp_path / "kvstore.toml"
    path.write_text(f'[cluster]\nenabled = true\nnodes = ["redis://cache-1:{port}"]\n')
    with pytest.raises(ConfigError, match=r"\[cluster\] nodes = .* has a port that is not a number"):
        load_config(path, env={})  # at load, before anything starts


@pytest.mark.parametrize(
    "body",
    [
        'nodes = ["redis://:s3cret-pw@cache-1:7000", "cache-2:7000"]',  # the second has no scheme
        'nodes = "redis://app:s3cret-pw@cache-1:7000,cache-2"',
        'nodes = ["redis://cache-1:7000"]\npassword = 83129471',  # not a string
        'nodes = ["default:s3cret-pw@cache-1:7000"]',  # no scheme at all
        'nodes = "redis://u:s3cret-pw@h:1;redis://u:s3cret-pw@h:2"',  # one string, two URLs
        'nodes = ["redis://u:s3cret-pw:more@h:x"]',  # a password with a colon in it
    ],
)
def test_a_cluster_config_error_never_shows_the_password(tmp_path: Path, body: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(f"[cluster]\nenabled = true\n{body}\n")
    with pytest.raises(ConfigError, match=r"\[cluster\]") as err:
        load_config(path, env={})
    assert "s3cret-pw" not in str(err.value) and "83129471" not in str(err.value)
    assert "***" in str(err.value)


def test_blocks_round_trip_with_a_ttl_refreshed_on_read(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    c = cluster_tier(ttl=60.0)
    c.connect()
    items = [(rec(i).key, pack_value(rec(i), bytes([i]) * 100)) for i in range(5)]
    assert c.store(items) == 5
    keys = [k for k, _ in items]
    assert c.leading(keys) == 5
    assert c.leading([keys[0], b"\x09" * 32, keys[2]]) == 1  # stops at the first block the cluster lacks
    node = rc.node(rc.master_of(c.block_key(keys[0])))
    ttl = node.pttl(c.block_key(keys[0]))
    assert 0 < ttl <= 60_000
    node.pexpire(c.block_key(keys[0]), 5_000)
    assert c.fetch(keys[:1] + [b"\x09" * 32]) == [items[0][1], None]
    assert node.pttl(c.block_key(keys[0])) > 50_000  # the read refreshed it
    assert c.delete(keys[:2], mark=True) == 2 and c.leading(keys) == 0
    assert c.delete(keys[2:3]) == 1  # (a damaged value: deleted unmarked)
    # the key names a block by its hash alone: no token id, no session name in the clear
    assert all(k[:10] in (b"kvstore:b:", b"kvstore:e:") and len(k) == 10 + 64 for k in rc.keys())
    # each block an evict deleted left a mark that lives as long as a block would
    assert c.evicted(keys[:4]) == [True, True, False, False]
    mark = c.evicted_key(keys[0])
    assert 50_000 < rc.node(rc.master_of(mark)).pttl(mark) <= 60_000
    # a block written back leaves the mark alone; one written afresh clears it
    assert c.store(items[1:2], again=True) == 1 and c.evicted(keys[:2]) == [True, True]
    assert c.store(items[:1]) == 1 and c.evicted(keys[:2]) == [False, True]


def test_a_ttl_of_never_writes_and_reads_values_that_do_not_expire(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    """``ttl = "never"`` (infinity): no expiry on write; a read leaves none, and takes away one a
    finite ttl left (the value now lives as long as one written now)."""
    c = cluster_tier(ttl=float("inf"))
    c.connect()
    items = [(rec(i).key, pack_value(rec(i), bytes([i]) * 100)) for i in range(3)]
    assert c.store(items) == 3
    keys = [k for k, _ in items]
    node = rc.node(rc.master_of(c.block_key(keys[0])))
    assert node.pttl(c.block_key(keys[0])) == -1
    node.pexpire(c.block_key(keys[0]), 50_000)
    assert c.fetch(keys) == [v for _, v in items]
    assert node.pttl(c.block_key(keys[0])) == -1
    c.put_session("s", {"ns": "x"})
    assert c.get_session("s") is not None
    # an evict's marks expire all the same (else they would pile up for good)
    assert c.delete(keys[:1], mark=True) == 1
    mark = c.evicted_key(keys[0])
    assert 0 < rc.node(rc.master_of(mark)).pttl(mark) <= MARK_TTL_NEVER * 1000


def test_reads_go_straight_to_the_nodes_and_a_moved_slot_falls_back_to_the_cluster_pipeline(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    c = cluster_tier()
    c.connect()
    items = [(rec(i).key, pack_value(rec(i), bytes([i]) * 100)) for i in range(12)]
    assert c.store(items[:8]) == 8
    keys = [k for k, _ in items]
    client = c._call("test", lambda cl: cl)
    pipelines: list[dict[str, Any]] = []
    pipeline = client.pipeline

    def counted(**kw: Any) -> Any:  # counts the fallbacks to redis-py's cluster pipeline
        pipelines.append(kw)
        return pipeline(**kw)

    client.pipeline = counted
    names = [c.block_key(k) for k in keys]
    assert len({rc.master_of(n) for n in names}) == 3  # every master holds some of them
    assert by_node(client, [("EXISTS", n) for n in names]) == [1] * 8 + [0] * 4
    assert c.leading(keys) == 8 and c.fetch(keys[7:9]) == [items[7][1], None]
    assert not pipelines  # reads went straight to the nodes
    # a node the client's map has no connection for yet (learnt from a redirection): one is made
    # before anything is sent, and every connection stays in step (no answer left for the next call)
    manager = client.nodes_manager
    primaries = [n for n in manager.nodes_cache.values() if n.server_type == "primary"]
    primaries[-1].redis_connection = None
    assert by_node(client, [("GET", n) for n in names]) == [v for _, v in items[:8]] + [None] * 4
    assert by_node(client, [("EXISTS", n) for n in names]) == [1] * 8 + [0] * 4
    # a slot that moved (resharding, failover) while the client's map still names the old master:
    # that node answers MOVED, the read is asked again through redis-py's pipeline, which follows
    # the redirection and mends the map, and the next reads go straight to the right node again
    slot = client.keyslot(names[0])
    right = manager.slots_cache[slot][0]
    manager.slots_cache[slot] = [next(n for n in primaries if n.name != right.name)]
    assert by_node(client, [("EXISTS", names[0])]) is None
    assert c.leading(keys) == 8 and len(pipelines) == 1
    assert c.fetch(keys[:1]) == [items[0][1]]
    assert manager.slots_cache[slot][0].name == right.name and len(pipelines) == 1
    assert c.counters.errors == 0 and c.state == "up"


def test_records_read_the_record_and_not_the_frame(rc: LocalCluster, cluster_tier: ClusterFactory) -> None:
    c = cluster_tier()
    c.connect()
    long = BlockRecord(key=b"L" * 32, parent=PARENT, namespace=NS, position=0, tokens=b"\x07\0\0\0" * 2048)
    frame = bytes(range(256)) * 400  # 100 KB
    c.store([(rec(1).key, pack_value(rec(1), frame)), (long.key, pack_value(long, frame))])
    short, whole, absent = c.records([rec(1).key, long.key, b"\x09" * 32])
    assert short is not None and len(short) < 5000 and record_of(rec(1).key, short) == rec(1)
    assert whole is not None and record_of(long.key, whole) == long  # longer than the first read: read again
    assert absent is None
    assert c.records([]) == []


def test_sessions_can_be_visited_without_keeping_them(rc: LocalCluster, cluster_tier: ClusterFactory) -> None:
    c = cluster_tier()
    c.connect()
    for i in range(600):  # more than one batch
        c.put_session(f"conv-{i}", {"keys": b"k" * 32, "tokens": None})
    seen: list[str] = []
    assert c.sessions(lambda d: seen.append(d["name"])) == []
    assert sorted(seen) == sorted(f"conv-{i}" for i in range(600)) and len(c.sessions()) == 600


def test_sessions_are_recorded_under_the_hash_of_their_name(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    c = cluster_tier()
    c.connect()
    c.put_session("tenant-a/conv-42", {"keys": b"k" * 64, "tokens": None})
    assert c.get_session("tenant-a/conv-42")["keys"] == b"k" * 64  # type: ignore[index]
    assert c.get_session("tenant-a/conv-43") is None
    assert not any(b"conv-42" in k for k in rc.keys())
    assert c.drop_session("tenant-a/conv-42") and c.get_session("tenant-a/conv-42") is None


def test_a_record_written_late_does_not_replace_a_later_turn_s(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    # host A's record of turn 1 waited behind its blocks; host B's of turn 2 was written first (and
    # B's clock may run behind A's: no time decides it, the block keys do)
    a, b = cluster_tier(), cluster_tier()
    a.connect()
    b.connect()
    turn: dict[int, dict[str, Any]] = {1: {"ns": {}, "keys": b"k" * 64, "tokens": None, "updated": 100.0}}
    turn[2] = {**turn[1], "keys": b"k" * 96, "updated": 50.0}
    assert b.put_session("conv", turn[2])
    assert a.put_session("conv", turn[1])  # nothing refused: a later turn is there
    assert a.get_session("conv")["keys"] == b"k" * 96  # type: ignore[index]
    # a put that goes another way (a turn taken back and answered anew) replaces it
    assert a.put_session("conv", {**turn[1], "keys": b"k" * 64 + b"x" * 32})
    assert b.get_session("conv")["keys"] == b"k" * 64 + b"x" * 32  # type: ignore[index]
    assert b.put_session("conv", turn[2])  # and so does the same length, or the later turn
    assert a.get_session("conv")["keys"] == b"k" * 96  # type: ignore[index]


def test_values_of_another_type_under_session_keys_are_no_outage(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    """Something not kvstore wrote a list under a session's key and a hash under the sorted set of
    sessions: each session call goes on (those are no records; the set is made anew), the tier stays
    up, and nothing else is lost."""
    c = cluster_tier()
    c.connect()
    assert c.put_session("kept", {"keys": b"k" * 32, "tokens": None})
    key, index = c.session_key("odd"), c.sessions_key()
    rc.node(rc.master_of(key)).rpush(key, "not a record")
    assert c.get_session("odd") is None
    assert c.put_session("odd", {"keys": b"o" * 32, "tokens": None})  # written over it
    assert c.get_session("odd")["keys"] == b"o" * 32  # type: ignore[index]
    node = rc.node(rc.master_of(index))
    node.delete(index)
    node.hset(index, "f", "v")
    assert [d["name"] for d in c.sessions()] == []  # the set is no set: nothing listed, no outage
    assert c.put_session("new", {"keys": b"n" * 32, "tokens": None})  # the set made anew
    c.refresh_sessions(["new"])
    assert [d["name"] for d in c.sessions()] == ["new"] and c.get_session("kept") is not None
    other, listed = c.session_key("other"), c.session_key("a list")
    rc.node(rc.master_of(other)).set(other, b"x")  # a string, not a record: read as none
    rc.node(rc.master_of(listed)).rpush(listed, "x")  # another type: read as none too
    node.zadd(index, {other: time.time() + 60, listed: time.time() + 60})
    assert [d["name"] for d in c.sessions()] == ["new"]
    node.delete(index)
    node.sadd(index, "x")
    assert c.drop_session("new")
    assert c.available() and c.counters.errors == 0


def test_the_set_of_sessions_forgets_those_that_expired(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    c = cluster_tier(ttl=0.5)
    c.connect()
    for i in range(20):
        c.put_session(f"conv-{i}", {"keys": b"k" * 32, "tokens": None})
    index = rc.node(rc.master_of(c.sessions_key()))
    assert index.zcard(c.sessions_key()) == 20 and len(c.sessions()) == 20
    time.sleep(0.7)  # every record expired
    c.put_session("conv-new", {"keys": b"k" * 32, "tokens": None})
    assert [d["name"] for d in c.sessions()] == ["conv-new"]
    assert index.zcard(c.sessions_key()) == 1  # the members whose record was gone went as they were met


def test_a_host_whose_clock_runs_ahead_neither_hides_nor_removes_the_others_sessions(
    rc: LocalCluster, cluster_tier: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster_tier(ttl=120.0)
    c.connect()
    c.put_session("conv-a", {"keys": b"k" * 32, "tokens": None})  # a host with the right time
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 300)  # another, five minutes ahead
    c.put_session("conv-b", {"keys": b"k" * 32, "tokens": None})
    assert sorted(d["name"] for d in c.sessions()) == ["conv-a", "conv-b"]
    assert rc.node(rc.master_of(c.sessions_key())).zcard(c.sessions_key()) == 2


def test_a_wrong_password_is_a_clear_refusal(rc: LocalCluster, cluster_tier: ClusterFactory) -> None:
    rc.set_password("the-password")
    try:
        c = cluster_tier(password="not-the-password")
        with pytest.raises(ClusterUnavailable, match="refused the credentials"):
            c.connect()
        assert c.status()["state"] == "down" and "not-the-password" not in str(c.status())
        # a dead seed listed last: redis-py names only its "connection refused", the tier still names
        # the refusal the live seeds gave
        dead_last = cluster_tier(urls=[*rc.urls, "redis://127.0.0.1:1"], password="not-the-password")
        with pytest.raises(ClusterUnavailable, match="refused the credentials"):
            dead_last.connect()
        good = cluster_tier(password="the-password")
        good.connect()
        assert good.status()["state"] == "up"
    finally:
        rc.set_password(None)


def test_an_unreachable_cluster_costs_one_timeout_then_none_until_the_retry(
    cluster_tier: ClusterFactory,
) -> None:
    c = cluster_tier(urls=["redis://127.0.0.1:1"], timeout=0.3, retry_after=30.0)
    with pytest.raises(ClusterUnavailable):
        c.connect()
    t = time.monotonic()
    assert c.leading([b"\x01" * 32]) == 0
    with pytest.raises(ClusterUnavailable):
        c.fetch([b"\x01" * 32])
    assert time.monotonic() - t < 0.1  # marked down: no call is tried
    assert not c.available() and c.status()["errors"] == 1


def test_a_tier_whose_seeds_all_died_reconnects_through_the_nodes_it_learnt(
    tmp_path: Path, cluster_tier: ClusterFactory
) -> None:
    # one seed, a master, killed: its replica takes over, and the cluster is whole again without it.
    # A reconnect from the configured seeds alone never got back (local-only until a restart)
    with LocalCluster(tmp_path / "own") as own:
        seed = next(iter(own.live_masters()))
        c = cluster_tier(urls=[f"redis://127.0.0.1:{seed}"], timeout=0.5, retry_after=0.2)
        c.connect()
        items = [(rec(i).key, pack_value(rec(i), b"x" * 100)) for i in range(16)]  # every master's slots
        assert c.store(items) == 16
        own.kill(seed)
        own.wait_ok()
        deadline, stored = time.monotonic() + 20, 0
        while stored < 16 and time.monotonic() < deadline:
            try:
                stored = c.store(items)
            except ClusterUnavailable:
                time.sleep(0.2)
        assert stored == 16, c.status()
        assert c.status()["state"] == "up"  # (redis-py 5 may ride the failover out with no error at all)


def test_seeds_that_refuse_are_asked_once_each_without_backoff() -> None:
    # redis-py's default retry (3 tries, backoff up to 10 s) would make this take seconds
    nodes = ClusterNodes.parse([f"redis://127.0.0.1:{p}" for p in (1, 2, 3)], None, None)
    t = time.monotonic()
    with pytest.raises(Exception, match="refused|Error 111"):
        open_client(nodes, 0.5)
    assert time.monotonic() - t < 1.0


@pytest.fixture
def hung_node() -> Iterator[str]:
    """A node that accepts connections and never answers (a hung host): each try costs a time-out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"redis://127.0.0.1:{s.getsockname()[1]}"


def test_requests_never_wait_on_a_reconnect(cluster_tier: ClusterFactory, hung_node: str) -> None:
    c = cluster_tier(urls=[hung_node], timeout=0.3, retry_after=0.2)
    with pytest.raises(ClusterUnavailable, match="Timeout"):
        c.connect()
    # four request threads while the tier reconnects (0.3 s a try) every 0.2 s: none waits on it
    slowest: list[float] = []

    def requests() -> None:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            t = time.monotonic()
            assert c.leading([b"\x01" * 32]) == 0
            slowest.append(time.monotonic() - t)
            time.sleep(0.01)

    threads = [threading.Thread(target=requests) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(slowest) > 100 and max(slowest) < 0.1
    st = c.status()
    assert st["state"] == "down" and st["errors"] >= 3  # the tier kept trying on its own thread


def test_a_full_cluster_refuses_writes_counted_not_fatal(
    rc: LocalCluster, cluster_tier: ClusterFactory
) -> None:
    c = cluster_tier()
    c.connect()
    masters = list(rc.live_masters())
    assert c.put_session("before", {"ns": {}, "keys": b"", "tokens": None, "updated": 0.0})
    try:
        for p in masters:
            rc.node(p).config_set("maxmemory", "1")
        items = [(rec(i).key, pack_value(rec(i), b"x" * 1000)) for i in range(3)]
        assert c.store(items) == 0
        assert c.counters.write_refused == 3 and c.available()  # the cluster is up, only full
        assert c.leading([k for k, _ in items]) == 0
        # a session record too (it marked the tier down: every lookup missed for retry_after)
        # (False: its caller counts a session record dropped; write_refused counts blocks alone)
        assert c.put_session("S", {"ns": {}, "keys": b"", "tokens": None, "updated": 0.0}) is False
        assert c.counters.write_refused == 3 and c.available() and c.counters.errors == 0
        # and a record's refresh, whose sorted set update (ZADD XX) a full node refuses too
        c.refresh_sessions(["before"])
        assert c.counters.write_refused == 3 and c.available() and c.counters.errors == 0
        assert c.get_session("before") is not None
    finally:
        for p in masters:
            rc.node(p).config_set("maxmemory", "0")
    assert c.store(items) == 3


def test_tls_nodes_with_the_operators_ca(tmp_path: Path, cluster_tier: ClusterFactory) -> None:
    with LocalCluster(tmp_path / "tls", replicas=0, tls=True) as tls:
        c = cluster_tier(urls=tls.urls, tls=TlsFiles(ca=tls.ca, cert=tls.cert, key=tls.key))
        c.connect()
        r = rec(3)
        assert c.store([(r.key, pack_value(r, b"over tls"))]) == 1
        assert c.fetch([r.key]) == [pack_value(r, b"over tls")]
        untrusted = cluster_tier(urls=tls.urls)  # the system's CAs do not know the test CA
        with pytest.raises(ClusterUnavailable, match="not trusted"):
            untrusted.connect()
        plain = cluster_tier(urls=[u.replace("rediss://", "redis://") for u in tls.urls], timeout=0.5)
        with pytest.raises(ClusterUnavailable):
            plain.connect()
        # as a daemon configures it: [cluster] from the environment, the files by path
        env = {
            "KVSTORE_CLUSTER_ENABLED": "true",
            "KVSTORE_CLUSTER_NODES": ",".join(tls.urls),
            "KVSTORE_CLUSTER_TLS_CA_FILE": tls.ca,
            "KVSTORE_CLUSTER_TLS_CERT_FILE": tls.cert,
            "KVSTORE_CLUSTER_TLS_KEY_FILE": tls.key,
        }
        configured = cluster_from_config(load_config(env=env))
        assert configured is not None and configured.status()["state"] == "up"
        configured.close()
    with pytest.raises(ConfigError, match="rediss://"):
        ClusterNodes.parse(["redis://cache-1:7000"], None, None, TlsFiles(ca="/etc/ca.crt"))


@pytest.mark.parametrize("call", ["read", "session write"])
def test_a_late_failure_on_a_replaced_client_leaves_the_new_one_alone(call: str) -> None:
    # a call that took the client before an outage and failed after the reconnect threw the new
    # client away: a second outage, a second reconnect. A session write fails in its pipeline's
    # answers, not by raising
    from kvstore.codecs import get_codec
    from kvstore.tiers.cluster import ClusterTier

    made: list[Any] = []
    started, release = threading.Event(), threading.Event()

    class Pipeline:
        def __getattr__(self, _command: str) -> Any:
            return lambda *a, **kw: None

        def execute(self, raise_on_error: bool = True) -> list[Any]:
            started.set()
            release.wait(10)
            return [ConnectionError("the old client failed late"), 1, 0]

    class Client:
        def __init__(self) -> None:
            self.closed = False
            made.append(self)

        def ping(self) -> bool:
            return True

        def get(self, key: str) -> None:  # no session record stored under the name yet
            return None

        def pipeline(self, transaction: bool = True) -> Pipeline:
            return Pipeline()

        def close(self) -> None:
            self.closed = True

    tier = ClusterTier(
        ClusterNodes.parse(["redis://h:1"], None, None),
        get_codec("raw"),
        retry_after=0.2,
        client_factory=lambda n, t: Client(),
    )
    tier.connect()

    def late(c: Any) -> None:
        started.set()
        release.wait(10)
        raise ConnectionError("the old client failed late")

    slow_call = {
        "read": lambda: tier._call("read", late),
        "session write": lambda: tier.put_session("s", {"tokens": [1]}),
    }[call]
    slow = threading.Thread(target=lambda: pytest.raises(ClusterUnavailable, slow_call))
    slow.start()
    assert started.wait(10)
    with pytest.raises(ClusterUnavailable):
        tier._call("read", lambda c: (_ for _ in ()).throw(ConnectionError("down")))
    deadline = time.monotonic() + 5
    while tier.state != "up" and time.monotonic() < deadline:  # the reconnector made a new client
        time.sleep(0.02)
    assert tier.state == "up" and len(made) == 2
    release.set()
    slow.join(10)
    assert tier.state == "up" and tier.available() and not made[1].closed and len(made) == 2
    assert tier.counters.errors == 2  # the late failure is counted, nothing more
    tier.close()
