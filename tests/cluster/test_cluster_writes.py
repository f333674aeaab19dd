"""The write side of the cluster link under pressure: a full queue, a slow cluster, a close.

::

    put --> [ queue ([cluster] write_queue) ] --> cluster thread --> SET block
        \\-> [ newest record per session ]    --/                --> SET session record
    dropped (queue full, cluster down): counted, and sent again by the next put of the block
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest

from kvstore.store import cluster as cluster_link
from kvstore.store.engine import Store
from kvstore.tiers.cluster_client import open_client
from tests.cluster.conftest import HostFactory
from tests.cluster.rediscluster import LocalCluster
from tests.store.storekit import NS, T, kv, tokens


class Gated:
    """A redis-py client whose session writes (a pipeline that SETs a session key) wait for
    ``gate``: the cluster thread stays busy."""

    def __init__(self, client: Any, gate: threading.Event, waiting: threading.Event) -> None:
        self._client, self._gate, self._waiting = client, gate, waiting

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def pipeline(self, *args: Any, **kw: Any) -> Any:
        return _GatedPipeline(self._client.pipeline(*args, **kw), self)


class _GatedPipeline:
    def __init__(self, pipe: Any, gated: Gated) -> None:
        self._pipe, self._gated, self._session = pipe, gated, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def set(self, key: Any, *args: Any, **kw: Any) -> Any:
        self._session = self._session or ":s:" in str(key)
        return self._pipe.set(key, *args, **kw)

    def execute(self, *args: Any, **kw: Any) -> Any:
        if self._session:
            self._gated._waiting.set()
            self._gated._gate.wait(30)
        return self._pipe.execute(*args, **kw)


class SlowPipelines:
    """A redis-py client whose block writes (a pipeline) take ``delay`` seconds each: a slow link."""

    def __init__(self, client: Any, delay: float) -> None:
        self._client, self._delay = client, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def pipeline(self, *args: Any, **kw: Any) -> Any:
        pipe, delay = self._client.pipeline(*args, **kw), self._delay

        class Slow:
            def __getattr__(self, name: str) -> Any:
                return getattr(pipe, name)

            def execute(self, *a: Any, **k: Any) -> Any:
                time.sleep(delay)
                return pipe.execute(*a, **k)

        return Slow()


def drained(s: Store) -> bool:
    """Whether what waits for the cluster was written (or given up) within 10 s."""
    assert s._cluster is not None
    return s._cluster.drain(10)


def test_a_block_dropped_from_a_full_queue_goes_with_the_next_put_of_it(host: HostFactory) -> None:
    a, b = host("a", cluster_queue=2), host("b")
    toks, x = tokens(3), kv(3 * T)
    a.put(NS, toks, x, session="S")  # blocks 0, 1 queued; block 2 finds the queue full
    assert drained(a) and a.stats().cluster["write_dropped"] == 1  # type: ignore[index]
    assert b.lookup(NS, toks).matched_blocks == 2
    a.put(NS, toks, x, session="S")  # nothing new here, but block 2 never reached the cluster
    assert drained(a)
    assert b.lookup(NS, toks).tiers == ["cluster"] * 3
    st = a.stats().cluster
    assert st is not None and (st["written"], st["write_dropped"]) == (3, 1)


def test_one_record_waits_per_session_and_few_wait_in_all(rc: LocalCluster, host: HostFactory) -> None:
    gate, waiting = threading.Event(), threading.Event()
    a = host("a", cluster_queue=2, client_factory=lambda n, t: Gated(open_client(n, t), gate, waiting))
    toks, x = tokens(4), kv(4 * T)
    for n in (2, 4):  # the blocks first, two at a time (the queue's size): below only records wait
        a.put(NS, toks[: n * T], x[:, :, : n * T])
        assert drained(a)
    try:
        a.put(NS, toks[:T], x[:, :, :T], session="s0")
        assert waiting.wait(10)  # the cluster thread is writing s0's record: the others wait
        for n in (1, 2, 3):  # one record of s1 waits, the newest
            a.put(NS, toks[: n * T], x[:, :, : n * T], session="s1")
        a.put(NS, toks[:T], x[:, :, :T], session="s2")
        a.put(NS, toks[:T], x[:, :, :T], session="s3")  # three sessions wait, two may: s1 is dropped
        a.put(NS, toks, x, session="s2")  # s2's newest record, sent after s3's
        st = a.stats().cluster
        assert st is not None and st["session_dropped"] == 1 and st["write_dropped"] == 0
    finally:
        gate.set()
    assert drained(a)
    cluster = a._cluster.cluster  # type: ignore[union-attr]
    assert cluster.get_session("s1") is None
    assert cluster.get_session("s0") is not None and cluster.get_session("s3") is not None
    s2 = cluster.get_session("s2")
    assert s2 is not None and len(s2["keys"]) == 4 * 32  # the newest: all four blocks
    node = rc.node(rc.master_of(cluster.session_key("s2")))
    assert msgpack.unpackb(node.get(cluster.session_key("s2")))["keys"] == s2["keys"]


def test_records_waiting_are_bounded_in_bytes_too(
    rc: LocalCluster, host: HostFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a count alone let a slow cluster hold 1,024 records of long conversations (~4 bytes a token each)
    monkeypatch.setattr(cluster_link, "RECORDS_BYTES", 2 * (32 + 4 * T))  # two one-block records
    gate, waiting = threading.Event(), threading.Event()
    a = host("a", client_factory=lambda n, t: Gated(open_client(n, t), gate, waiting))
    toks, x = tokens(1), kv(T)
    a.put(NS, toks, x)
    assert drained(a)
    try:
        a.put(NS, toks, x, session="s0")
        assert waiting.wait(10)  # the cluster thread is writing s0's record: the others wait
        for name in ("s1", "s2", "s3"):  # the third is over the bytes: the oldest waiting goes
            a.put(NS, toks, x, session=name)
        st = a.stats().cluster
        assert st is not None and st["session_dropped"] == 1
    finally:
        gate.set()
    assert drained(a)
    cluster = a._cluster.cluster  # type: ignore[union-attr]
    assert cluster.get_session("s1") is None
    assert all(cluster.get_session(n) is not None for n in ("s0", "s2", "s3"))


def test_a_block_sent_again_and_dropped_again_by_the_writer_is_counted_once(
    rc: LocalCluster, host: HostFactory
) -> None:
    # a node's time-out came back inside the pipeline's answers: counted as an error, the tier left
    # up, and the block neither written nor remembered (no later put sent it again)
    a = host("a", cluster_queue=2, timeout=0.3, retry_after=0.5)
    toks, x = tokens(3), kv(3 * T)
    a.put(NS, toks, x)  # blocks 0, 1 queued; block 2 finds the queue full
    assert drained(a) and a.stats().cluster["write_dropped"] == 1  # type: ignore[index]
    masters = list(rc.live_masters())
    for port in masters:
        rc.pause(port)
    try:
        a.put(NS, toks, x)  # block 2 goes again; its write times out in the cluster thread
        assert drained(a)
        st = a.stats().cluster
        assert st is not None and (st["state"], st["write_dropped"], st["written"]) == ("down", 1, 2)
    finally:
        for port in masters:
            rc.resume(port)
    deadline = time.monotonic() + 10
    while a.stats().cluster["state"] != "up" and time.monotonic() < deadline:  # type: ignore[index]
        time.sleep(0.1)
    a.put(NS, toks, x)  # remembered as not written: it goes with the next put of it
    assert drained(a)
    assert a.stats().cluster["written"] == 3  # type: ignore[index]


def test_close_writes_what_it_can_in_its_time_and_drops_the_rest(host: HostFactory) -> None:
    a = host("a", client_factory=lambda n, t: SlowPipelines(open_client(n, t), 0.4))
    a.put(NS, tokens(24), kv(24 * T))  # 24 writes of 0.4 s: ~10 s to write them all
    cluster = a._cluster.cluster  # type: ignore[union-attr]
    t = time.monotonic()
    a.close()
    assert time.monotonic() - t < 7.0  # 5 s to write, and the write under way
    c = cluster.counters
    assert c.written + c.write_dropped == 24 and c.write_dropped >= 8


def test_a_block_dropped_goes_with_a_later_put_from_a_block_after_it(host: HostFactory) -> None:
    # an engine saves as it computes (put from block k): block 2, dropped, was never among the
    # blocks such a put named, so blocks 3.. reached the cluster and no host could reach them
    a, b = host("a", cluster_queue=2), host("b")
    toks, x = tokens(4), kv(4 * T)
    a.put(NS, toks, x[:, :, : 3 * T])  # blocks 0, 1 queued; block 2 finds the queue full
    assert drained(a) and a.stats().cluster["write_dropped"] == 1  # type: ignore[index]
    assert a.put(NS, toks, x[:, :, 3 * T :], start_block=3).stored == 1  # block 3: 2 goes with it
    assert drained(a)
    assert b.lookup(NS, toks).tiers == ["cluster"] * 4
    st = a.stats().cluster
    assert st is not None and (st["written"], st["write_dropped"]) == (4, 1)


def test_a_block_dropped_again_is_counted_once(rc: LocalCluster, host: HostFactory) -> None:
    a = host("a", timeout=0.3, retry_after=60.0)
    toks, x = tokens(2), kv(2 * T)
    masters = list(rc.live_masters())
    for port in masters:
        rc.pause(port)
    try:
        a.lookup(NS, tokens(3, seed=9))  # meets the outage: the cluster is marked down
        for _ in range(3):  # each put would send the dropped blocks again: still down
            a.put(NS, toks, x)
        assert a.stats().cluster["write_dropped"] == 2  # type: ignore[index]
    finally:
        for port in masters:
            rc.resume(port)


def test_a_block_the_full_cluster_refused_goes_again_with_the_next_put_that_reaches_it(
    rc: LocalCluster, host: HostFactory
) -> None:
    a, b = host("a"), host("b")
    toks, x = tokens(4), kv(4 * T)
    masters = list(rc.live_masters())
    try:
        for p in masters:
            rc.node(p).config_set("maxmemory", "1")
        a.put(NS, toks[: 2 * T], x[:, :, : 2 * T], session="s")  # blocks 0-1: refused for memory
        assert drained(a)
        deadline = time.monotonic() + 10
        while a.stats().cluster["session_dropped"] < 1 and time.monotonic() < deadline:  # type: ignore[index]
            time.sleep(0.02)
    finally:
        for p in masters:
            rc.node(p).config_set("maxmemory", "0")
    st = a.stats().cluster
    # the session's record was refused too: a session dropped, not a block refused (exported as such)
    assert st is not None and (st["write_refused"], st["write_dropped"], st["session_dropped"]) == (2, 0, 1)
    a.put(NS, toks, x)  # blocks 2-3 are new; 0-1, refused before, go with them
    assert drained(a)
    assert b.lookup(NS, toks).tiers == ["cluster"] * 4  # not [], stopped at block 0


def test_a_damaged_session_record_is_ignored_and_the_tier_stays_up(
    rc: LocalCluster, host: HostFactory
) -> None:
    from kvstore.results import EvictFilter

    a, b = host("a"), host("b")
    toks = tokens(2)
    a.put(NS, toks, kv(2 * T), session="good")
    assert drained(a)
    tier = a._cluster.cluster  # type: ignore[union-attr]
    client = open_client(tier.nodes, 5.0)
    good = msgpack.unpackb(client.get(tier.session_key("good")), raw=False)
    bad = {**good, "name": "bad", "keys": 2**63}  # valid msgpack, a number where bytes go
    client.set(tier.session_key("bad"), msgpack.packb(bad, use_bin_type=True))
    client.zadd(tier.sessions_key(), {tier.session_key("bad"): time.time() + 3600})
    with pytest.raises(KeyError):
        b.session("bad")  # not found, not OverflowError
    r = b.evict(EvictFilter(session="good"))  # reads every record: the bad one is skipped
    assert not r.not_done, r
    assert tier.available() and b._cluster.cluster.available()  # type: ignore[union-attr]
    assert b.stats().cluster["state"] == "up"  # type: ignore[index]
    client.close()


def test_a_block_the_cluster_codec_cannot_encode_is_counted_dropped(host: HostFactory) -> None:
    # inf in block 1 (int4, the cluster's default codec, refuses it): skipped without a trace while
    # the blocks after it were written, unreachable for every other host
    a = host("a", codec="int4", write_through=False)
    toks, x = tokens(4), kv(4 * T, seed=3)
    x[0, 0, T + 1, 0, 0] = float("inf")
    assert a.put(NS, toks, x).stored == 4
    assert drained(a)
    st = a.stats().cluster
    assert st is not None and st["write_dropped"] == 1 and st["written"] == 3
    for _ in range(3):  # once: not looked up, encoded and counted again at each put of it
        assert a.put(NS, toks, x).present == 4
        assert drained(a)
    st = a.stats().cluster
    assert st is not None and st["write_dropped"] == 1 and st["written"] == 3
