"""Protocol benchmark: the daemon beside raw ZeroMQ on the same endpoint kind, and beside Redis.

Prints, in one run on one machine:
  1. lookup latency p50/p99 for 1K / 8K / 32K-token prompts that are stored (a full hit: the daemon
     hashes and finds every block) vs a raw DEALER/ROUTER round trip carrying the same request bytes
     (a Python ROUTER in another process, as the daemon is), and beside it the block keys the daemon
     computed, hashed here; then the same for prompts never stored (a miss at block 0: one block
     hashed); and the stored lookups with the prompt as a Python list beside an array;
  2. get and put throughput of a 4K-token prefix (SmolLM2-135M layout: 30 layers, 3 KV heads,
     head_dim 64, bf16: 94 MB) vs raw ZeroMQ moving the same bytes in one message, and vs the same
     blocks in a Redis server (unix socket, no persistence), one of each per round;
  3. get throughput with 1, 4 and 16 concurrent client processes.
Ratios are what to read: the machine is shared and noisy. Every client here uses the socket
(``shared_memory=False``): this is the path of tcp clients and the limit it chases is ZeroMQ's;
same-host clients move K/V through shared memory instead (bench/shm.py). Every process of the
bench's own runs one torch thread, so that kvstore's client and the Redis baseline copy blocks the
same way (``copy_into``: numpy's memcpy on the calling thread).

    .venv/bin/python bench/protocol.py [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from kvstore.client import KVStoreClient
from kvstore.daemon.endpoint import probe
from kvstore.keys import Namespace, block_keys
from kvstore.layout import KVLayout
from kvstore.memcopy import copy_into

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=64)
MODEL = "smollm2-135m-instruct"
PREFIX = 4096
LOOKUP_SIZES = (1024, 8192, 32768)
VOCAB = 49152
LOOKUP_SESSION = "lookup-prompt"


def raw_server(endpoint: str, reply_bytes: int) -> None:
    """A bare ROUTER: b"fetch" -> one ``reply_bytes`` frame (sent without copying), b"echo" -> the message
    back, anything else -> b"ok"."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    blob: Any = np.ones(reply_bytes, dtype=np.uint8)
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"stop":
            break
        if frames[1].bytes == b"fetch":
            sock.send_multipart([frames[0], b"", blob], copy=False)
        elif frames[1].bytes == b"echo":
            sock.send_multipart(frames, copy=False)
        else:
            sock.send_multipart([frames[0], b"ok"], copy=False)
    sock.close(linger=0)
    ctx.term()


class RawPeer:
    """A DEALER on ``raw_server``'s endpoint: ``ask`` sends one message and returns the reply."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)

    def ask(self, *frames: Any) -> list[zmq.Frame]:
        self.sock.send_multipart(list(frames), copy=False)
        return self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        """Stop the server and close this socket."""
        self.sock.send(b"stop")
        self.sock.close(linger=0)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def start_daemon(root: Path) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{root / 'run' / 'kv.sock'}"
    (root / "kvstore.toml").write_text(
        f'[server]\nendpoint = "{endpoint}"\nworkers = 4\nlog_level = "warning"\n'
        '[hbm]\ndevice = "cpu"\ncapacity = "1GiB"\n[ram]\ncapacity = "256MiB"\n'
        "[nvme]\nenabled = false\n"
    )
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.daemon", "--config", str(root / "kvstore.toml")])
    ctx = zmq.Context()
    deadline = time.monotonic() + 120
    while probe(ctx, endpoint, 200) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the daemon did not start")
        time.sleep(0.2)
    ctx.destroy(linger=0)
    return proc, endpoint


def start_redis(root: Path) -> tuple[subprocess.Popen, str] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        print("redis-server not found (apt-get install -y redis-server): Redis rows skipped")
        return None
    sock = str(root / "redis.sock")
    with socket.socket() as s:  # a free loopback port, though only the unix socket is used
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            sock,
            "--unixsocketperm",
            "700",
            "--dir",
            str(root),
            "--save",
            "",
            "--appendonly",
            "no",
            "--proto-max-bulk-len",
            "1gb",
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if time.monotonic() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.05)
    return proc, sock


class RedisPeer:
    """The prefix's blocks in Redis under their kvstore keys: ``put`` is a pipelined SET of every
    block, ``get`` an MGET and every block copied into one prefix tensor with ``copy_into``, the
    routine kvstore's client copies chunks with, so that both sides copy alike."""

    def __init__(self, socket_path: str, tokens: list[int], kv: torch.Tensor) -> None:
        import redis

        self.r = redis.Redis(unix_socket_path=socket_path)
        self.keys = block_keys(Namespace(model=MODEL, layout=LAYOUT), tokens)
        T = LAYOUT.block_tokens
        self.blocks = [
            kv[:, :, i * T : (i + 1) * T].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for i in range(len(self.keys))
        ]

    def put(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k, b in zip(self.keys, self.blocks, strict=True):
            pipe.set(k, b)
        pipe.execute()

    def get(self) -> torch.Tensor:
        T = LAYOUT.block_tokens
        out = torch.empty(LAYOUT.shape(len(self.keys) * T), dtype=torch.bfloat16)
        for i, v in enumerate(self.r.mget(self.keys)):
            with warnings.catch_warnings():  # read-only bytes: fine, the block is only copied from
                warnings.simplefilter("ignore")
                blk = torch.frombuffer(v, dtype=torch.bfloat16).view(LAYOUT.shape())
            copy_into(out[:, :, i * T : (i + 1) * T], blk)
        return out

    def close(self) -> None:
        self.r.close()


def concurrent_worker(endpoint: str, tokens: list[int], seconds: float, barrier: Any, out: Any) -> None:
    torch.set_num_threads(1)  # as the bench's main process: its copies are copy_into's memcpy
    with KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=60, shared_memory=False) as c:
        c.get(tokens)
        barrier.wait()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            assert c.get(tokens).matched_tokens == len(tokens)
            n += 1
        out.put((n, time.perf_counter() - t0))


