"""Cross-host reads through the cluster tier: SmolLM2's 2K-token prefix stored by host A, read by host B.

    .venv/bin/python bench/cluster.py [--tokens 2048] [--tail 16] [--repeat 7] [--lookups 200]

Setup (all on this machine, loopback only): a Redis Cluster of 3 masters from Debian's
redis-server (tests/cluster/rediscluster.py), and two ``kvstore serve`` daemons A and B with
their own sockets and LMDB paths, both on the cluster (``[cluster]`` with the default codecs: int4
+ zstd, block 0 at int8, as on nvme). A computes the prefix (the recompute baseline), stores it
and writes it through to the cluster; B has never seen it.

    --codecs   the cluster's codecs: "default" (nvme's: int4 + zstd 3, block 0 int8), "raw" (the bytes
               as stored, + zstd 3) and "raw-nozstd" (``zstd = 0``: what the store itself costs, with
               no codec work in the way but a copy and a checksum); also int8, fp8
    get        B's ``get`` of the prefix with B's own tiers empty (``evict --all`` on B before each
               run): one pipelined round trip per 8 blocks, every frame checked and decoded, and the
               blocks stored on B (after B has answered: not timed, but waited for before the next
               figure); and ``get_into`` an engine's buffer (allocated once, as an engine's
               paged cache is: no fresh memory to fault in). Timed until the call returns: the
               blocks are in place and checked; the lease's end it sends then is answered while the
               caller goes on (its reply is awaited by the client's next call, not timed). Beside
               them, measured in the same rounds
               (one of each per round, so that a noisy moment hits every figure alike):
      plain    a redis-py RedisCluster pipelined GET of the same keys: the same bytes, nothing done
               with them (what a client of the cluster alone would pay to move them); and the same GET
               by a redis-py tuned to read 1 MiB from the socket at a time (its default: 64 KiB)
      decode   checking and decoding the same frames here (two at a time, on two threads, as the
               daemon does, with the daemon's malloc settings), timed alone; from it and the faster
               GET: "GET then decode, serial" (their sum: a get that overlapped nothing) and the
               overlapped floor (the larger of the two: B fetches later frames while it decodes
               earlier ones, so no get that serves K/V can beat it, and one that overlaps perfectly
               reaches it)
    lookup     B's ``lookup`` of the prefix (a local miss the cluster answers), against one cluster
               round trip two ways, interleaved with the lookups: redis-py's pipelined EXISTS of the
               same keys (its Python per command included) and one PING of one node (the round trip
               alone); and a lookup B answers from its own tiers
    TTFT       B's time to first token reading the prefix from the cluster (fetch, build the cache,
               compute the tail) against recomputing the whole prompt, and the quality of that cache
               (KL of the tail's next-token distributions vs recomputing, and top-1 agreement)

Ratios, not absolute times, are the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.args import bounded_int  # noqa: E402
from bench.e2e import Daemon, compare, recompute, reuse, text_tokens, timed  # noqa: E402
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.codecs import decode_frame  # noqa: E402
from kvstore.daemon.heap import keep_scratch  # noqa: E402
from kvstore.integrations.models import load_smollm2  # noqa: E402
from kvstore.integrations.quality import GATES  # noqa: E402
from kvstore.integrations.transformers import save_cache  # noqa: E402
from kvstore.keys import Namespace, block_keys  # noqa: E402
from kvstore.tiers.cluster_client import READ_SIZE  # noqa: E402
from kvstore.tiers.cluster_format import unpack_value  # noqa: E402
from tests.cluster.rediscluster import LocalCluster  # noqa: E402

AIM_PLAIN, AIM_LOOKUP_RTT = 0.8, 2.0


def cluster_section(urls: list[str], codec: str) -> str:
    nodes = ", ".join(f'"{u}"' for u in urls)
    text = f'[cluster]\nenabled = true\nnodes = [{nodes}]\ntimeout = "5s"\n'
    name, _, zstd = codec.partition("-no")
    text += "" if name == "default" else f'codec = "{name}"\n'
    return text + ("zstd = 0\n" if zstd == "zstd" else "")


def wait_written(c: KVStoreClient, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while c.stats()["store"]["cluster"]["written"] < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"host A wrote {c.stats()['store']['cluster']} blocks to the cluster, not {n}")
        time.sleep(0.05)


def interleaved(fns: dict[str, Any], n: int) -> dict[str, float]:
    """The median seconds of each of ``fns`` over ``n`` rounds (after one round not counted), each
    round calling every one once. A function that returns a float has timed itself (leaving out
    the set-up it did first)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(n + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            r = fn()
            took = r if isinstance(r, float) else time.perf_counter() - t0
            if i:
                times[name].append(took)
    return {name: statistics.median(v) for name, v in times.items()}


def median_of(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(llm: Any, prompt: Any, n_prefix: int, codec: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of every figure with the cluster storing ``codec`` frames (fresh cluster and daemons)."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    model, layout = llm.model, llm.layout()
    T = layout.block_tokens
    prefix = prompt[:n_prefix]
    blocks = n_prefix // T
    f: dict[str, Any] = {"codec": codec, "blocks": blocks}
    with tempfile.TemporaryDirectory(prefix="kvstore-cluster-bench-") as tmp:
        root = Path(tmp)
        with LocalCluster(root / "redis", replicas=0) as rc:
            hosts = []
            try:
                for name in ("a", "b"):
                    (root / name).mkdir()
                    d = Daemon(root / name, hbm="1GiB", ram="1GiB", extra=cluster_section(rc.urls, codec))
                    d.start()
                    hosts.append(d)
                a, b = hosts
                kw: dict[str, Any] = {"model": llm.model_id, "layout": layout, "timeout": 120.0}
                ns = Namespace(llm.model_id, layout)
                raw_keys = block_keys(ns, prefix.tolist())
                keys = [f"kvstore:b:{k.hex()}" for k in raw_keys]

                # host A: the recompute baseline, then the prefix stored and written through
                f["recompute"], runs = timed(
                    lambda: recompute(model, prompt, args.tail), max(1, args.repeat // 2)
                )
                ref, cache = runs[-1]
                with KVStoreClient(a.endpoint, **kw) as ca:
                    save_cache(ca, prefix, cache)
                    wait_written(ca, blocks)
                seeds = [ClusterNode("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in rc.urls]
                plain = RedisCluster(startup_nodes=seeds)
                # the same client tuned to read 1 MiB a socket read, not 64 KiB
                tuned = RedisCluster(startup_nodes=seeds, socket_read_size=READ_SIZE)

                def plain_get(client: Any = plain) -> list[bytes]:
                    pipe = client.pipeline(transaction=False)
                    for k in keys:
                        pipe.get(k)
                    return list(pipe.execute())

                values = plain_get()
                f["bytes"] = sum(len(v) for v in values)
                parents = [ns.root(), *raw_keys[:-1]]

                def decode_all() -> None:  # two blocks at a time, as the daemon does on these two cores
                    def one(k: bytes, v: bytes, p: bytes) -> None:
                        _, frame = unpack_value(k, v, ns.id, p)
                        decode_frame(frame, layout=layout)

                    with ThreadPoolExecutor(2) as pool:
                        list(pool.map(one, raw_keys, values, parents))

                def pipelined_exists() -> None:
                    pipe = plain.pipeline(transaction=False)
                    for k in keys:
                        pipe.exists(k)
                    pipe.execute()

                node = redis.Redis("127.0.0.1", rc.ports[0])
                with KVStoreClient(b.endpoint, **kw) as cb:
                    engine_buffer = torch.zeros(layout.shape(n_prefix), dtype=layout.torch_dtype)

                    def from_cluster(read: Any) -> Any:
                        def run() -> float:
                            cb.evict(all=True)
                            cb.flush()  # B's disk writes of the last run's blocks are over: a quiet host
                            t0 = time.perf_counter()
                            r = read()
                            seconds = time.perf_counter() - t0
                            cb.flush()  # what B does after answering (storing the blocks) is not left
                            # to run under the next figure
                            if r.tiers != ["cluster"] * blocks:
                                raise SystemExit(
                                    f"host B read {r.tiers}, not {blocks} blocks from the cluster"
                                )
                            return seconds

                        return run

                    # interleaved, one of each per round, so that a noisy moment hits every figure alike
                    times = interleaved(
                        {
                            "plain": plain_get,
                            "tuned": lambda: plain_get(tuned),
                            "decode": decode_all,
                            "get": from_cluster(lambda: cb.get(prefix)),
                            "get_into": from_cluster(lambda: cb.get_into(prefix, engine_buffer)),
                        },
                        args.repeat,
                    )
                    f.update(times)
                    cb.evict(all=True)
                    cb.flush()
                    assert cb.lookup(prefix).tiers == ["cluster"] * blocks
                    f.update(
                        interleaved(
                            {"lookup": lambda: cb.lookup(prefix), "rtt": pipelined_exists, "ping": node.ping},
                            args.lookups,
                        )
                    )
                    cb.get(prefix)
                    f["local_lookup"] = median_of(lambda: cb.lookup(prefix), args.lookups)
                    ttfts, kls, top1s = [], [], []
                    for _ in range(args.repeat):
                        cb.evict(all=True)
                        cb.flush()
                        t0 = time.perf_counter()
                        logp, got_tiers, _ = reuse(model, cb, prompt, n_prefix)
                        ttfts.append(time.perf_counter() - t0)
                        kl, top1 = compare(ref, logp)
                        kls.append(kl)
                        top1s.append(top1)
                        assert got_tiers == ["cluster"] * blocks, got_tiers
                    f["ttft"], f["kl"], f["top1"] = (statistics.median(v) for v in (ttfts, kls, top1s))
                plain.close()
                tuned.close()
            finally:
                for d in hosts:
                    d.close()
    return f


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens", type=bounded_int(64), default=2048, help="prefix length (whole 64-token blocks)"
    )
    parser.add_argument(
        "--tail", type=bounded_int(1), default=16, help="tokens after the prefix (the new question; >= 1)"
    )
    parser.add_argument("--repeat", type=bounded_int(1), default=7, help="rounds; every figure their median")
    parser.add_argument("--lookups", type=bounded_int(1), default=200)
    parser.add_argument(
        "--codecs",
        default="default,raw,raw-nozstd",
        help="cluster codecs to run: default, raw, raw-nozstd, int8, fp8 (NAME-nozstd: zstd = 0)",
    )
    args = parser.parse_args()
    keep_scratch()  # the decode figure runs on the daemon's malloc settings (kvstore/daemon/heap.py)
    llm = load_smollm2()
    layout = llm.layout()
    n_prefix = args.tokens // layout.block_tokens * layout.block_tokens
    prompt = text_tokens(llm, n_prefix + args.tail)
    results = [measure(llm, prompt, n_prefix, codec, args) for codec in args.codecs.split(",")]
    kv_mb = n_prefix // layout.block_tokens * layout.block_nbytes / 1e6
    print(
        f"cross-host reads through a Redis Cluster (3 masters, loopback); SmolLM2-135M-Instruct, {layout.dtype}"
    )
    print(f"prefix {n_prefix} tokens = {results[0]['blocks']} blocks, K/V {kv_mb:.1f} MB")
    for f in results:
        mb = f["bytes"] / 1e6
        get_fastest = min(f["plain"], f["tuned"])
        serial, floor = get_fastest + f["decode"], max(get_fastest, f["decode"])
        print()
        print(f"== cluster codec {f['codec']}: {mb:.1f} MB in the cluster")
        print(f"{'':38}{'seconds':>9}{'MB/s of cluster bytes':>23}")
        for label, t in (
            ("host B get (from the cluster)", f["get"]),
            ("host B get_into (an engine's buffer)", f["get_into"]),
            ("plain RedisCluster pipelined GET", f["plain"]),
            ("  the same, redis-py reading 1 MiB", f["tuned"]),
            ("GET then decode, serial (sum)", serial),
            ("floor, overlapped: max(GET, decode)", floor),
        ):
            print(f"{label:38}{t:>9.4f}{mb / t:>23.0f}")
        print(f"{'  (decoding alone)':38}{f['decode']:>9.4f}")
        for op in ("get", "get_into"):
            print(
                f"{op} vs plain GET: {f['plain'] / f[op]:.2f}x the throughput (aim >= {AIM_PLAIN}x); "
                f"vs the same GET reading 1 MiB at a time: {f['tuned'] / f[op]:.2f}x; "
                f"vs GET then decode, serial: {serial / f[op]:.2f}x; "
                f"vs the overlapped floor max(GET, decode): {floor / f[op]:.2f}x"
            )
        print(
            f"lookup, a local miss the cluster answers: {f['lookup'] * 1e3:.2f} ms; vs one round trip "
            f"(aim <= {AIM_LOOKUP_RTT}x): {f['lookup'] / f['rtt']:.2f}x redis-py's pipelined EXISTS of the keys "
            f"({f['rtt'] * 1e3:.2f} ms, its Python per command included), {f['lookup'] / f['ping']:.2f}x one "
            f"PING of one node ({f['ping'] * 1e3:.2f} ms: the round trip alone)"
        )
        added = f["lookup"] - f["local_lookup"]
        print(
            f"  a lookup B answers itself: {f['local_lookup'] * 1e3:.2f} ms; what the cluster adds: "
            f"{added / f['rtt']:.2f}x the pipelined EXISTS, {added / f['ping']:.2f}x one PING"
        )
        print(
            f"TTFT on host B from the cluster {f['ttft']:.3f} s vs recomputing {f['recompute']:.3f} s: "
            f"{f['recompute'] / f['ttft']:.1f}x faster; KL {f['kl']:.2e} (int4 gate {GATES['int4'].max_kl:.0e}), "
            f"top-1 {f['top1']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
