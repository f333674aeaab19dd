"""The daemon's memory for requests in flight is bounded whatever the number of connections.

    8 connections x 24 puts of 2 MiB, sent without waiting (384 MiB offered at once)
    budget: max_inflight_bytes = max_inflight_bytes_per_tenant = 16 MiB
    ->  every request answered once: stored, or busy (never dropped)
        the daemon's peak RSS grows by far less than what was offered
        the daemon goes on serving

Before the budget, only max_inflight_per_client bounded this: each connection could park 64
requests in the worker queue (eight connections of 8 MiB puts took a daemon from 231 MiB to
4.1 GiB).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from tests.hardening.conftest import Raw, endpoint_of, header, rss_bytes, write_config
from tests.hardening.test_memory import status

MiB = 2**20
CONNECTIONS, PUTS, PUT_BYTES = 8, 24, 2 * MiB
BUDGET = 16 * MiB
# 64 KiB blocks, 32 to a put
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", block_tokens=16)
NS = Namespace(model="inflight-model", layout=BIG)
BLOCKS = PUT_BYTES // BIG.block_nbytes


def budget_config(tmp_path: Path, **server: object) -> Path:
    """A daemon of 16 MiB tiers whose in-flight budgets are BUDGET, daemon-wide and per tenant."""
    return write_config(
        tmp_path,
        server={
            "max_inflight_bytes": f"{BUDGET // MiB}MiB",
            "max_inflight_bytes_per_tenant": f"{BUDGET // MiB}MiB",
            "max_message_bytes": "4MiB",
            **server,
        },
        hbm={"capacity": "16MiB"},
        ram={"capacity": "16MiB"},
        nvme={"enabled": False},
        policy={"page_bytes": "64KiB"},
    )


def prefix_payload() -> tuple[torch.Tensor, bytes]:
    """The K/V of a PUT_BYTES prefix and its bytes as a put carries them."""
    kv = torch.randn(BIG.shape(BLOCKS * BIG.block_tokens)).to(torch.float16)
    return kv, kv.view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.slow
def test_many_connections_pushing_big_puts_stay_within_the_budget(daemons, tmp_path: Path) -> None:
    cfg = budget_config(tmp_path, workers=1)
    d = daemons(cfg)
    pid = d.proc.pid
    kv, payload = prefix_payload()
    assert len(payload) == PUT_BYTES
    conns = [Raw(endpoint_of(cfg)) for _ in range(CONNECTIONS)]
    try:
        for r in conns:
            assert r.ask(header("hello", 1, namespace=NS.to_dict()))["op"] == "hello"
        base = rss_bytes(pid)
        rng = np.random.default_rng(0)
        for i in range(PUTS):  # every connection pushes its puts without waiting for replies
            for r in conns:
                tokens = rng.integers(0, 50000, size=BLOCKS * BIG.block_tokens, dtype=np.uint32)
                r.sock.send_multipart(
                    [
                        header(
                            "put",
                            10 + i,
                            ns=NS.id,
                            tokens=tokens.tobytes(),
                            start_block=0,
                            shape=list(kv.shape),
                            dtype=BIG.dtype,
                        ),
                        payload,
                    ],
                    copy=False,
                )
        codes: dict[str, int] = {}
        for r in conns:
            replies = [r.recv(60000) for _ in range(PUTS)]
            assert sorted(x["id"] for x in replies) == list(range(10, 10 + PUTS))  # each answered once
            for x in replies:
                key = x["op"] if x["op"] != "error" else x["code"]
                codes[key] = codes.get(key, 0) + 1
        peak = status(pid)["VmHWM"]
        offered = CONNECTIONS * PUTS * PUT_BYTES
        grew = peak - base
        print(f"\nRSS grew {grew / MiB:.0f} MiB, {offered / MiB:.0f} MiB offered; replies {codes}")
        # the budget, the frames ZeroMQ has read off the sockets and the loop not yet refused, and slack for
        # the allocator. The middle term depends on how far the loop lags: 48-114 MiB on a quiet machine,
        # 145-198 MiB a few times on two busy cores. Without the budget every request is parked: the
        # whole 384 MiB and more. Two thirds of what was offered tells the two apart.
        assert grew < offered * 2 // 3, f"RSS grew {grew / MiB:.0f} MiB with {offered / MiB:.0f} MiB offered"
        assert set(codes) <= {"put", "busy"}, codes
        assert codes.get("busy", 0) > 0 and codes.get("put", 0) > 0, codes
        # and it goes on serving: a request now is taken
        ok = conns[0].ask(header("lookup", 999, ns=NS.id, tokens=bytes(4 * BIG.block_tokens)))
        assert ok["op"] == "lookup"
    finally:
        for r in conns:
            r.close()


@pytest.mark.slow
def test_a_client_that_never_reads_its_replies_holds_no_more_than_the_budget(daemons, tmp_path: Path) -> None:
    """one connection (max_inflight_per_client = 4): 320 gets of a 2 MiB prefix sent, no reply read
    ->  ZeroMQ queues 4 replies; the daemon holds those it cannot send within the tenant's budget,
        refusing the rest busy (before: ZeroMQ queued up to 1000 replies per connection)
        another tenant is served meanwhile
        once the client reads, every get has exactly one reply, and the replies served are exact"""
    # the daemon's budget twice a tenant's, as by default: another tenant has room beside this one's
    cfg = budget_config(tmp_path, max_inflight_per_client=4, max_inflight_bytes=f"{2 * BUDGET // MiB}MiB")
    d = daemons(cfg)
    pid = d.proc.pid
    kv, payload = prefix_payload()
    tokens = np.arange(BLOCKS * BIG.block_tokens, dtype=np.uint32).tobytes()
    reader = Raw(endpoint_of(cfg))
    reader.sock.rcvhwm = 1  # what it does not read stays with the daemon, not in this process
    reader.sock.rcvbuf = 64 * 1024
    try:
        assert reader.ask(header("hello", 1, namespace=NS.to_dict()))["op"] == "hello"
        put = header("put", 2, ns=NS.id, tokens=tokens, start_block=0, shape=list(kv.shape), dtype=BIG.dtype)
        assert reader.ask(put, payload)["op"] == "put"
        base = rss_bytes(pid)
        gets = 320
        for i in range(gets):  # sent about as fast as the daemon serves them: most are taken
            reader.sock.send(header("get", 10 + i, ns=NS.id, tokens=tokens, start_block=0))
            time.sleep(0.005)
        time.sleep(1.0)
        grew = status(pid)["VmHWM"] - base
        offered = gets * PUT_BYTES
        # another tenant is served meanwhile: the unread replies hold their own tenant's budget only
        other_ns = Namespace(model="inflight-model", layout=BIG, tenant="other")
        other = Raw(endpoint_of(cfg))
        try:
            assert other.ask(header("hello", 1, namespace=other_ns.to_dict()))["op"] == "hello"
            put = header(
                "put", 2, ns=other_ns.id, tokens=tokens, start_block=0, shape=list(kv.shape), dtype=BIG.dtype
            )
            assert other.ask(put, payload)["op"] == "put"
            assert other.ask(header("get", 3, ns=other_ns.id, tokens=tokens, start_block=0))["op"] == "get"
        finally:
            other.close()
        replies = [reader.recv(60000) for _ in range(gets)]
        assert sorted(x["id"] for x in replies) == list(range(10, 10 + gets))  # each answered once
        assert not reader.sock.poll(300)
        codes: dict[str, int] = {}
        for x in replies:
            key = x["op"] if x["op"] != "error" else x["code"]
            codes[key] = codes.get(key, 0) + 1
        print(
            f"\nRSS grew {grew / MiB:.0f} MiB with {offered / MiB:.0f} MiB of replies unread; replies {codes}"
        )
        # the budget, the replies ZeroMQ holds for the connection (4, one being written), and slack
        assert grew < BUDGET + 6 * PUT_BYTES + 64 * MiB, f"RSS grew {grew / MiB:.0f} MiB"
        assert set(codes) <= {"get", "busy"} and codes.get("get", 0) > 0, codes
        reader.sock.send(header("get", 999, ns=NS.id, tokens=tokens, start_block=0))
        assert reader.sock.poll(10000)
        served = reader.sock.recv_multipart()  # and it goes on serving, exact bytes
        assert len(served) == 2 and served[1] == payload
    finally:
        reader.close()
