"""Protocol fuzzing against a real daemon: whatever arrives, it stays up, answers, and stays small.

Two layers:

- hypothesis: headers built from every op and field name with values of any
  msgpack type, plus raw byte frames; each is sent and its one reply checked
  (a known reply op, or an error with a published code and the request's id).
- stress: 100,000+ messages sent from one DEALER in pipelined bursts (valid
  requests, byte-flipped and truncated ones, random bytes), every reply
  counted, the daemon's RSS sampled, and a well-behaved client putting and
  reading exact K/V on another socket the whole time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.wire.errors import ERROR_CODES
from kvstore.wire.messages import REPLIES, REQUESTS
from tests.daemon.conftest import Daemon
from tests.hardening.conftest import (
    NS,
    Background,
    Raw,
    T,
    assert_exact,
    client,
    endpoint_of,
    header,
    prefix_kv,
    random_tokens,
    rss_bytes,
    write_config,
)

FIELDS = sorted({name for cls in REQUESTS.values() for name in cls.schema} | {"v", "op", "id"})
REPLY_OPS = set(REPLIES) | {"error"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root: Path = tmp_path_factory.mktemp("fuzz")
    cfg = write_config(root, server={"max_message_bytes": "1MiB", "max_tokens_per_request": 4096})
    d = Daemon(cfg, endpoint_of(cfg)).wait_ready()
    try:
        yield d
    finally:
        assert d.proc.poll() is None, f"the daemon died under fuzzing:\n{d.output()[-5000:]}"
        assert d.stop() == 0, d.output()[-5000:]


def check_reply(reply: dict[str, Any], rid: Any) -> None:
    """One reply: a known op; an error carries a published code; a readable id comes back."""
    assert reply.get("op") in REPLY_OPS, reply
    if reply["op"] == "error":
        assert reply.get("code") in ERROR_CODES and reply["code"] != "internal", reply
        assert isinstance(reply.get("message"), str) and reply["message"]
    if (
        isinstance(rid, int)
        and not isinstance(rid, bool)
        and 0 <= rid < 2**64
        and reply.get("id") is not None
    ):
        assert reply["id"] == rid


# ---------------------------------------------------------------- hypothesis

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.binary(max_size=64)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
plausible = {  # values of the right type for the fields that matter, so validation goes deep
    "v": st.just(1) | values,
    "op": st.sampled_from(sorted(REQUESTS)) | values,
    "id": st.integers(0, 2**64 - 1) | values,
    "ns": st.just(NS.id) | values,
    "tokens": st.binary(max_size=64) | st.lists(st.integers(-5, 2**33), max_size=12) | values,
    # engine page keys (kvstore.chains.KeyChain): 32 bytes each, and the parent page's key
    "keys": st.binary(min_size=32, max_size=32) | st.binary(max_size=100) | values,
    "parent": st.binary(min_size=31, max_size=33) | values,
    "namespace": st.just(NS.to_dict()) | st.dictionaries(st.sampled_from(sorted(NS.to_dict())), values),
    "shape": st.lists(st.integers(-1, 9), min_size=5, max_size=5) | values,
    "dtype": st.sampled_from(["float16", "bfloat16", "float32", "int8", "nope"]) | values,
    # the shared-memory ops (locate, finish, reserve, commit) and the hello that asks for them
    "shm": st.booleans() | values,
    "nbytes": st.integers(0, 2**21) | values,
    "handle": st.integers(0, 2**63) | values,
    "used": st.integers(0, 64) | values,
    "tiers": st.lists(st.sampled_from(["hbm", "ram", "nvme", "", "x" * 40]), max_size=20) | values,
}
headers = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6).flatmap(
    lambda extra: st.fixed_dictionaries({k: plausible.get(k, values) for k in ("v", "op", "id")}).map(
        lambda base: {**base, **extra}
    )
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(h=headers, frames=st.lists(st.binary(max_size=256), max_size=2))
def test_any_header_gets_one_well_formed_reply(
    daemon: Daemon, h: dict[str, Any], frames: list[bytes]
) -> None:
    r = Raw(daemon.endpoint)
    try:
        r.sock.send_multipart([msgpack.packb(h, use_bin_type=True), *frames])
        check_reply(r.recv(), h.get("id"))
        assert not r.sock.poll(0)  # exactly one reply
    finally:
        r.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=512), min_size=1, max_size=4))
def test_random_bytes_get_an_error_reply(daemon: Daemon, frames: list[bytes]) -> None:
    r = Raw(daemon.endpoint)
    try:
        r.sock.send_multipart(frames)
        check_reply(r.recv(), None)
    finally:
        r.close()


@pytest.mark.parametrize("session", ["a\tb", "a\x7fb", "a\u2028b"])
def test_a_put_the_store_refuses_gets_a_published_code(daemon: Daemon, session: str) -> None:
    # the store's InvalidRequest reached the wire as "invalid_request", a code no client knows
    tokens = random_tokens(np.random.default_rng(5), 2)
    kv = prefix_kv(tokens)
    r = Raw(daemon.endpoint)
    try:
        assert r.ask(header("hello", 1, namespace=NS.to_dict()))["op"] == "hello"
        put = header(
            "put",
            2,
            ns=NS.id,
            tokens=tokens.tobytes(),
            shape=list(kv.shape),
            dtype="float16",
            session=session,
        )
        reply = r.ask(put, kv.numpy().tobytes())
        check_reply(reply, 2)
        assert reply["code"] == "invalid_argument" and "control character" in reply["message"]
    finally:
        r.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    nbytes=st.integers(0, 2**21),
    shape=st.lists(st.integers(0, 40), min_size=5, max_size=5),
    blocks=st.integers(0, 12),
    start=st.integers(0, 20),
    used=st.integers(0, 2**32),
    tiers=st.lists(st.sampled_from(["hbm", "ram", "nvme", "?"]), max_size=4),
    own_handle=st.booleans(),
    handle=st.integers(0, 2**63),
    by_keys=st.booleans(),
)
def test_shared_memory_exchanges_with_any_values_get_well_formed_replies(
    daemon: Daemon,
    nbytes: int,
    shape: list[int],
    blocks: int,
    start: int,
    used: int,
    tiers: list[str],
    own_handle: bool,
    handle: int,
    by_keys: bool,
) -> None:
    # hello with shm, reserve, commit into it (or into a handle never given), locate, finish; the
    # blocks named by token ids or by engine page keys (none at all when blocks is 0: an error)
    r = Raw(daemon.endpoint)
    rng = np.random.default_rng(blocks)
    names = {"keys": rng.bytes(32 * blocks)} if by_keys else {"tokens": random_tokens(rng, blocks).tobytes()}
    try:
        hello = r.ask(header("hello", rid=1, namespace=NS.to_dict(), shm=True))
        check_reply(hello, 1)
        reserve = r.ask(header("reserve", rid=2, nbytes=nbytes))
        check_reply(reserve, 2)
        h = reserve.get("handle", handle) if own_handle else handle
        commit = r.ask(
            header(
                "commit",
                rid=3,
                ns=NS.id,
                **names,
                shape=shape,
                dtype="float16",
                handle=h,
                start_block=start,
            )
        )
        check_reply(commit, 3)
        locate = r.ask(header("locate", rid=4, ns=NS.id, **names, start_block=start, tiers=tiers))
        check_reply(locate, 4)
        done = r.ask(header("finish", rid=5, handle=locate.get("handle", handle), used=used))
        check_reply(done, 5)
    finally:
        r.close()


# ---------------------------------------------------------------- stress

STRESS_MESSAGES = 100_000
STRESS_SECONDS = 300.0  # a bound for a machine far slower than expected; the count must still be reached
WINDOW = 512  # messages in flight from the fuzzing socket
RSS_GROWTH = 64 * 2**20  # allowed growth after warm-up; a leak of even 1 KiB per message would pass it


def templates(rng: np.random.Generator) -> list[list[bytes]]:
    """Messages to mutate: valid requests of every op, and garbage."""
    tokens = random_tokens(rng, 8)
    kv = prefix_kv(tokens[: 2 * T])
    tok = tokens.tobytes()
    keys = rng.bytes(32 * 8)
    valid = [
        [header("hello", 1, namespace=NS.to_dict())],
        [header("ping", 1)],
        [header("lookup", 1, ns=NS.id, tokens=tok)],
        [header("get", 1, ns=NS.id, tokens=tok, start_block=1, max_blocks=3)],
        [header("stats", 1)],
        [header("inspect", 1)],
        [header("inspect", 1, ns=NS.id, tokens=tok)],
        [header("evict", 1, all=True, dry_run=True)],
        [header("prefetch", 1, session="nope", to="ram")],
        [header("pin", 1, ns=NS.id, tokens=tok, lease=0.5)],
        [header("release", 1, handle=12345)],
        [header("flush", 1, timeout=0.01)],
        [
            header("put", 1, ns=NS.id, tokens=tok[: 8 * T], shape=list(kv.shape), dtype="float16"),
            kv.numpy().tobytes(),
        ],
        [header("lookup", 1, ns=NS.id, keys=keys)],
        [header("get", 1, ns=NS.id, keys=keys, start_block=1, max_blocks=3)],
        [
            header(
                "put", 1, ns=NS.id, keys=keys[:64], parent=keys[64:96], shape=list(kv.shape), dtype="float16"
            ),
            kv.numpy().tobytes(),
        ],
    ]
    garbage = [[rng.bytes(int(n))] for n in rng.integers(0, 200, 20)] + [[b""], [b"\x80"], [b"\xc1"]]
    bombs = [  # msgpack that claims more than it holds
        [b"\xdd\xff\xff\xff\xff"],
        [b"\xdf\xff\xff\xff\xff"],
        [b"\xc6\xff\xff\xff\xff"],
        [b"\x91" * 5000],
    ]
    return valid * 4 + garbage + bombs


def mutate(msg: list[bytes], rng: np.random.Generator, rid: int) -> list[bytes]:
    """A copy of ``msg`` under request id ``rid``, half the time with its header damaged."""
    head = msg[0]
    try:
        h = msgpack.unpackb(head, raw=False)
        if isinstance(h, dict) and "id" in h:
            h["id"] = rid
            head = msgpack.packb(h, use_bin_type=True)
    except Exception:  # garbage stays garbage
        pass
    roll = rng.random()
    if roll < 0.3 and head:
        b = bytearray(head)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(len(b)))] ^= int(rng.integers(1, 256))
        head = bytes(b)
    elif roll < 0.4 and head:
        head = head[: int(rng.integers(len(head)))]
    elif roll < 0.45:
        return [head, *msg[1:], rng.bytes(int(rng.integers(0, 64)))]  # a stray frame
    return [head, *msg[1:]]


def normal_client(endpoint: str) -> Any:
    """A well-behaved client: put a prefix, read it back exact, until stopped. Returns rounds done."""

    def run(stop: Any) -> int:
        rng = np.random.default_rng(7)
        rounds = 0
        with client(endpoint, timeout=30.0) as c:
            while not stop.is_set() or rounds < 3:
                tokens = random_tokens(rng, 6)
                r = c.put(tokens, prefix_kv(tokens), session="steady")
                assert not [f for f in r.failed if f[1] != "no_room"], r.failed
                got = c.get(tokens)
                assert_exact(tokens, got.kv, got.matched_tokens)  # may be short (fuzzed evicts), never wrong
                rounds += 1
                time.sleep(0.02)
        return rounds

    return run


@pytest.mark.stress
@pytest.mark.slow
def test_a_flood_of_fuzzed_messages(daemon: Daemon) -> None:
    rng = np.random.default_rng(2026)
    pool = templates(rng)
    steady = Background(normal_client(daemon.endpoint))
    raw = Raw(daemon.endpoint)
    sent = received = 0
    errors: dict[str, int] = {}
    warm_rss = None
    start = time.monotonic()
    try:
        while received < STRESS_MESSAGES:
            assert time.monotonic() - start < STRESS_SECONDS, f"only {received} replies in {STRESS_SECONDS}s"
            while sent < STRESS_MESSAGES and sent - received < WINDOW:
                msg = pool[int(rng.integers(len(pool)))]
                raw.sock.send_multipart(mutate(msg, rng, sent + 1))
                sent += 1
            # every message gets exactly one reply; wait for at least half the window back
            while sent - received > (WINDOW // 2 if sent < STRESS_MESSAGES else 0):
                assert raw.sock.poll(60000), (
                    f"no reply for 60s after {received} of {sent}:\n{daemon.output()[-3000:]}"
                )
                reply = msgpack.unpackb(raw.sock.recv_multipart()[0], raw=False)
                assert isinstance(reply, dict) and reply.get("op") in REPLY_OPS, reply
                if reply["op"] == "error":
                    assert reply["code"] in ERROR_CODES, reply
                    errors[reply["code"]] = errors.get(reply["code"], 0) + 1
                received += 1
            if warm_rss is None and received >= 10_000:
                warm_rss = rss_bytes(daemon.proc.pid)
        assert not raw.sock.poll(500), "a message got more than one reply"
        rounds = steady.join()
    finally:
        raw.close()
        steady.stop.set()
    assert daemon.proc.poll() is None
    assert warm_rss is not None
    end_rss = rss_bytes(daemon.proc.pid)
    print(
        f"\n{received} fuzzed messages in {time.monotonic() - start:.1f}s; errors by code {errors}; "
        f"{rounds} normal rounds; RSS {warm_rss / 2**20:.1f} -> {end_rss / 2**20:.1f} MiB"
    )
    assert end_rss - warm_rss < RSS_GROWTH
    assert rounds >= 3 and len(errors) >= 5  # the flood reached deep into validation
    assert "internal" not in errors, (
        f"{errors['internal']} request(s) broke inside the daemon:\n{daemon.output()[-5000:]}"
    )
    with client(daemon.endpoint) as c:  # and a fresh client is served as before
        assert c.ping()["pid"] == daemon.proc.pid
