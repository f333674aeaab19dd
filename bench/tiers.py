"""Tier and store throughput beside memcpy and raw LMDB; index lookup, memory and reopen at scale.

    .venv/bin/python bench/tiers.py [--blocks 24] [--repeat 5] [--index-blocks 1000000] [--threads 1] [--dir DIR]
                                    [--clock cpu|wall]

1. Throughput, in GB/s of native bytes of SmolLM2-135M blocks (30 layers x 2 x
   64 tokens x 3 KV heads x 64 dims, bfloat16 = 1.47 MB a block), of put and get
   on each tier and on the whole store (hashing and index included), beside
   ``clone()`` of the same blocks (a get returns a fresh tensor, so clone is its
   memcpy) and beside raw LMDB put/get of the very frames the nvme tier writes
   (one transaction per put; get = the frame's bytes copied out). Aims: hbm and
   ram (raw codec) get >= 50% of memcpy; nvme get >= 50% of raw LMDB reads with
   the same codec. Best of ``--repeat`` rounds, peer measured in the same round.
2. Lookup of a 32K-token prompt (512 blocks of 64 tokens, as the daemon cuts
   them) with 10K, 100K and 1M blocks indexed: it should stay flat (one SHA-256
   of 64 tokens and one dict probe per block).
3. Index memory per block (tracemalloc, aim <= 300 B) and the time to reopen a
   store of 1M blocks from LMDB (aim <= 10 s). The blocks but the lookup prompt's
   use a tiny layout (1 layer, 1 head, 8 dims, 4 tokens: 128-byte blocks) so that
   1M blocks take ~0.5 GB of disk and a minute to write; the index does not depend
   on the block size (it keeps no token ids). The lookup prompt's 512 blocks are
   of a layout as small but with 64-token blocks (LOOKUP: 2 KiB blocks), so that a
   lookup hashes what a real 32K-token prompt would.

One benchmark run prints every figure side by side, hence one file.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.args import bounded_int  # noqa: E402
from kvstore.codecs import get_codec  # noqa: E402
from kvstore.keys import Namespace, chain  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402
from kvstore.record import BlockRecord  # noqa: E402
from kvstore.results import EvictFilter  # noqa: E402
from kvstore.store.engine import Store  # noqa: E402
from kvstore.tiers.hbm import HbmTier  # noqa: E402
from kvstore.tiers.nvme import NvmeTier  # noqa: E402
from kvstore.tiers.ram import RamTier  # noqa: E402

SMOL = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=64)
TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16", block_tokens=4)
# the lookup prompt's blocks: tiny, but of the daemon's 64 tokens, since a lookup hashes every token
LOOKUP = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16", block_tokens=64)
LOOKUP_BLOCKS = 512  # 32K tokens
GB = 1e9


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


def best_pair(
    fn: Callable[[], object],
    peer: Callable[[], object],
    repeat: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Best time of ``fn`` and of ``peer`` over ``repeat`` rounds, run alternately (same conditions)."""
    a, b = [], []
    for _ in range(repeat):
        t = clock()
        peer()
        b.append(clock() - t)
        t = clock()
        fn()
        a.append(clock() - t)
    return min(a), min(b)


def line(name: str, nbytes: int, secs: float, peer: float, peer_name: str) -> None:
    print(
        f"  {name:<30} {nbytes / secs / GB:7.2f} GB/s   {peer_name:<14} {nbytes / peer / GB:7.2f} GB/s"
        f"   ratio {peer / secs:5.2f}"
    )


