"""The daemon as users see it: a real `python -m kvstore.daemon` process, real sockets, real LMDB."""

from __future__ import annotations

import threading
from typing import TypedDict

import msgpack
import numpy as np
import pytest
import torch
import zmq

from kvstore.client import KVStoreClient
from kvstore.errors import InvalidTokens, LayoutError
from kvstore.keys import Namespace
from kvstore.wire.errors import ServerError
from kvstore.wire.protocol import PROTOCOL_VERSION
from tests.daemon.conftest import LAYOUT, MODEL, Daemon

T = LAYOUT.block_tokens
NS = Namespace(model=MODEL, layout=LAYOUT)


def kv_for(tokens: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(len(tokens)), generator=g).to(torch.float16)


def client(d: Daemon, **kw: object) -> KVStoreClient:
    return KVStoreClient(d.endpoint, model=MODEL, layout=LAYOUT, timeout=10.0, **kw)  # type: ignore[arg-type]


class Raw:
    """A bare DEALER socket speaking frames by hand, to send what no client would."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes, timeout_ms: int = 10000) -> dict:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(timeout_ms), "no reply from the daemon"
        reply = self.sock.recv_multipart()
        return msgpack.unpackb(reply[0], raw=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def header(op: str, rid: int = 1, **fields: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields}, use_bin_type=True)


def test_put_lookup_get_round_trip(shared_daemon: Daemon) -> None:
    tokens = list(range(1000, 1042))  # 10 full blocks + 2 tail tokens
    kv = kv_for(tokens)
    with client(shared_daemon) as c:
        assert c.ping()["pid"] == shared_daemon.proc.pid
        assert c.lookup(tokens).matched_tokens == 0
        # put stores the 10 full blocks; the tail is left to be recomputed
        r = c.put(tokens, kv, session="conv-1")
        assert (r.stored, r.present, r.failed) == (10, 0, [])
        assert c.lookup(tokens).matched_tokens == 40
        got = c.get(tokens)
        assert got.matched_tokens == 40 and got.kv is not None and torch.equal(got.kv, kv[:, :, :40])
        # a second put of the same prefix stores nothing new
        assert c.put(tokens, kv).present == 10
        # a different continuation shares the first 5 blocks only
        other = tokens[:20] + [7] * 20
        assert c.lookup(other).matched_tokens == 20
        got = c.get(other)
        assert got.kv is not None and torch.equal(got.kv, kv[:, :, :20])


def test_a_time_out_longer_than_a_socket_option_holds_is_as_good_as_for_ever(shared_daemon: Daemon) -> None:
    # ~24.8 days is the most a socket time-out holds (int32 ms); past it the option refused the value
    # and the half-made socket hung the context's end for ever
    with KVStoreClient(shared_daemon.endpoint, model=MODEL, layout=LAYOUT, timeout=30 * 86400.0) as c:
        assert c.ping()["pid"] == shared_daemon.proc.pid
        assert c.lookup(list(range(8))).matched_tokens == 0


def test_long_prefix_streams_in_chunks(shared_daemon: Daemon) -> None:
    tokens = list(range(5000, 5000 + 23 * T))
    kv = kv_for(tokens, seed=1)
    with client(shared_daemon, chunk_blocks=3, window=2, shared_memory=False) as c:
        before = c.stats()["server"]["requests"]
        assert c.put(tokens, kv).stored == 23
        got = c.get(tokens)
        after = c.stats()["server"]["requests"]
    assert got.matched_tokens == 23 * T and got.kv is not None and torch.equal(got.kv, kv)
    # 8 put chunks, 1 lookup + 8 get chunks, 1 stats (hello was earlier)
    assert after - before == 8 + 1 + 8 + 1


def test_operator_calls_sessions_inspect_stats_evict_prefetch(shared_daemon: Daemon) -> None:
    tokens = list(range(9000, 9000 + 6 * T))
    with client(shared_daemon) as c:
        c.put(tokens, kv_for(tokens, seed=2), session="conv-ops")
        names = {s.name: s for s in c.sessions()}
        assert names["conv-ops"].tokens == 6 * T and names["conv-ops"].model == MODEL
        detail = c.inspect("conv-ops")
        assert detail.info.name == "conv-ops" and len(detail.blocks) == 6
        where = c.inspect(token_ids=tokens)
        assert where["matched_tokens"] == 6 * T and [b["position"] for b in where["blocks"]] == list(range(6))
        stats = c.stats()
        assert stats["store"]["blocks"] >= 6 and stats["server"]["namespaces"] >= 1
        assert c.prefetch("conv-ops", to="ram").session == "conv-ops"
        dry = c.evict(session="conv-ops", dry_run=True)
        assert dry.blocks == 6 and c.lookup(tokens).matched_tokens == 6 * T  # dry run changed nothing
        assert c.evict(session="conv-ops").blocks == 6
        assert c.lookup(tokens).matched_tokens == 0
        with pytest.raises(ServerError) as info:
            c.inspect("no-such-session")
        assert info.value.code == "not_found"


def test_client_side_checks_raise_before_sending(shared_daemon: Daemon) -> None:
    with client(shared_daemon) as c:
        with pytest.raises(InvalidTokens):
            c.lookup([1, -5])
        with pytest.raises(LayoutError):
            c.put(list(range(8)), torch.zeros(2, 2, 8, 3, 16, dtype=torch.float16))
        # K/V for fewer tokens than the ids' full blocks: stored that much, nothing said (stored 0)
        with pytest.raises(LayoutError, match="fewer than"):
            c.put(list(range(4 * T + 3)), torch.zeros(LAYOUT.shape(T + 5), dtype=LAYOUT.torch_dtype))
        with pytest.raises(LayoutError, match="src holds"):
            c.put_from(list(range(4 * T + 3)), torch.zeros(LAYOUT.shape(T + 5), dtype=LAYOUT.torch_dtype))
        assert c.lookup(list(range(4 * T))).matched_blocks == 0
        kv = torch.zeros(LAYOUT.shape(2 * T), dtype=LAYOUT.torch_dtype)  # the partial block may be left out
        assert c.put(list(range(10**6, 10**6 + 2 * T + 3)), kv).stored == 2


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xc1 not msgpack"], "bad_message"),
        ([msgpack.packb(["a", "list"])], "bad_message"),
        ([header("teleport")], "unknown_op"),
        ([msgpack.packb({"v": 999, "op": "ping", "id": 1})], "version"),
        ([header("ping"), b"unexpected payload"], "bad_frames"),
        ([header("lookup", ns=NS.id, tokens=[1, 2, -3])], "invalid_tokens"),
        ([header("lookup", ns=NS.id, tokens=[2**33])], "invalid_tokens"),
        ([header("lookup", ns=NS.id, tokens=list(range(5000)))], "too_many_tokens"),
        ([header("lookup", ns="0000000000000000", tokens=[1, 2, 3, 4])], "unknown_namespace"),
        ([header("lookup", ns=NS.id, tokens="1 2 3 4")], "bad_header"),
        ([header("ping"), b"x" * 70000], "too_large"),
    ],
)
def test_bad_requests_get_error_replies_and_the_daemon_serves_on(
    shared_daemon: Daemon, frames: list[bytes], code: str
) -> None:
    raw = Raw(shared_daemon.endpoint)
    try:
        raw.ask(header("hello", namespace=NS.to_dict()))  # so that NS.id is known
        reply = raw.ask(*frames)
        assert reply["op"] == "error" and reply["code"] == code, reply
        assert reply["message"]
        # the same connection and another client both go on working
        assert raw.ask(header("ping", rid=2))["op"] == "ping"
    finally:
        raw.close()
    with client(shared_daemon) as c:
        assert c.ping()["pid"] == shared_daemon.proc.pid


class PutFields(TypedDict):
    """A put's header fields past op and id: typed, so that ``**fields`` cannot fill header's rid."""

    ns: str
    tokens: bytes
    shape: list[int]
    dtype: str


def test_bad_puts_store_nothing(shared_daemon: Daemon) -> None:
    tokens = np.arange(7000, 7000 + 2 * T, dtype="<u4")
    good = kv_for(tokens.tolist(), seed=3).view(torch.uint8).numpy().tobytes()
    fields: PutFields = {
        "ns": NS.id,
        "tokens": tokens.tobytes(),
        "shape": list(LAYOUT.shape(2 * T)),
        "dtype": "float16",
    }
    raw = Raw(shared_daemon.endpoint)
    try:
        raw.ask(header("hello", namespace=NS.to_dict()))
        # payload one value short of its shape
        assert raw.ask(header("put", **fields), good[:-2])["code"] == "bad_payload"
        # payload frame missing
        assert raw.ask(header("put", **fields))["code"] == "bad_frames"
        # two payload frames
        assert raw.ask(header("put", **fields), good, good)["code"] == "bad_frames"
        # a shape of another layout (3 heads) contradicts the namespace
        wrong: PutFields = {**fields, "shape": [2, 2, 2 * T, 3, 16]}
        assert raw.ask(header("put", **wrong), good + good[: len(good) // 2])["code"] == "layout"
        # a dtype other than the namespace's
        bf16: PutFields = {**fields, "dtype": "bfloat16"}
        assert raw.ask(header("put", **bf16), good)["code"] == "layout"
        # nothing of it is visible
        assert raw.ask(header("lookup", ns=NS.id, tokens=tokens.tobytes()))["matched_blocks"] == 0
        # the well-formed put then works on the same connection
        ok = raw.ask(header("put", **fields), good)
        assert ok["op"] == "put" and ok["stored"] == 2
    finally:
        raw.close()


def test_client_vanishing_mid_request_leaves_the_daemon_serving(shared_daemon: Daemon) -> None:
    tokens = np.arange(3000, 3000 + 8 * T, dtype="<u4")
    payload = kv_for(tokens.tolist(), seed=4).view(torch.uint8).numpy().tobytes()
    for _ in range(5):  # send a put and a get, close at once, never read the replies
        raw = Raw(shared_daemon.endpoint)
        raw.sock.send_multipart([header("hello", namespace=NS.to_dict())])
        raw.sock.send_multipart(
            [
                header(
                    "put",
                    rid=2,
                    ns=NS.id,
                    tokens=tokens.tobytes(),
                    shape=list(LAYOUT.shape(8 * T)),
                    dtype="float16",
                ),
                payload,
            ]
        )
        raw.sock.send_multipart([header("get", rid=3, ns=NS.id, tokens=tokens.tobytes())])
        raw.close()
    with client(shared_daemon) as c:
        assert c.ping()["pid"] == shared_daemon.proc.pid
        # the put either completed whole or not at all: a prefix of whole blocks, exact
        got = c.get(tokens)
        if got.kv is not None:
            assert torch.equal(
                got.kv,
                torch.frombuffer(bytearray(payload), dtype=torch.float16).view(LAYOUT.shape(8 * T))[
                    :, :, : got.matched_tokens
                ],
            )


def test_several_clients_at_once(shared_daemon: Daemon) -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            tokens = list(range(20000 + 1000 * i, 20000 + 1000 * i + 12 * T))
            kv = kv_for(tokens, seed=10 + i)
            with client(shared_daemon, chunk_blocks=4) as c:
                for _ in range(3):
                    c.put(tokens, kv)
                    got = c.get(tokens)
                    assert got.matched_tokens == 12 * T and got.kv is not None and torch.equal(got.kv, kv)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_a_put_over_the_socket_checks_its_tensor_as_shared_memory_does(shared_daemon: Daemon) -> None:
    """A tensor with no data is refused with the error the shared-memory path gives (nothing stored);
    one viewed negated is stored as its values, not as the bytes under the view."""
    tokens = list(range(9000, 9000 + 2 * T))
    kv = kv_for(tokens, seed=4)
    with client(shared_daemon, shared_memory=False) as c:
        with pytest.raises(LayoutError, match="meta device"):
            c.put(tokens, torch.empty(kv.shape, dtype=kv.dtype, device="meta"))
        assert c.lookup(tokens).matched_tokens == 0
        assert c.put(tokens, torch._neg_view(-kv)).stored == 2
        got = c.get(tokens)
    assert got.kv is not None and torch.equal(got.kv, kv)
