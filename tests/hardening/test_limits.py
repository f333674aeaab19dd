"""Limits: every cap on what one request may carry has an error reply, and the daemon goes on serving.

Caps (``[server]`` keys, told to clients in the hello reply):

    header bytes        65536 + 32 * max_tokens_per_request  -> too_large (an engine key: 32 bytes)
    token ids           max_tokens_per_request               -> too_many_tokens
    message bytes       max_message_bytes                    -> too_large
                        (over 2x that: the connection is cut by ZeroMQ, nothing is read)
    requests in flight  max_inflight_per_client              -> busy
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.wire.errors import ProtocolError, ServerError
from kvstore.wire.protocol import PROTOCOL_VERSION, Limits
from tests.daemon.conftest import Daemon
from tests.hardening.conftest import LAYOUT, NS, Raw, T, client, endpoint_of, header, prefix_kv, write_config

MAX_TOKENS = 256
MAX_MESSAGE = 64 * 1024
MAX_INFLIGHT = 4
PINS_PER_TENANT = ServerConfig().max_pins_per_tenant  # the default quota of the tenant "default"
LIMITS = Limits(max_message_bytes=MAX_MESSAGE, max_tokens=MAX_TOKENS, max_inflight=MAX_INFLIGHT)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root: Path = tmp_path_factory.mktemp("limits")
    cfg = write_config(
        root,
        server={
            "max_tokens_per_request": MAX_TOKENS,
            "max_message_bytes": "64KiB",
            "max_inflight_per_client": MAX_INFLIGHT,
            "workers": 1,
        },
    )
    d = Daemon(cfg, endpoint_of(cfg)).wait_ready()
    try:
        yield d
    finally:
        assert d.stop() == 0, d.output()


@pytest.fixture
def raw(daemon: Daemon) -> Iterator[Raw]:
    r = Raw(daemon.endpoint)
    hello = r.ask(header("hello", 1, namespace=NS.to_dict()))
    assert hello["op"] == "hello", hello
    assert hello["limits"] == LIMITS.to_dict()  # the client learns every cap at hello
    yield r
    r.close()


def still_serving(d: Daemon) -> None:
    assert d.proc.poll() is None, d.output()
    tokens = np.arange(7000, 7000 + 2 * T, dtype=np.uint32)
    with client(d.endpoint) as c:
        c.put(tokens, prefix_kv(tokens))
        assert c.lookup(tokens).matched_tokens == 2 * T


def test_a_header_over_its_cap_is_too_large(daemon: Daemon, raw: Raw) -> None:
    # a header may hold every token id as msgpack ints, and 64 KiB of fields besides; not more
    big = "x" * (LIMITS.max_header_bytes + 1)
    r = raw.ask(header("ping", 7, pad=big))
    assert (r["op"], r["code"]) == ("error", "too_large") and "header" in r["message"]
    assert r["id"] == 7  # read from the header's first fields: the caller gets the refusal, not a time-out
    still_serving(daemon)


def test_engine_keys_naming_the_most_tokens_a_request_may_fit_its_header(tmp_path: Path) -> None:
    # 20,000 keys of one-token blocks: 640 kB of keys, past 5 bytes a token of room
    from kvstore.client import KVStoreClient
    from kvstore.layout import KVLayout

    cfg = write_config(tmp_path, server={"max_tokens_per_request": 20000, "workers": 1})
    d = Daemon(cfg, endpoint_of(cfg)).wait_ready()
    try:
        layout = KVLayout(
            LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.dtype, block_tokens=1
        )
        with KVStoreClient(d.endpoint, model="one-token-pages", layout=layout, timeout=10, retries=0) as c:
            keys = [i.to_bytes(32, "little") for i in range(1, 20001)]
            assert c.lookup_keys(keys).matched_blocks == 0
    finally:
        assert d.stop() == 0, d.output()


def test_more_token_ids_than_the_cap_is_too_many_tokens(daemon: Daemon, raw: Raw) -> None:
    ok = np.arange(MAX_TOKENS, dtype="<u4").tobytes()
    over = np.arange(MAX_TOKENS + 1, dtype="<u4").tobytes()
    assert raw.ask(header("lookup", 2, ns=NS.id, tokens=ok))["op"] == "lookup"  # the cap itself is fine
    r = raw.ask(header("lookup", 3, ns=NS.id, tokens=over))
    assert (r["op"], r["code"], r["id"]) == ("error", "too_many_tokens", 3)
    # as a list of ints too
    r = raw.ask(header("get", 4, ns=NS.id, tokens=list(range(MAX_TOKENS + 1))))
    assert r["code"] == "too_many_tokens"
    # the client refuses before sending, with the same code
    with client(daemon.endpoint) as c:
        c.ping()
        c.lookup([1] * 4)  # learns the limits at hello
        with pytest.raises(ProtocolError) as e:
            c.lookup(list(range(MAX_TOKENS + 1)))
        assert e.value.code == "too_many_tokens"
    still_serving(daemon)


def test_a_header_of_many_items_is_refused_as_it_is_decoded_and_not_echoed(daemon: Daemon, raw: Raw) -> None:
    """Items past what a request takes (token ids past the cap, fields no op has, a long string) are
    refused by the decoder, before they are built or checked one by one on the loop that serves
    every client; the refusal does not repeat them back."""
    cap = LIMITS.max_header_bytes
    many_ids = list(range(cap // 6))  # ~5 bytes each: a header just under its cap
    r = raw.ask(header("get", 11, ns=NS.id, tokens=many_ids))
    assert (r["op"], r["code"], r["id"]) == ("error", "too_many_tokens", 11)
    fields = {f"f{i}": 0 for i in range(cap // 10)}
    r = raw.ask(header("ping", 12, **fields))
    assert (r["op"], r["code"], r["id"]) == ("error", "too_large", 12) and len(r["message"]) < 300
    r = raw.ask(header("x" * 60000, 13))  # an op no one knows, as long as a header holds
    assert (r["op"], r["code"], r["id"]) == ("error", "unknown_op", 13) and len(r["message"]) < 300
    r = raw.ask(header("ping", 15, pad="x" * (cap - 100)))  # a string no field takes
    assert (r["op"], r["code"], r["id"]) == ("error", "too_large", 15) and len(r["message"]) < 300
    r = raw.ask(header("ping", 14, **{f"f{i}": 0 for i in range(20)}))  # a few unknown fields
    assert (r["op"], r["code"]) == ("error", "bad_header") and "and 12 more" in r["message"]
    still_serving(daemon)


def test_a_payload_over_max_message_bytes_is_too_large(daemon: Daemon, raw: Raw) -> None:
    blocks = MAX_MESSAGE // LAYOUT.block_nbytes + 1  # one block more than fits
    tokens = np.arange(blocks * T, dtype="<u4")
    kv = prefix_kv(tokens)
    r = raw.ask(
        header("put", 5, ns=NS.id, tokens=tokens.tobytes(), shape=list(kv.shape), dtype="float16"),
        kv.numpy().tobytes(),
    )
    assert (r["op"], r["code"], r["id"]) == ("error", "too_large", 5) and "max_message_bytes" in r["message"]
    # far over the cap, ZeroMQ cuts the connection before anything is read: no reply, daemon unharmed
    cut = Raw(daemon.endpoint)
    cut.sock.send_multipart([header("ping", 6), b"\0" * (3 * MAX_MESSAGE + LIMITS.max_header_bytes)])
    assert not cut.sock.poll(1000)
    cut.close()
    # the client splits a long put into messages under the cap: everything is stored
    with client(daemon.endpoint) as c:
        tokens2 = np.arange(100, 100 + 3 * blocks * T, dtype=np.uint32)[:MAX_TOKENS]
        r2 = c.put(tokens2, prefix_kv(tokens2))
        assert r2.stored + r2.present == len(tokens2) // T and not r2.failed
    still_serving(daemon)


def test_a_message_of_many_frames_each_under_the_cap_is_refused_and_not_kept(
    daemon: Daemon, raw: Raw
) -> None:
    # every frame under the per-frame cap: the loop lets go of what no request can hold
    r = raw.ask(header("ping", 8), *[b"\0" * (MAX_MESSAGE // 2)] * 40)
    assert (r["op"], r["code"], r["id"]) == ("error", "bad_frames", 8) and "at most 2" in r["message"]
    r = raw.ask(header("ping", 9), b"\0" * MAX_MESSAGE)  # two frames, together over the cap
    assert (r["op"], r["code"], r["id"]) == ("error", "too_large", 9)
    still_serving(daemon)


def test_more_requests_in_flight_than_the_cap_get_busy(daemon: Daemon, raw: Raw) -> None:
    tokens = np.arange(9000, 9000 + 8 * T, dtype=np.uint32)
    with client(daemon.endpoint) as c:
        c.put(tokens, prefix_kv(tokens))
    # 40 gets without waiting: the daemon's one worker cannot keep up, so some meet the cap
    n = 40
    for rid in range(100, 100 + n):
        raw.sock.send_multipart([header("get", rid, ns=NS.id, tokens=tokens.tobytes())])
    replies = [raw.recv() for _ in range(n)]
    assert sorted(r["id"] for r in replies) == list(range(100, 100 + n))  # every request answered once
    codes = [r.get("code") for r in replies if r["op"] == "error"]
    assert set(codes) <= {"busy"} and codes, "the in-flight cap never triggered"
    assert any(r["op"] == "get" and r["blocks"] == 8 for r in replies)
    # the count drains with the replies: the same client is served again
    r = raw.ask(header("get", 999, ns=NS.id, tokens=tokens.tobytes()))
    assert r["op"] == "get" and r["blocks"] == 8
    still_serving(daemon)


def test_a_request_never_reaching_a_limit_is_unaffected(daemon: Daemon) -> None:
    # right at every cap: MAX_TOKENS ids, a payload just under max_message_bytes
    blocks = min(MAX_TOKENS // T, (MAX_MESSAGE - 4096 - 4 * MAX_TOKENS) // LAYOUT.block_nbytes)
    tokens = np.arange(20000, 20000 + MAX_TOKENS, dtype=np.uint32)
    with client(daemon.endpoint, timeout=20.0) as c:
        r = c.put(tokens[: blocks * T], prefix_kv(tokens[: blocks * T]))
        assert r.stored == blocks and not r.failed
        got = c.get(tokens)
        assert got.matched_tokens == blocks * T


def test_the_limits_reject_a_hello_namespace_that_is_garbage(daemon: Daemon) -> None:
    r = Raw(daemon.endpoint)
    try:
        bad = {**NS.to_dict(), "layout": {"num_layers": -1}}
        got = r.ask(msgpack.packb({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "namespace": bad}))
        assert got["op"] == "error" and got["code"] in ("layout", "invalid_namespace")
        ok = Namespace(model="other", layout=LAYOUT)
        assert r.ask(header("hello", 2, namespace=ok.to_dict()))["op"] == "hello"
    finally:
        r.close()
    with pytest.raises(KVStoreError):
        Namespace.from_dict(bad)


@pytest.mark.slow
def test_pins_held_through_the_protocol_are_capped(daemon: Daemon) -> None:
    tokens = np.arange(30000, 30000 + 2 * T, dtype=np.uint32)
    with client(daemon.endpoint, retries=0) as c:
        c.put(tokens, prefix_kv(tokens))
        handles = []
        with pytest.raises(ServerError) as e:
            for _ in range(PINS_PER_TENANT + 1):  # a client pinning in a loop, never releasing
                handles.append(c.pin(tokens)[0])
        assert e.value.code == "busy" and len(handles) == PINS_PER_TENANT
        assert c.get(tokens).matched_tokens == 2 * T  # everything else goes on
        assert all(c.release(h) for h in handles)
        assert c.stats()["store"]["pinned"] == 0
        c.pin(tokens)  # room again