def throughput(n: int, repeat: int, root: Path, clock_name: str = "cpu") -> None:
    """``clock_name``: "cpu" (this thread's CPU time: every case runs in the calling thread with one
    torch thread, so on a shared machine it drops the time spent waiting for a core) or "wall"."""
    clock = CLOCKS[clock_name]
    print(
        f"\n== throughput: {n} SmolLM2 blocks of {SMOL.block_nbytes / 1e6:.2f} MB "
        f"({n * SMOL.block_nbytes / 1e6:.0f} MB a pass), best of {repeat} alternating rounds, "
        f"{clock_name} time =="
    )
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(SMOL.shape(), generator=g).to(torch.bfloat16) for _ in range(n)]
    dst = [torch.empty_like(b) for b in blocks]
    keys = [i.to_bytes(32, "big") for i in range(n)]
    total = n * SMOL.block_nbytes

    def copy() -> None:  # the peer of a put: bytes into memory that exists
        for d, b in zip(dst, blocks, strict=True):
            d.copy_(b)

    def clone() -> None:  # the peer of a get: a fresh tensor holding the bytes
        for b in blocks:
            b.clone()

    def tier_case(name: str, tier: Any) -> None:
        def put() -> None:
            for k, b in zip(keys, blocks, strict=True):
                tier.put(k, b)

        def get() -> None:
            for k in keys:
                tier.get(k)

        line(f"{name} put", total, *best_pair(put, copy, repeat, clock), "memcpy")
        line(f"{name} get", total, *best_pair(get, clone, repeat, clock), "memcpy(clone)")
        tier.close()

    page = 1 << 20
    cap = (SMOL.block_nbytes // page + 2) * page * n
    tier_case("hbm (cpu pool)", HbmTier(cap, page_bytes=page))
    tier_case("ram raw", RamTier(cap, get_codec("raw"), page_bytes=page, pin_memory=False))
    tier_case("ram fp8", RamTier(cap, get_codec("fp8"), page_bytes=page, pin_memory=False))

    def nvme_case(codec_name: str, params: dict[str, Any]) -> None:
        tier = NvmeTier(root / f"nvme-{codec_name}", 4 * cap, get_codec(codec_name, **params))
        for k, b in zip(keys, blocks, strict=True):
            tier.put(k, b)
        frames = [tier.get_frame(k) for k in keys]
        env = lmdb.open(str(root / f"lmdb-{codec_name}"), map_size=8 * cap, sync=False, metasync=False)

        def put() -> None:
            for k, b in zip(keys, blocks, strict=True):
                tier.put(k, b)

        def get() -> None:
            for k in keys:
                tier.get(k)

        def raw_put() -> None:
            for k, f in zip(keys, frames, strict=True):
                with env.begin(write=True) as txn:
                    txn.put(k, f)

        def raw_get() -> None:
            with env.begin(buffers=True) as txn:
                for k in keys:
                    bytes(txn.get(k) or b"")

        label = f"nvme {codec_name}{'+zstd' if params else ''}"
        line(f"{label} put", total, *best_pair(put, raw_put, repeat, clock), "raw LMDB put")
        line(f"{label} get", total, *best_pair(get, raw_get, repeat, clock), "raw LMDB get")
        print(f"  {'':<30} (frames are {sum(map(len, frames)) / total:.3f} of the native bytes)")
        tier.close()
        env.close()

    nvme_case("raw", {})
    nvme_case("int4", {"zstd": 3})

    # The whole store: hashing, index, pins, hbm copies (no nvme: LMDB is measured above).
    ns = Namespace("smollm2-135m-instruct", SMOL)
    store = Store(
        HbmTier(cap, page_bytes=page), RamTier(cap, get_codec("fp8"), page_bytes=page, pin_memory=False), None
    )
    toks = list(range(n * SMOL.block_tokens))
    kv = torch.cat(blocks, dim=2)
    whole = torch.empty_like(kv)
    store.put(ns, toks, kv)
    line(
        "store put (present: touch)",
        total,
        *best_pair(lambda: store.put(ns, toks, kv), lambda: whole.copy_(kv), repeat, clock),
        "memcpy",
    )
    line(
        "store get (from hbm)",
        total,
        *best_pair(lambda: store.get(ns, toks), lambda: kv.clone(), repeat, clock),
        "memcpy(clone)",
    )
    store.close()
    store = Store(
        HbmTier(cap, page_bytes=page), RamTier(cap, get_codec("fp8"), page_bytes=page, pin_memory=False), None
    )

    def fresh_put() -> None:
        store.evict(EvictFilter(all=True))
        store.put(ns, toks, kv)

    line(
        "store put (new, into hbm)",
        total,
        *best_pair(fresh_put, lambda: whole.copy_(kv), repeat, clock),
        "memcpy",
    )
    store.close()


def write_prompt(tier: NvmeTier, ns: Namespace, toks: list[int], stamp: float) -> None:
    """One prompt's whole blocks, chained from the namespace root, straight into ``tier`` (raw frames)."""
    T = ns.layout.block_tokens
    frame = bytes(get_codec("raw").encode(torch.randn(ns.layout.shape()).to(torch.bfloat16)))
    parent = ns.root()
    for i in range(len(toks) // T):
        blk = np.asarray(toks[i * T : (i + 1) * T], dtype="<u4")
        key = chain(parent, blk)
        rec = BlockRecord(
            key=key,
            parent=parent,
            namespace=ns.id,
            position=i,
            tokens=blk.tobytes(),
            created=stamp,
            last_access=stamp,
        )
        tier.put_frame(key, frame, rec)
        parent = key


def fill_nvme(path: Path, n: int) -> tuple[Namespace, list[int]]:
    """Write ``n`` blocks through NvmeTier.put_frame: first the lookup prompt (up to LOOKUP_BLOCKS blocks
    of 64 tokens, namespace of LOOKUP), then tiny blocks as prompts of 512 blocks. Returns the lookup
    prompt and its namespace."""
    ns, tiny = Namespace("bench-lookup", LOOKUP), Namespace("bench-tiny", TINY)
    tier = NvmeTier(path, 4 << 30, get_codec("raw"))
    for space in (ns, tiny):
        tier.put_namespace(space.id, space.to_dict())
    now = time.time()
    first = list(range(min(LOOKUP_BLOCKS, n) * LOOKUP.block_tokens))
    write_prompt(tier, ns, first, now)
    t0 = time.perf_counter()
    done, prompt = len(first) // LOOKUP.block_tokens, 1
    while done < n:
        length = min(512, n - done)
        write_prompt(
            tier, tiny, [prompt * 1_000_003 + i for i in range(length * TINY.block_tokens)], now + prompt
        )
        done += length
        prompt += 1
        if prompt % 200 == 0:
            print(f"    ... {done} blocks written ({time.perf_counter() - t0:.0f} s)", flush=True)
    tier.close()
    return ns, first


def open_store(path: Path) -> Store:
    return Store(
        HbmTier(1 << 20, page_bytes=4096),
        RamTier(1 << 20, get_codec("raw"), page_bytes=4096, pin_memory=False),
        NvmeTier(path, 4 << 30, get_codec("raw")),
        tick=3600.0,
    )


def lookup_time(store: Store, ns: Namespace, toks: list[int], repeat: int = 20) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        r = store.lookup(ns, toks)
        times.append(time.perf_counter() - t)
    assert r.matched_blocks == len(toks) // ns.layout.block_tokens, r.matched_blocks
    return statistics.median(times)


def lookup_beside(
    store: Store, ns: Namespace, toks: list[int], admin: Callable[[], Any], seconds: float
) -> float:
    """Median lookup time while another thread runs ``admin`` in a loop for ``seconds``."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            admin()

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    times = []
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            store.lookup(ns, toks)
            times.append(time.perf_counter() - t)
            time.sleep(0.002)
    finally:
        stop.set()
        worker.join()
    return statistics.median(times)


def interference(store: Store, ns: Namespace, toks: list[int], blocks: int) -> None:
    """What an operator or tenant looping on stats does to another tenant's lookups."""
    alone = lookup_beside(store, ns, toks, lambda: time.sleep(0.001), 2.0)
    stats = lookup_beside(store, ns, toks, lambda: (store.stats(), store.usage(), store.sessions()), 2.0)
    walk = lookup_beside(
        store, ns, toks, lambda: store.evict(EvictFilter(tenant="nobody"), dry_run=True), 2.0
    )
    print(
        f"\n  lookup of a {len(toks)}-token prompt ({len(toks) // ns.layout.block_tokens} blocks) with "
        f"{blocks} blocks indexed, p50 while another thread loops:"
    )
    print(f"    nothing                          {alone * 1e3:8.3f} ms")
    print(f"    stats + usage + sessions         {stats * 1e3:8.3f} ms   {stats / alone:6.2f} x alone")
    print(
        f"    a walk of the index (dry evict)  {walk * 1e3:8.3f} ms   {walk / alone:6.2f} x alone"
        "   (how tenant stats were counted before)"
    )


def scale(index_blocks: int, root: Path) -> None:
    print(
        f"\n== index at scale (tiny layout: {TINY.block_nbytes} B blocks of {TINY.block_tokens} tokens; lookups "
        f"of a {LOOKUP_BLOCKS * LOOKUP.block_tokens}-token prompt = {LOOKUP_BLOCKS} blocks of "
        f"{LOOKUP.block_tokens} tokens, indexed beside them) =="
    )
    sizes = [s for s in (10_000, 100_000, 1_000_000) if s < index_blocks] + [index_blocks]
    results = []
    for n in sizes:
        path = root / f"index-{n}"
        t = time.perf_counter()
        ns, first = fill_nvme(path, n)
        fill = time.perf_counter() - t
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        store = open_store(path)
        reopen, reopen_cpu = time.perf_counter() - t, time.process_time() - c
        look = lookup_time(store, ns, first)
        if n == min(sizes, key=lambda x: abs(x - 128_000)):
            interference(store, ns, first, store.stats().blocks)
        store.close()
        del store
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        store = open_store(path)
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        blocks = store.stats().blocks
        store.close()
        del store
        gc.collect()
        results.append((n, blocks, fill, reopen, look, held / max(blocks, 1), reopen_cpu))
        shutil.rmtree(path, ignore_errors=True)
    lookup_head = f"lookup {len(first) // 1024}K" if len(first) >= 1024 else f"lookup {len(first)}"
    print(f"  {'blocks':>9} {'write':>8} {'reopen':>8} {'(cpu)':>8} {lookup_head:>11} {'index B/block':>14}")
    for _n, blocks, fill, reopen, look, per, cpu in results:
        print(f"  {blocks:>9} {fill:7.1f}s {reopen:7.2f}s {cpu:7.2f}s {look * 1e3:9.3f}ms {per:13.0f}")
    base_look = results[0][4]
    print(
        "  lookup flat?  "
        + ", ".join(f"{r[1]}: {r[4] / base_look:.2f} x" for r in results)
        + f" of the {results[0][1]}-block time"
    )
    n, blocks, _, reopen, _, per, cpu = results[-1]
    print(
        f"  aims: index {per:.0f} B/block ({per / 300:.2f} x the 300 B aim); "
        f"reopen of {blocks} blocks {reopen:.2f} s ({reopen / 10:.2f} x the 10 s aim; {cpu:.2f} s of CPU)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=bounded_int(1), default=24, help="SmolLM2 blocks per throughput pass")
    ap.add_argument("--repeat", type=bounded_int(1), default=5)
    ap.add_argument(
        "--index-blocks",
        type=bounded_int(LOOKUP_BLOCKS + 1),
        default=1_000_000,
        help="largest index for the scale part",
    )
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument(
        "--threads",
        type=bounded_int(1),
        default=1,
        help="torch intra-op threads (default 1: with several busy cores, more only adds waiting)",
    )
    ap.add_argument("--dir", type=Path, default=None, help="where LMDB files go (default: a temp dir)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="throughput timed in this thread's CPU time (default; steady on a shared machine) or wall",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; files under {root}")
    try:
        if not args.skip_throughput:
            throughput(args.blocks, args.repeat, root, args.clock)
        if not args.skip_scale:
            scale(args.index_blocks, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