def store_lookup_prompt(c: KVStoreClient, gen: torch.Generator) -> np.ndarray:
    """A prompt of the longest lookup size, stored in session LOOKUP_SESSION (zeros for K/V: a lookup
    reads none), so that the lookups of its 1K / 8K / 32K-token prefixes are full hits."""
    top = max(LOOKUP_SIZES)
    prompt = torch.randint(0, VOCAB, (top,), generator=gen).numpy().astype("<u4")
    c.put(prompt, torch.zeros(LAYOUT.shape(top), dtype=torch.bfloat16), session=LOOKUP_SESSION)
    if c.lookup(prompt).matched_tokens != top:
        raise SystemExit(f"the daemon did not keep the {top}-token lookup prompt (hbm too small?)")
    return prompt


def lookup_row(c: KVStoreClient, raw: RawPeer, prompt: np.ndarray, hashed: int, reps: int) -> str:
    """One row: ``c.lookup(prompt)`` beside a raw round trip of the same request bytes and beside
    hashing the ``hashed`` blocks the daemon hashes for it, the three interleaved."""
    ns, T = Namespace(model=MODEL, layout=LAYOUT), LAYOUT.block_tokens
    blob = prompt.tobytes() + bytes(64)  # the same request bytes, header included
    keyed = prompt[: hashed * T]
    c.lookup(prompt)
    ours, rt, keys = [], [], []
    for _ in range(reps):  # interleaved, so all three see the same machine
        ours += timed(lambda: c.lookup(prompt), 1)
        rt += timed(lambda: raw.ask(blob), 1)
        keys += timed(lambda: block_keys(ns, keyed), 1)
    p50, r50, k50 = pct(ours, 50), pct(rt, 50), pct(keys, 50)
    return (
        f"{len(prompt):>8} {p50 * 1e6:8.0f} {pct(ours, 99) * 1e6:8.0f} {r50 * 1e6:8.0f} "
        f"{pct(rt, 99) * 1e6:8.0f} {p50 / r50:8.2f} {hashed:>7} {k50 * 1e6:9.0f} {(p50 - k50) / r50:15.2f}"
    )


