"""SGLang's HiCache L3 on kvstore: batch_set_v1 / batch_get_v1 of a 4K-token prefix beside memcpy.

Runs in SGLang's environment (``.engines/sglang/bin/python bench/sglang_backend.py``; SGLang 0.5.x on
the CPU torch). Builds SGLang's own host pool (MHATokenToKVPoolHost, ``device="cpu"``) of
SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64, bfloat16; page size 64: a 4096-token
prefix is 64 pages, 94 MB of K/V), the backend through SGLang's dynamic factory, and one daemon
subprocess (ipc, shared memory, hbm on the CPU, raw; nvme off). Prints per host layout, the median
of ``--repeat`` rounds after a warm-up, interleaved with its limit:

  memcpy       torch ``copy_`` of the same bytes between two preallocated, touched tensors
  set_v1       batch_set_v1 of the 64 pages (fresh page keys each round: new blocks), / memcpy
  get_v1       batch_get_v1 of the 64 pages into other host pages, / memcpy
  exists       batch_exists of the 64 pages (a control round trip), in microseconds

Ratios are what to read: the machine is shared and noisy.

    .engines/sglang/bin/python bench/sglang_backend.py [--repeat N] [--layouts page_first,...]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvstore.client import KVStoreClient

L, H, D, PAGE, TOKENS = 30, 3, 64, 64, 4096
sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # SGLang's objects: tests/engines/sglang/pools.py


@contextmanager
def daemon(root: Path) -> Iterator[str]:
    endpoint = f"ipc://{root / 'run' / 'kv.sock'}"
    config = root / "kvstore.toml"
    config.write_text(
        "[server]\n"
        f'endpoint = "{endpoint}"\nworkers = 2\nlog_level = "warning"\n'
        'shm_staging = "256MiB"\nshm_staging_per_client = "128MiB"\n'
        '[hbm]\ndevice = "cpu"\ncapacity = "1GiB"\n[ram]\ncapacity = "256MiB"\ncodec = "raw"\n'
        "[nvme]\nenabled = false\n[policy]\npromote_on_hit = false\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    with (root / "daemon.log").open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.daemon", "--config", str(config)], stdout=out, stderr=out, env=env
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with KVStoreClient(endpoint, timeout=1.0, retries=0) as c:
                    c.ping()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit((root / "daemon.log").read_text(errors="replace")) from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def host_pool(layout: str) -> Any:
    from tests.engines.sglang.pools import host_pool as make

    return make(layout, tokens=2 * TOKENS, page=PAGE, layers=L, heads=H, head_dim=D)


def backend(endpoint: str, pool: Any) -> Any:
    from tests.engines.sglang.pools import attach, storage_config

    return attach(storage_config(endpoint, model="smollm2-135m-instruct", layout=pool.layout), pool)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layouts", default="layer_first,page_first,page_first_direct")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = TOKENS // PAGE
    nbytes = 2 * L * TOKENS * H * D * 2
    print(
        f"SGLang HiCache L3 on kvstore: {TOKENS} tokens = {n} pages of {PAGE}, {nbytes / 1e6:.0f} MB (bf16)"
    )
    a = torch.randn(nbytes // 2).to(torch.bfloat16)
    b = torch.empty_like(a)
    b.copy_(a)
    with tempfile.TemporaryDirectory() as tmp, daemon(Path(tmp)) as endpoint:
        for layout in args.layouts.split(","):
            pool = host_pool(layout)
            store = backend(endpoint, pool)
            pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
            src = torch.arange(0, TOKENS, dtype=torch.int64)
            dst = torch.arange(TOKENS, 2 * TOKENS, dtype=torch.int64)
            rows: dict[str, list[float]] = {"memcpy": [], "set_v1": [], "get_v1": [], "exists": []}
            for r in range(args.repeat + 1):
                keys = [hashlib.sha256(f"{layout}/{r}/{i}".encode()).hexdigest() for i in range(n)]
                t_mem = timed(lambda: b.copy_(a))
                t_set = timed(partial(store.batch_set_v1, keys, src))
                t_get = timed(partial(store.batch_get_v1, keys, dst))
                t_ex = timed(partial(store.batch_exists, keys))
                ok = store.batch_get_v1(keys, dst)
                assert all(ok), "a page did not come back"
                store.clear()
                if r:  # the first round warms up
                    for k, t in zip(rows, (t_mem, t_set, t_get, t_ex), strict=True):
                        rows[k].append(t)
            med = {k: statistics.median(v) for k, v in rows.items()}
            gbs = {k: nbytes / med[k] / 1e9 for k in ("memcpy", "set_v1", "get_v1")}
            print(
                f"  {layout:18s} memcpy {gbs['memcpy']:5.2f} GB/s | batch_set_v1 {gbs['set_v1']:5.2f} GB/s "
                f"({gbs['set_v1'] / gbs['memcpy']:.0%} of memcpy) | batch_get_v1 {gbs['get_v1']:5.2f} GB/s "
                f"({gbs['get_v1'] / gbs['memcpy']:.0%}) | batch_exists {med['exists'] * 1e6:.0f} us"
                f" | shm {store.client.shared_memory}"
            )
            store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
