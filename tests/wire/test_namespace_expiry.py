"""Hello spam cannot lock real engines out of the namespace table for long.

Without CURVE a hello's tenant is whatever the client writes, so per-tenant
quotas do not stop one client from filling the daemon's table with invented
namespaces. A registration no put went through, unused for NAMESPACE_IDLE
seconds, is given up when a hello finds the table full; one that stored
blocks never is. The protocol objects are joined in memory (no sockets).

::

    t=0     writer: hello + put      reader: hello + lookup      spam fills the table
    t=60    newcomer: hello          -> quota_exceeded (the spam is fresh)
    t=idle  newcomer: hello          -> ok: spam and the idle reader given up, the writer kept
            reader: lookup           -> unknown_namespace; hello again -> ok
"""

from __future__ import annotations

import numpy as np

from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.wire.errors import RemoteProtocolError
from kvstore.wire.messages import ErrorReply, Hello, HelloOk, Lookup, LookupOk, Message, Put
from kvstore.wire.protocol import ClientProtocol, Limits, ServerProtocol
from kvstore.wire.registry import MAX_NAMESPACES, NAMESPACE_IDLE

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16", block_tokens=4)
PEER = b"peer"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hello(client: ClientProtocol, server: ServerProtocol, ns: Namespace) -> Message:
    _, frames = client.send(Hello(namespace=ns))
    got = client.receive(server.hello(server.receive(PEER, frames)))
    assert got is not None
    return got[1]


def lookup(client: ClientProtocol, server: ServerProtocol, ns: Namespace) -> Message:
    rid, frames = client.send(Lookup(ns=ns.id, tokens=np.arange(8, dtype=np.uint32)))
    try:
        request = server.receive(PEER, frames)
    except RemoteProtocolError as e:  # what the daemon answers as an error reply
        client.forget(rid)
        return ErrorReply(code=e.code, message=str(e))
    got = client.receive(server.reply(request, LookupOk(matched_blocks=0, matched_tokens=0, tiers=[])))
    assert got is not None
    return got[1]


def put(client: ClientProtocol, server: ServerProtocol, ns: Namespace) -> None:
    kv = np.zeros(LAYOUT.shape(4), dtype=np.float16).tobytes()
    msg = Put(ns=ns.id, tokens=np.arange(4, dtype=np.uint32), shape=LAYOUT.shape(4), dtype="float16", kv=kv)
    _, frames = client.send(msg)
    server.done(server.receive(PEER, frames).peer)  # validated; the store's answer is not the point


def test_hello_spam_locks_others_out_only_until_it_is_idle() -> None:
    clock = Clock()
    server = ServerProtocol(Limits(), server="test", namespaces_per_tenant=256, clock=clock)
    client = ClientProtocol()
    writer = Namespace("writer-model", LAYOUT, tenant="prod")
    reader = Namespace("reader-model", LAYOUT, tenant="prod")
    assert isinstance(hello(client, server, writer), HelloOk)
    put(client, server, writer)
    assert isinstance(hello(client, server, reader), HelloOk)
    assert isinstance(lookup(client, server, reader), LookupOk)
    # one client invents tenants (256 namespaces each, the per-tenant quota) until the table is full
    for i in range(MAX_NAMESPACES - 2):
        spam = Namespace(f"m{i}", LAYOUT, tenant=f"invented-{i // 256}")
        assert isinstance(hello(client, server, spam), HelloOk)
    newcomer = Namespace("new-model", LAYOUT, tenant="prod")
    clock.now += 60
    refused = hello(client, server, newcomer)
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    assert isinstance(lookup(client, server, reader), LookupOk)  # in use: kept

    clock.now += NAMESPACE_IDLE
    assert isinstance(hello(client, server, newcomer), HelloOk)
    # the spam went, and so did the reader, idle as long; blocks were put through the writer's: it stays
    assert set(server.namespaces) == {writer.id, newcomer.id}
    assert server.expired == (MAX_NAMESPACES - 2) + 1  # counted (the daemon's stats: namespaces_expired)
    gone = lookup(client, server, reader)
    assert isinstance(gone, ErrorReply) and gone.code == "unknown_namespace"  # KVStoreClient says hello again
    assert isinstance(hello(client, server, reader), HelloOk)
    assert isinstance(lookup(client, server, reader), LookupOk)


def test_a_tenant_at_its_quota_gets_room_from_its_own_idle_registrations() -> None:
    clock = Clock()
    server = ServerProtocol(Limits(), server="test", namespaces_per_tenant=2, clock=clock)
    client = ClientProtocol()
    a, b, c = (Namespace(f"m{i}", LAYOUT, tenant="alice") for i in range(3))
    assert isinstance(hello(client, server, a), HelloOk)
    assert isinstance(hello(client, server, b), HelloOk)
    put(client, server, a)
    refused = hello(client, server, c)
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    clock.now += NAMESPACE_IDLE - 1
    assert isinstance(hello(client, server, b), HelloOk)  # a hello again is a use
    clock.now += 2
    refused = hello(client, server, c)
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    clock.now += NAMESPACE_IDLE
    assert isinstance(hello(client, server, c), HelloOk)  # b was idle: its place is c's
    assert set(server.namespaces) == {a.id, c.id}


def test_a_registration_whose_blocks_are_all_gone_makes_room_once_idle() -> None:
    # an engine that names its weights anew at each weight sync (vLLM's reset, SGLang's update) put
    # blocks through each namespace: the table kept them all for good, and at the quota nothing of
    # the engine's was cached any more. One whose blocks went (evicted, expired) makes room
    clock = Clock()
    held: set[str] = set()
    server = ServerProtocol(Limits(), server="test", namespaces_per_tenant=2, clock=clock)
    client = ClientProtocol()
    old, current, synced = (Namespace(f"m+sync{i}", LAYOUT, tenant="rl") for i in range(3))
    for ns in (old, current):
        assert isinstance(hello(client, server, ns), HelloOk)
        put(client, server, ns)
        held.add(ns.id)
    clock.now += NAMESPACE_IDLE
    refused = hello(client, server, synced)  # no store says what is held yet: all kept
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    server.registry.holds = held.__contains__  # (the daemon's store, once it is open)
    refused = hello(client, server, synced)  # both still hold blocks
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    held.discard(old.id)  # the old weights' blocks were evicted
    held.discard(current.id)
    assert isinstance(lookup(client, server, current), LookupOk)  # in use: kept, blocks or not
    assert isinstance(hello(client, server, synced), HelloOk)
    assert set(server.namespaces) == {current.id, synced.id} and server.expired == 1