def lookup_latency(
    c: KVStoreClient, raw: RawPeer, stored: np.ndarray, gen: torch.Generator, reps: int
) -> None:
    head = (
        f"{'prompt':>8} {'p50':>8} {'p99':>8} {'raw p50':>8} {'raw p99':>8} {'p50/raw':>8} "
        f"{'hashed':>7} {'keys p50':>9} {'(p50-keys)/raw':>15}"
    )
    T = LAYOUT.block_tokens
    print("\n-- lookup latency, full hit: a stored prompt, every block hashed and found (us; interleaved) --")
    print(head)
    for n in LOOKUP_SIZES:
        assert c.lookup(stored[:n]).matched_tokens == n
        print(lookup_row(c, raw, stored[:n], n // T, reps))
    print(
        "\n-- lookup latency, miss at block 0: a prompt never stored, one block hashed (us; interleaved) --"
    )
    print(head)
    for n in LOOKUP_SIZES:
        fresh = torch.randint(0, VOCAB, (n,), generator=gen).numpy().astype("<u4")
        assert c.lookup(fresh).matched_tokens == 0
        print(lookup_row(c, raw, fresh, 1, reps))
    print(
        "  hashed: the blocks whose keys the daemon computes for that lookup (it stops at the first miss);"
        "\n  keys: computing those keys in this process; (p50-keys)/raw: the lookup without them, in round trips"
    )


def list_vs_array(c: KVStoreClient, stored: np.ndarray, reps: int) -> None:
    print(
        "\n-- full-hit lookup of a prompt given as a list (as vLLM and SGLang hold it) vs as an array (us) --"
    )
    print(f"{'prompt':>8} {'list p50':>9} {'array p50':>10} {'list/array':>11}")
    for n in LOOKUP_SIZES:
        arr = stored[:n]
        lst = arr.tolist()
        c.lookup(lst)
        as_list, as_array = [], []
        for _ in range(reps):  # interleaved, so both see the same machine
            as_list += timed(lambda p=lst: c.lookup(p), 1)
            as_array += timed(lambda p=arr: c.lookup(p), 1)
        l50, a50 = pct(as_list, 50), pct(as_array, 50)
        print(f"{n:>8} {l50 * 1e6:9.0f} {a50 * 1e6:10.0f} {l50 / a50:11.2f}")
    print("  the difference is the client converting and checking the list's ids")


def throughput(
    c: KVStoreClient,
    one: KVStoreClient,
    raw: RawPeer,
    redis_peer: RedisPeer | None,
    tokens: list[int],
    kv: torch.Tensor,
    moves: int,
) -> dict[str, float]:
    """GB/s of the prefix moved each way, the median of ``moves`` rounds that each run every way once
    (Redis's too), so that a noisy moment hits every figure alike."""
    payload = kv.view(-1).view(torch.uint8).numpy()
    runs: dict[str, Callable[[int], object]] = {
        "get": lambda i: c.get(tokens),
        "get16": lambda i: one.get(tokens),
        "rget": lambda i: raw.ask(b"fetch"),
        # a fresh prefix each round: a stored one would not be rewritten
        "put": lambda i: c.put([VOCAB + i, *tokens[1:]], kv),
        "put16": lambda i: one.put([2 * VOCAB + i, *tokens[1:]], kv),
        "rput": lambda i: raw.ask(b"send", payload),
        "echo": lambda i: raw.ask(b"echo", payload),
    }
    if redis_peer is not None:
        runs |= {"redis_get": lambda i: redis_peer.get(), "redis_put": lambda i: redis_peer.put()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(moves):
        for name, fn in runs.items():
            times[name] += timed(lambda f=fn, i=i: f(i), 1)
    gb = PREFIX * LAYOUT.bytes_per_token / 1e9
    return {name: gb / statistics.median(v) for name, v in times.items()}


# (label, key in the rates) of each kvstore figure; the peers' keys follow from the direction
THROUGHPUT_ROWS = (
    ("get (one message)", "get"),
    ("get (16-block chunks)", "get16"),
    ("put (one message)", "put"),
    ("put (16-block chunks)", "put16"),
)


def print_throughput(rate: dict[str, float]) -> None:
    print(f"{'':>26} {'kvstore':>8} {'raw 1-way':>9} {'ratio':>6} {'raw echo':>9} {'ratio':>6}")
    for name, key in THROUGHPUT_ROWS:
        peer = "r" + key[:3]  # the raw 1-way of the same direction
        print(
            f"{name:>26} {rate[key]:8.2f} {rate[peer]:9.2f} {rate[key] / rate[peer]:6.2f} "
            f"{rate['echo']:9.2f} {rate[key] / rate['echo']:6.2f}"
        )
    print("  raw 1-way: the same bytes in one message one way (tiny request or reply the other way);")
    print("  raw echo: the same bytes sent and sent back, counted once (bytes / round trip)")
    if "redis_get" not in rate:
        return
    print("\n-- vs Redis (same 64 blocks, unix socket, MGET / pipelined SET; in the rounds above) --")
    print(f"{'':>26} {'kvstore':>8} {'redis':>8} {'ratio':>6}")
    for name, key in THROUGHPUT_ROWS:
        peer = "redis_" + key[:3]
        print(f"{name:>26} {rate[key]:8.2f} {rate[peer]:8.2f} {rate[key] / rate[peer]:6.2f}")
    print(
        "  redis get: MGET, then each block copied into one prefix tensor by copy_into (one thread), as\n"
        "  kvstore's chunked get copies its chunks; kvstore's one-message get is the received frame, no copy"
    )


def concurrent_gets(endpoint: str, tokens: list[int], seconds: float) -> None:
    print("\n-- get throughput, concurrent client processes --")
    gb = PREFIX * LAYOUT.bytes_per_token / 1e9
    sp = mp.get_context("spawn")
    base = None
    for n in (1, 4, 16):
        barrier, out = sp.Barrier(n), sp.Queue()
        procs = [
            sp.Process(target=concurrent_worker, args=(endpoint, tokens, seconds, barrier, out))
            for _ in range(n)
        ]
        for p in procs:
            p.start()
        res = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        gets = sum(k for k, _ in res)
        rate = gets * gb / max(s for _, s in res)
        base = base or rate
        print(f"{n:>3} clients: {rate:6.2f} GB/s aggregate ({gets} gets), x{rate / base:.2f} of 1 client")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    # One torch thread: torch's copy_ on two threads collapses on busy cores, and copy_into (the
    # client's and the Redis baseline's copy) is numpy's memcpy on one thread only when torch has one.
    torch.set_num_threads(1)
    reps = 50 if args.quick else 300
    moves = 3 if args.quick else 8
    nbytes = PREFIX * LAYOUT.bytes_per_token
    root = Path(tempfile.mkdtemp(prefix="kvbench-"))
    os.chmod(root, 0o700)
    raw_ep = f"ipc://{root / 'raw.sock'}"
    raw_proc = mp.get_context("spawn").Process(target=raw_server, args=(raw_ep, nbytes), daemon=True)
    raw_proc.start()
    daemon, endpoint = start_daemon(root)
    redis_proc = start_redis(root)
    ctx = zmq.Context()
    raw = RawPeer(ctx, raw_ep)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYOUT.shape(PREFIX), generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (PREFIX,), generator=gen).tolist()
    redis_peer = RedisPeer(redis_proc[1], tokens, kv) if redis_proc is not None else None
    print(
        f"kvstore protocol benchmark; ipc endpoints; {os.cpu_count()} CPUs; prefix {PREFIX} tokens = "
        f"{nbytes / 1e6:.1f} MB ({LAYOUT.num_layers}L x {LAYOUT.num_kv_heads}H x {LAYOUT.head_dim}D bf16); "
        "daemon: hbm tier on CPU, nvme off"
    )
    print(
        f"torch threads in the bench's processes: {torch.get_num_threads()} (host copies: copy_into, one thread)"
    )
    try:
        with KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=60, shared_memory=False) as c:
            c.ping()
            stored = store_lookup_prompt(c, gen)
            lookup_latency(c, raw, stored, gen, reps)
            list_vs_array(c, stored, reps)
            # its 736 MiB would fill hbm: the puts below would then wait on demotions to ram (fp8)
            c.evict(session=LOOKUP_SESSION)
            assert c.lookup(stored).matched_tokens == 0

            print("\n-- 4K-token prefix throughput (GB/s; median of interleaved rounds) --")
            c.put(tokens, kv)
            back = c.get(tokens).kv
            assert back is not None and torch.equal(back, kv)
            if redis_peer is not None:
                redis_peer.put()
                assert torch.equal(redis_peer.get(), kv)
            with KVStoreClient(
                endpoint, model=MODEL, layout=LAYOUT, timeout=60, chunk_blocks=16, shared_memory=False
            ) as one:
                print_throughput(throughput(c, one, raw, redis_peer, tokens, kv, moves))
        concurrent_gets(endpoint, tokens, 1.5 if args.quick else 3.0)
    finally:
        raw.close()
        ctx.term()
        if redis_peer is not None:
            redis_peer.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        if redis_proc is not None:
            redis_proc[0].terminate()
            redis_proc[0].wait(30)
        raw_proc.join(5)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
