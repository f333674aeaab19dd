"""The protocol objects joined in memory: a client and a server half, no sockets.

Many short stories, one per message or protocol rule.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import LayoutError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.wire.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    ServerError,
    error_for_reply,
)
from kvstore.wire.messages import (
    REQUESTS,
    Buffer,
    DataOk,
    ErrorReply,
    Evict,
    Finish,
    Get,
    GetOk,
    Hello,
    HelloOk,
    Locate,
    LocateOk,
    Lookup,
    LookupOk,
    Message,
    Pin,
    Ping,
    PinOk,
    Pong,
    Put,
    PutOk,
    Release,
    Reserve,
    ReserveOk,
)
from kvstore.wire.protocol import (
    CUT_KEPT,
    PROTOCOL_VERSION,
    ClientProtocol,
    Limits,
    Request,
    ServerProtocol,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16", block_tokens=4)
NS = Namespace(model="m", layout=LAYOUT, tenant="t")
PEER = b"peer-1"


def kv_bytes(blocks: int) -> bytes:
    return (
        torch.zeros(LAYOUT.shape(blocks * LAYOUT.block_tokens), dtype=torch.float16)
        .view(torch.uint8)
        .numpy()
        .tobytes()
    )


def put_msg(ns: str, tokens: np.ndarray, blocks: int, start: int = 0) -> Put:
    return Put(
        ns=ns,
        tokens=tokens,
        shape=LAYOUT.shape(blocks * 4),
        dtype="float16",
        kv=kv_bytes(blocks),
        start_block=start,
    )


def joined(limits: Limits | None = None) -> tuple[ClientProtocol, ServerProtocol, str]:
    """A client that has said hello to a server; returns both and the ns id."""
    client, server = ClientProtocol(), ServerProtocol(limits or Limits(), server="test")
    _, frames = client.send(Hello(namespace=NS))
    got = client.receive(server.hello(server.receive(PEER, frames)))
    assert got is not None and isinstance(got[1], HelloOk)
    return client, server, got[1].ns


def roundtrip(client: ClientProtocol, server: ServerProtocol, msg: Message) -> Request:
    _, frames = client.send(msg)
    return server.receive(PEER, frames)


def answer(client: ClientProtocol, frames: list[Buffer]) -> tuple[int, Message]:
    """The (request id, reply) in ``frames``, which answer a request the client still awaits."""
    got = client.receive(frames)
    assert got is not None
    return got


def test_hello_registers_namespace_and_returns_limits() -> None:
    limits = Limits(max_message_bytes=1 << 20, max_tokens=64, max_inflight=2)
    _, server, ns = joined(limits)
    assert ns == NS.id and server.namespaces[ns] == NS
    assert server.inflight == {}  # hello answered: nothing left in flight


def test_a_layout_whose_block_is_larger_than_a_message_is_refused_at_hello() -> None:
    # a get of one such block would be charged more than the daemon lets all requests hold: one
    # client's misses would have every other client turned away busy
    client, server = ClientProtocol(), ServerProtocol(Limits(max_message_bytes=1 << 20), server="test")
    huge = KVLayout(num_layers=64, num_kv_heads=8, head_dim=128, dtype="float32", block_tokens=64)
    _, frames = client.send(Hello(namespace=Namespace(model="m", layout=huge)))
    got = client.receive(server.hello(server.receive(PEER, frames)))
    assert got is not None and isinstance(got[1], ErrorReply) and got[1].code == "invalid_argument"
    assert "over max_message_bytes 1048576" in got[1].message
    assert server.namespaces == {} and server.inflight == {}


def test_lookup_round_trip_keeps_tokens_and_matches_reply_by_id() -> None:
    client, server, ns = joined()
    tokens = np.arange(10, dtype="<u4")
    req = roundtrip(client, server, Lookup(ns=ns, tokens=tokens))
    # the server sees the same tokens and the namespace resolved from the ns id
    assert isinstance(req.msg, Lookup) and req.namespace == NS and req.msg.tokens is not None
    assert np.array_equal(req.msg.tokens, tokens)
    assert server.inflight == {PEER: 1}
    rid, reply = answer(
        client, server.reply(req, LookupOk(matched_blocks=2, matched_tokens=8, tiers=["hbm"] * 2))
    )
    assert rid == req.id and reply == LookupOk(2, 8, ["hbm", "hbm"])
    assert server.inflight == {} and client.pending == {}


def test_replies_out_of_order_match_their_requests() -> None:
    client, server, ns = joined()
    a = roundtrip(client, server, Lookup(ns=ns, tokens=np.arange(4, dtype="<u4")))
    b = roundtrip(client, server, Ping())
    # b answered first
    got_b = client.receive(server.reply(b, Pong(server="test", pid=1)))
    got_a = client.receive(server.reply(a, LookupOk(1, 4, ["ram"])))
    assert got_b is not None and got_b[0] == b.id
    assert got_a is not None and got_a[0] == a.id and isinstance(got_a[1], LookupOk)


def test_put_payload_travels_as_a_separate_frame_and_get_reply_carries_blocks() -> None:
    client, server, ns = joined()
    tokens = np.arange(12, dtype="<u4")
    _, frames = client.send(put_msg(ns, tokens, blocks=2, start=1))
    assert len(frames) == 2 and len(frames[1]) == 2 * LAYOUT.block_nbytes
    req = server.receive(PEER, frames)
    assert (
        isinstance(req.msg, Put) and req.msg.start_block == 1 and len(req.msg.kv) == 2 * LAYOUT.block_nbytes
    )
    rid, reply = answer(
        client, server.reply(req, PutOk(stored=1, present=0, failed=[[2, "tier_full", "pinned"]]))
    )
    assert reply == PutOk(1, 0, [[2, "tier_full", "pinned"]])

    req = roundtrip(client, server, Get(ns=ns, tokens=tokens, max_blocks=16))
    out = server.reply(req, GetOk(start_block=0, blocks=3, tiers=["hbm"] * 3, kv=kv_bytes(3)))
    assert len(out) == 2
    _, reply = answer(client, out)
    assert isinstance(reply, GetOk) and reply.blocks == 3 and len(reply.kv) == 3 * LAYOUT.block_nbytes
    # a get reply without blocks has no payload frame
    req = roundtrip(client, server, Get(ns=ns, tokens=tokens))
    out = server.reply(req, GetOk(start_block=0, blocks=0, tiers=[]))
    assert len(out) == 1
    _, reply = answer(client, out)
    assert isinstance(reply, GetOk) and reply.kv is None


def raw(header: dict, *payload: bytes) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *payload]


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xc1\xc1 not msgpack"], "bad_message"),
        ([msgpack.packb([1, 2, 3])], "bad_message"),
        (raw({"v": PROTOCOL_VERSION, "op": "ping"}), "bad_header"),
        (raw({"v": PROTOCOL_VERSION, "op": "fly", "id": 1}), "unknown_op"),
        (raw({"v": 99, "op": "ping", "id": 1}), "version"),
        (raw({"v": PROTOCOL_VERSION, "op": "ping", "id": 1}, b"extra"), "bad_frames"),
        (raw({"v": PROTOCOL_VERSION, "op": "ping", "id": 1, "colour": "red"}), "bad_header"),
        (raw({"v": PROTOCOL_VERSION, "op": "lookup", "id": 1, "ns": 5, "tokens": b""}), "bad_header"),
        (
            raw({"v": PROTOCOL_VERSION, "op": "lookup", "id": 1, "ns": NS.id, "tokens": [1, -1]}),
            "invalid_tokens",
        ),
        (
            raw({"v": PROTOCOL_VERSION, "op": "lookup", "id": 1, "ns": NS.id, "tokens": [2**32]}),
            "invalid_tokens",
        ),
        (
            raw({"v": PROTOCOL_VERSION, "op": "lookup", "id": 1, "ns": NS.id, "tokens": b"abc"}),
            "invalid_tokens",
        ),
        (
            raw({"v": PROTOCOL_VERSION, "op": "lookup", "id": 1, "ns": "nope", "tokens": b""}),
            "unknown_namespace",
        ),
        (
            raw({"v": PROTOCOL_VERSION, "op": "hello", "id": 1, "namespace": {"model": "m"}}),
            "invalid_namespace",
        ),
        (
            raw(
                {
                    "v": PROTOCOL_VERSION,
                    "op": "hello",
                    "id": 1,
                    "namespace": {
                        "model": "m",
                        "layout": {"num_layers": 0, "num_kv_heads": 1, "head_dim": 4},
                    },
                }
            ),
            "layout",
        ),
    ],
)
def test_malformed_requests_raise_remote_errors_with_codes(frames: list[bytes], code: str) -> None:
    _, server, _ = joined()
    with pytest.raises(RemoteProtocolError) as info:
        server.receive(PEER, frames)
    assert info.value.code == code
    assert server.inflight == {}  # a rejected request is never counted
    # the op it is counted under in the daemon's metrics: its own, when the protocol knows it
    op = msgpack.unpackb(frames[0]).get("op") if code not in ("bad_message", "version") else None
    assert info.value.op == (op if op != "fly" else None)


@pytest.mark.parametrize("frame", [b"\xc1", b"\x92\x01", b""])
def test_a_header_that_is_not_msgpack_is_refused_with_a_reason(frame: bytes) -> None:
    # msgpack's errors for some garbage carry no text: "frame 0 is not valid msgpack: " said nothing
    _, server, _ = joined()
    with pytest.raises(RemoteProtocolError) as info:
        server.receive(PEER, [frame])
    assert info.value.code == "bad_message"
    why = info.value.message.split("(", 1)[1].split(")", 1)[0]
    assert why.strip() and f"it begins {frame.hex(' ') or 'empty'}" in info.value.message


def test_request_id_survives_into_the_error_when_readable() -> None:
    _, server, _ = joined()
    with pytest.raises(RemoteProtocolError) as info:
        server.receive(PEER, raw({"v": PROTOCOL_VERSION, "op": "fly", "id": 77}))
    assert info.value.request_id == 77
    # the error reply goes back under that id and the client sees the code
    client = ClientProtocol()
    client.pending[77] = "ping"
    rid, reply = answer(client, server.error(PEER, 77, info.value.code, info.value.message, done=False))
    assert rid == 77 and isinstance(reply, ErrorReply) and reply.code == "unknown_op"


def test_put_checks_against_the_namespace_layout() -> None:
    client, server, ns = joined()
    tokens = np.arange(8, dtype="<u4")
    # shape of another layout (3 heads): contradicts the namespace
    wrong = Put(ns=ns, tokens=tokens, shape=(2, 2, 4, 3, 4), dtype="float16", kv=bytes(2 * 2 * 4 * 3 * 4 * 2))
    with pytest.raises(RemoteProtocolError, match="contradicts") as info:
        roundtrip(client, server, wrong)
    assert info.value.code == "layout"
    # right shape, other dtype
    with pytest.raises(RemoteProtocolError) as info:
        roundtrip(
            client, server, Put(ns=ns, tokens=tokens, shape=LAYOUT.shape(4), dtype="bfloat16", kv=kv_bytes(1))
        )
    assert info.value.code == "layout"
    # more blocks than the tokens name
    with pytest.raises(RemoteProtocolError) as info:
        roundtrip(client, server, put_msg(ns, tokens, blocks=2, start=1))
    assert info.value.code == "invalid_argument"


def test_payload_size_mismatch_is_local_before_sending_and_remote_on_receipt() -> None:
    client, server, ns = joined()
    tokens = np.arange(4, dtype="<u4")
    short = Put(ns=ns, tokens=tokens, shape=LAYOUT.shape(4), dtype="float16", kv=kv_bytes(1)[:-2])
    with pytest.raises(LocalProtocolError) as local:
        client.send(short)
    assert local.value.code == "bad_payload" and not isinstance(local.value, RemoteProtocolError)
    # the same message built by hand (no client checks) is refused by the server
    header = {
        "v": PROTOCOL_VERSION,
        "op": "put",
        "id": 5,
        "ns": ns,
        "tokens": tokens.tobytes(),
        "shape": list(LAYOUT.shape(4)),
        "dtype": "float16",
    }
    with pytest.raises(RemoteProtocolError) as remote:
        server.receive(PEER, raw(header, kv_bytes(1)[:-2]))
    assert remote.value.code == "bad_payload"
    with pytest.raises(RemoteProtocolError) as remote:
        server.receive(PEER, raw(header))  # payload frame missing
    assert remote.value.code == "bad_frames"


def test_limits_tokens_and_inflight() -> None:
    client, server, ns = joined(Limits(max_message_bytes=4096, max_tokens=16, max_inflight=2))
    with pytest.raises(RemoteProtocolError) as info:
        roundtrip(client, server, Lookup(ns=ns, tokens=np.arange(17, dtype="<u4")))
    assert info.value.code == "too_many_tokens"
    # two in flight is the most: the third is refused as busy, then accepted once one is answered
    first = roundtrip(client, server, Ping())
    roundtrip(client, server, Ping())
    with pytest.raises(RemoteProtocolError) as info:
        roundtrip(client, server, Ping())
    assert info.value.code == "busy"
    server.reply(first, Pong(server="test", pid=1))
    assert isinstance(roundtrip(client, server, Ping()).msg, Ping)


@pytest.mark.parametrize("as_list", [True, False])
def test_a_request_refused_before_its_header_is_read_names_its_op(as_list: bool) -> None:
    # refused while msgpack decoded the header (a list past max_tokens, a header over its limit),
    # a request was counted under op "other" in the metrics, though its op was there to read
    _, server, ns = joined(Limits(max_message_bytes=4096, max_tokens=16, max_inflight=2))
    tokens: Any = list(range(40)) if as_list else bytes(8192)
    frames = raw({"v": PROTOCOL_VERSION, "op": "lookup", "id": 5, "ns": ns, "tokens": tokens})
    with pytest.raises(RemoteProtocolError) as info:
        server.receive(PEER, frames)
    assert info.value.code == ("too_many_tokens" if as_list else "too_large")
    assert (info.value.request_id, info.value.op) == (5, "lookup")


def test_oversized_message_is_too_large() -> None:
    client, server, ns = joined(Limits(max_message_bytes=1000, max_tokens=64, max_inflight=4))
    with pytest.raises(RemoteProtocolError) as info:
        roundtrip(client, server, put_msg(ns, np.arange(32, dtype="<u4"), blocks=8))  # 8 * 64 B payload
    assert info.value.code == "too_large"


def test_late_reply_after_forget_is_dropped_and_wrong_op_is_remote_error() -> None:
    client, server, ns = joined()
    req = roundtrip(client, server, Lookup(ns=ns, tokens=np.arange(4, dtype="<u4")))
    client.forget(req.id)
    assert client.receive(server.reply(req, LookupOk(1, 4, ["hbm"]))) is None
    req = roundtrip(client, server, Lookup(ns=ns, tokens=np.arange(4, dtype="<u4")))
    with pytest.raises(RemoteProtocolError):
        client.receive(server.reply(Request(PEER, req.id, Ping()), Pong(server="test", pid=1)))
    # the server half refuses to answer a request with a reply of another op
    with pytest.raises(LocalProtocolError):
        server.reply(req, DataOk(data=1))


def test_a_late_reply_holding_a_lease_or_pin_is_given_back_and_others_are_dropped() -> None:
    client, server, ns = joined()
    tokens = np.arange(8, dtype="<u4")
    pin = roundtrip(client, server, Pin(ns=ns, tokens=tokens))
    locate = roundtrip(client, server, Locate(ns=ns, tiers=["hbm"], tokens=tokens))
    reserve = roundtrip(client, server, Reserve(nbytes=64))
    lookup = roundtrip(client, server, Lookup(ns=ns, tokens=tokens))
    for req in (pin, locate, reserve, lookup):
        client.forget(req.id)
    located = LocateOk(handle=7, instance="i", start_block=0, blocks=[], tiers=[])
    reserved = ReserveOk(handle=9, instance="i", offset=0, nbytes=64, path="/p", size=64)
    assert client.receive(server.reply(lookup, LookupOk(1, 4, ["hbm"]))) is None  # holds nothing
    assert client.receive(server.reply(reserve, reserved)) is None
    assert client.receive(server.reply(pin, PinOk(handle=5, blocks=2))) is None
    assert client.receive(server.reply(locate, located)) is None
    assert client.unclaimed == [Finish(handle=9, used=0), Release(handle=5), Finish(handle=7, used=0)]
    # an error reply, a second reply to the same id, an id never sent: nothing to give back
    client.unclaimed.clear()
    again = roundtrip(client, server, Pin(ns=ns, tokens=tokens))
    client.forget(again.id)
    assert client.receive(server.error(PEER, again.id, "busy", "full", done=True)) is None
    assert client.receive(server.reply(again, PinOk(handle=6, blocks=2))) is None
    assert client.receive(server.reply(Request(PEER, 999, pin.msg), PinOk(handle=8, blocks=2))) is None
    assert client.unclaimed == []
    assert PinOk(handle=3, blocks=0).give_back() is None  # nothing pinned: nothing to let go


def test_forgotten_requests_looked_for_are_bounded() -> None:
    client, server, _ = joined()
    rids = [client.send(Reserve(nbytes=64))[0] for _ in range(CUT_KEPT + 1)]
    for rid in rids:
        client.forget(rid)
    for rid in (rids[0], rids[-1]):
        reply = ReserveOk(handle=rid, instance="i", offset=0, nbytes=64, path="/p", size=64)
        assert client.receive(server.reply(Request(PEER, rid, Reserve(nbytes=64)), reply)) is None
    assert client.unclaimed == [Finish(handle=rids[-1], used=0)]  # the oldest's lease lapses


def test_evict_fields_round_trip_with_defaults() -> None:
    client, server, _ = joined()
    req = roundtrip(client, server, Evict(session="conv-1", older_than=60.0, dry_run=True))
    assert req.msg == Evict(session="conv-1", older_than=60.0, dry_run=True)


def test_error_replies_become_library_exceptions_on_the_client() -> None:
    err = error_for_reply("layout", "shape mismatch")
    assert isinstance(err, LayoutError) and isinstance(err, ServerError) and err.code == "layout"
    other = error_for_reply("busy", "slow down")
    assert type(other) is ServerError and other.code == "busy"


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_field_names = st.sampled_from(
    [
        "ns",
        "tokens",
        "start_block",
        "max_blocks",
        "shape",
        "dtype",
        "session",
        "namespace",
        "older_than",
        "tier",
        "all",
        "dry_run",
        "to",
        "id",
        "v",
        "op",
        "junk",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    op=st.sampled_from([*REQUESTS, "nope"]),
    fields=st.dictionaries(_field_names, _values, max_size=6),
    payloads=st.lists(st.binary(max_size=64), max_size=2),
)
def test_any_header_is_either_a_request_or_a_remote_protocol_error(
    op: str, fields: dict, payloads: list
) -> None:
    """Whatever a peer sends, the server half answers with a typed request or a coded error, nothing else."""
    _, server, ns = joined()
    header = {"v": PROTOCOL_VERSION, "op": op, "id": 9, **fields}
    if fields.get("ns") == "registered":
        header["ns"] = ns
    try:
        req = server.receive(PEER, [msgpack.packb(header, use_bin_type=True), *payloads])
    except RemoteProtocolError as e:
        assert e.code and e.message
        assert server.inflight == {}
    else:
        assert req.msg.op == op and server.inflight == {PEER: 1}


def test_prefetch_slice_round_trip_and_old_style_request() -> None:
    from dataclasses import asdict

    from kvstore.results import PrefetchResult
    from kvstore.wire.messages import Prefetch

    client, server, _ = joined()
    req = roundtrip(client, server, Prefetch(session="conv-1", to="hbm", start_block=32, max_blocks=16))
    assert req.msg == Prefetch(session="conv-1", to="hbm", start_block=32, max_blocks=16)
    result = PrefetchResult(
        session="conv-1",
        to="hbm",
        moved=10,
        present=6,
        failed=0,
        start_block=32,
        blocks=100,
        remaining=52,
        bytes_moved=10 * 4096,
    )
    _, reply = answer(client, server.reply(req, DataOk(data=asdict(result))))
    assert isinstance(reply, DataOk) and PrefetchResult(**reply.data) == result
    # a request with only session and to (an older client) means the whole chain
    old = server.receive(
        PEER, raw({"v": PROTOCOL_VERSION, "op": "prefetch", "id": 9, "session": "s", "to": "ram"})
    )
    assert old.msg == Prefetch(session="s", to="ram", start_block=0, max_blocks=None)
    for bad in ({"start_block": -1}, {"max_blocks": "16"}):
        with pytest.raises(RemoteProtocolError) as info:
            server.receive(
                PEER, raw({"v": PROTOCOL_VERSION, "op": "prefetch", "id": 10, "session": "s", **bad})
            )
        assert info.value.code == "bad_header"


def test_engine_keys_travel_as_raw_bytes_in_place_of_tokens() -> None:
    client, server, ns = joined(Limits(max_message_bytes=1 << 20, max_tokens=16, max_inflight=8))
    keys = bytes(range(32)) * 3
    req = roundtrip(client, server, Lookup(ns=ns, keys=keys, parent=b"p" * 32))
    assert isinstance(req.msg, Lookup) and req.msg.tokens is None
    assert req.msg.keys == keys and req.msg.parent == b"p" * 32 and req.msg.chain.blocks(4) == 3
    # a put names as many blocks as it carries: 1 block of payload, 3 keys
    put = Put(ns=ns, keys=keys, shape=LAYOUT.shape(4), dtype="float16", kv=kv_bytes(1), start_block=2)
    assert isinstance(roundtrip(client, server, put).msg, Put)
    # exactly one of tokens and keys; a parent only with keys; whole keys; max_tokens counts T per key
    for bad, code in [
        (Lookup(ns=ns), "bad_header"),
        (Lookup(ns=ns, tokens=np.arange(4, dtype="<u4"), keys=keys), "bad_header"),
        (Lookup(ns=ns, tokens=np.arange(4, dtype="<u4"), parent=b"p" * 32), "bad_header"),
        (Lookup(ns=ns, keys=keys[:33]), "invalid_tokens"),
        (Lookup(ns=ns, keys=keys, parent=b"p"), "invalid_tokens"),
        (Lookup(ns=ns, keys=bytes(32) * 5), "too_many_tokens"),  # 5 keys * 4 tokens > 16
        (
            Put(ns=ns, keys=keys, shape=LAYOUT.shape(4), dtype="float16", kv=kv_bytes(1), start_block=3),
            "invalid_argument",
        ),
    ]:
        with pytest.raises(RemoteProtocolError) as info:
            roundtrip(client, server, bad)
        assert info.value.code == code, bad


def test_a_field_left_unset_is_not_sent_so_older_peers_still_read_the_message() -> None:
    # EvictOk gained not_done: sent as nil, an older client refused every evict reply (unknown field)
    from kvstore.wire.messages import EvictOk

    plain = EvictOk(blocks=1, bytes_freed={}, moved=0, keys=[])
    assert "not_done" not in plain.header_fields() and "displaced" not in plain.header_fields()
    assert EvictOk.from_fields(plain.header_fields(), []) == plain
    told = EvictOk(blocks=1, bytes_freed={}, moved=0, keys=[], not_done="the cluster is down", displaced=3)
    assert EvictOk.from_fields(told.header_fields(), []) == told
