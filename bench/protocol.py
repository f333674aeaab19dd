"""Protocol benchmark: the daemon beside raw ZeroMQ on the same endpoint kind, and beside Redis.

Prints, in one run on one machine:
  1. lookup latency p50/p99 for 1K / 8K / 32K-token prompts vs a raw DEALER/ROUTER round trip
     carrying the same request bytes (a Python ROUTER in another process, as the daemon is),
     and the same lookups with the prompt as a Python list beside an array (the list/array ratio);
  2. get and put throughput of a 4K-token prefix (SmolLM2-135M layout: 30 layers, 3 KV heads,
     head_dim 64, bf16: 94 MB) vs raw ZeroMQ moving the same bytes in one message;
  3. get throughput with 1, 4 and 16 concurrent client processes;
  4. the same blocks stored in and fetched from a Redis server (unix socket, no persistence).
Ratios are what to read: the machine is shared and noisy. Every client here uses the socket
(``shared_memory=False``): this is the path of tcp clients and the limit it chases is ZeroMQ's;
same-host clients move K/V through shared memory instead (bench/shm.py).

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
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from kvstore.client import KVStoreClient
from kvstore.daemon.endpoint import probe
from kvstore.keys import Namespace, block_keys
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=64)
MODEL = "smollm2-135m-instruct"
PREFIX = 4096


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


def concurrent_worker(endpoint: str, tokens: list[int], seconds: float, barrier: Any, out: Any) -> None:
    with KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=60, shared_memory=False) as c:
        c.get(tokens)
        barrier.wait()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            assert c.get(tokens).matched_tokens == len(tokens)
            n += 1
        out.put((n, time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    reps = 50 if args.quick else 300
    moves = 3 if args.quick else 8
    nbytes = PREFIX * LAYOUT.bytes_per_token
    root = Path(tempfile.mkdtemp(prefix="kvbench-"))
    os.chmod(root, 0o700)
    raw_ep = f"ipc://{root / 'raw.sock'}"
    raw = mp.get_context("spawn").Process(target=raw_server, args=(raw_ep, nbytes), daemon=True)
    raw.start()
    daemon, endpoint = start_daemon(root)
    redis_proc = start_redis(root)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(raw_ep)

    def raw_ask(*frames: Any) -> list[zmq.Frame]:
        dealer.send_multipart(list(frames), copy=False)
        return dealer.recv_multipart(copy=False)

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYOUT.shape(PREFIX), generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, 49152, (PREFIX,), generator=gen).tolist()
    print(
        f"kvstore protocol benchmark; ipc endpoints; {os.cpu_count()} CPUs; prefix {PREFIX} tokens = "
        f"{nbytes / 1e6:.1f} MB ({LAYOUT.num_layers}L x {LAYOUT.num_kv_heads}H x {LAYOUT.head_dim}D bf16); "
        "daemon: hbm tier on CPU, nvme off"
    )
    try:
        with KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=60, shared_memory=False) as c:
            c.ping()
            print("\n-- lookup latency (us; ours and raw interleaved) --")
            print(
                f"{'prompt':>8} {'p50':>8} {'p99':>8} {'raw p50':>8} {'raw p99':>8} {'p50/raw':>8} "
                f"{'keys p50':>9} {'(p50-keys)/raw':>15}"
            )
            ns = Namespace(model=MODEL, layout=LAYOUT)
            for n in (1024, 8192, 32768):
                prompt = torch.randint(0, 49152, (n,), generator=gen).numpy().astype("<u4")
                blob = prompt.tobytes() + bytes(64)  # the same request bytes, header included
                c.lookup(prompt)
                ours, rt, hashing = [], [], []
                for _ in range(reps):
                    ours += timed(lambda p=prompt: c.lookup(p), 1)
                    rt += timed(lambda b=blob: raw_ask(b), 1)
                    hashing += timed(
                        lambda p=prompt: block_keys(ns, p), 1
                    )  # the chained SHA-256 a lookup must do
                p50, r50, k50 = pct(ours, 50), pct(rt, 50), pct(hashing, 50)
                print(
                    f"{n:>8} {p50 * 1e6:8.0f} {pct(ours, 99) * 1e6:8.0f} {r50 * 1e6:8.0f} "
                    f"{pct(rt, 99) * 1e6:8.0f} {p50 / r50:8.2f} {k50 * 1e6:9.0f} {(p50 - k50) / r50:15.2f}"
                )
            print(
                "  keys: computing the prompt's block keys in this process, which the daemon does per lookup"
            )
            print(
                "\n-- lookup of a prompt given as a list (as vLLM and SGLang hold it) vs as an array (us) --"
            )
            print(f"{'prompt':>8} {'list p50':>9} {'array p50':>10} {'list/array':>11}")
            for n in (1024, 8192, 32768):
                arr = torch.randint(0, 49152, (n,), generator=gen).numpy().astype("<u4")
                lst = arr.tolist()
                c.lookup(lst)
                as_list, as_array = [], []
                for _ in range(reps):  # interleaved, so both see the same machine
                    as_list += timed(lambda p=lst: c.lookup(p), 1)
                    as_array += timed(lambda p=arr: c.lookup(p), 1)
                l50, a50 = pct(as_list, 50), pct(as_array, 50)
                print(f"{n:>8} {l50 * 1e6:9.0f} {a50 * 1e6:10.0f} {l50 / a50:11.2f}")
            print("  the difference is the client converting and checking the list's ids")

            print("\n-- 4K-token prefix throughput (GB/s; median of interleaved runs) --")
            c.put(tokens, kv)
            back = c.get(tokens).kv
            assert back is not None and torch.equal(back, kv)
            payload = kv.view(-1).view(torch.uint8).numpy()
            one = KVStoreClient(
                endpoint, model=MODEL, layout=LAYOUT, timeout=60, chunk_blocks=16, shared_memory=False
            )
            t_get, t_get16, t_put, t_put16, t_rget, t_rput, t_echo = [], [], [], [], [], [], []
            for i in range(moves):
                t_get += timed(lambda: c.get(tokens), 1)
                t_get16 += timed(lambda: one.get(tokens), 1)
                t_rget += timed(lambda: raw_ask(b"fetch"), 1)
                fresh = [49152 + i] + tokens[1:]  # a fresh prefix: a stored one would not be rewritten
                t_put += timed(lambda f=fresh: c.put(f, kv), 1)
                fresh = [2 * 49152 + i] + tokens[1:]
                t_put16 += timed(lambda f=fresh: one.put(f, kv), 1)
                t_rput += timed(lambda: raw_ask(b"send", payload), 1)
                t_echo += timed(lambda: raw_ask(b"echo", payload), 1)
            one.close()
            gb = nbytes / 1e9
            rate = {
                k: gb / statistics.median(v)
                for k, v in {
                    "get": t_get,
                    "get16": t_get16,
                    "put": t_put,
                    "put16": t_put16,
                    "rget": t_rget,
                    "rput": t_rput,
                    "echo": t_echo,
                }.items()
            }
            get_gbs, put_gbs = rate["get"], rate["put"]
            print(f"{'':>26} {'kvstore':>8} {'raw 1-way':>9} {'ratio':>6} {'raw echo':>9} {'ratio':>6}")
            for name, key, peer in (
                ("get (one message)", "get", "rget"),
                ("get (16-block chunks)", "get16", "rget"),
                ("put (one message)", "put", "rput"),
                ("put (16-block chunks)", "put16", "rput"),
            ):
                print(
                    f"{name:>26} {rate[key]:8.2f} {rate[peer]:9.2f} {rate[key] / rate[peer]:6.2f} "
                    f"{rate['echo']:9.2f} {rate[key] / rate['echo']:6.2f}"
                )
            print("  raw 1-way: the same bytes in one message one way (tiny request or reply the other way);")
            print("  raw echo: the same bytes sent and sent back, counted once (bytes / round trip)")

        print("\n-- get throughput, concurrent client processes --")
        sp = mp.get_context("spawn")
        base = None
        for n in (1, 4, 16):
            barrier, out = sp.Barrier(n), sp.Queue()
            procs = [
                sp.Process(
                    target=concurrent_worker,
                    args=(endpoint, tokens, 3.0 if not args.quick else 1.5, barrier, out),
                )
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

        if redis_proc is not None:
            import redis

            r = redis.Redis(unix_socket_path=redis_proc[1])
            ns = Namespace(model=MODEL, layout=LAYOUT)
            keys = block_keys(ns, tokens)
            T = LAYOUT.block_tokens
            blocks = [
                kv[:, :, i * T : (i + 1) * T].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for i in range(len(keys))
            ]

            def redis_put() -> None:
                pipe = r.pipeline(transaction=False)
                for k, b in zip(keys, blocks, strict=True):
                    pipe.set(k, b)
                pipe.execute()

            def redis_get() -> torch.Tensor:
                vals = r.mget(keys)
                out = torch.empty(LAYOUT.shape(PREFIX), dtype=torch.bfloat16)
                for i, v in enumerate(vals):
                    with warnings.catch_warnings():  # read-only bytes: fine, the block is only copied from
                        warnings.simplefilter("ignore")
                        blk = torch.frombuffer(v, dtype=torch.bfloat16).view(LAYOUT.shape())
                    out[:, :, i * T : (i + 1) * T].copy_(blk)
                return out

            redis_put()
            assert torch.equal(redis_get(), kv)
            rput_t, rget_t = [], []
            for _ in range(moves):
                rput_t += timed(redis_put, 1)
                rget_t += timed(redis_get, 1)
            redis_get_gbs, redis_put_gbs = gb / statistics.median(rget_t), gb / statistics.median(rput_t)
            print("\n-- vs Redis (same 64 blocks, unix socket, MGET / pipelined SET) --")
            print(f"{'':>6} {'kvstore':>8} {'redis':>8} {'ratio':>6}")
            print(f"{'get':>6} {get_gbs:8.2f} {redis_get_gbs:8.2f} {get_gbs / redis_get_gbs:6.2f}")
            print(f"{'put':>6} {put_gbs:8.2f} {redis_put_gbs:8.2f} {put_gbs / redis_put_gbs:6.2f}")
    finally:
        dealer.send(b"stop")
        dealer.close(linger=0)
        ctx.term()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        if redis_proc is not None:
            redis_proc[0].terminate()
            redis_proc[0].wait(30)
        raw.join(5)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
