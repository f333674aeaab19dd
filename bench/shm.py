"""Same-host data plane: get and put of a 4K-token prefix through shared memory, beside memcpy and the socket.

Prints, in one run on one machine, for a 4096-token prefix of SmolLM2-135M
(30 layers x 2 x 3 KV heads x 64 dims, bfloat16: 94 MB of K/V), each figure the
median of ``--repeat`` rounds after a warm-up round, every figure of a section
measured in the same rounds as its limit (interleaved):

  1. memcpy of the same bytes: torch ``copy_`` and numpy ``copyto`` into a preallocated,
     already-touched destination, and a copy out of a mapped /dev/shm file (or ``--shm-dir``; as the pools
     are mapped): the physical limit; beside it, the same bytes copied between whole blocks and
     the prefix's layout (runs of 24 KB: the copy a get or a put's store makes), read as the
     limit of that copy alone (the aims keep the plain memcpy);
  2. get from hbm (raw blocks) through shared memory: ``get_into`` a preallocated tensor and
     ``get`` (a fresh tensor), beside memcpy; aims: >= 50% of memcpy and >= 6.5 GB/s (twice
     LMCache 0.5.6 through its shared-memory path for the same 94 MB request, 2.8-3.3 GB/s,
     measured elsewhere on this kind of machine and quoted here: LMCache cannot run here);
  3. the same gets over the socket (a client with ``shared_memory=False``); then the round trips a
     same-host get makes before it copies (a locate of the prefix, then its finish) beside a ping and
     a lookup;
  4. get from ram (fp8 frames) through shared memory beside decoding the same number of fp8
     frames in this process (the codec's own speed, checksums verified as a get does);
     aim >= 80% of it; and over the socket;
  5. put through shared memory (staging, then commit) beside memcpy, aim >= 40%; and over the
     socket. Every put stores new blocks (fresh token ids; the store is emptied between puts).
     The daemon copies a put's blocks out of staging on every core, so the put is also read
     against a memcpy split over every core (this process stages on one thread);
  6. ``get_into`` a vLLM-layout paged destination ([2, num_blocks, 16, H, D] per layer,
     shuffled block ids) beside ``get_into`` a contiguous tensor.

One daemon subprocess (ipc endpoint in a temp dir; hbm on the CPU; nvme off, so no writer
thread competes for the cores; ``promote_on_hit = false``, so repeated reads stay in the
tier measured). GB/s count the K/V's native (bfloat16) bytes; the clock is wall time.
This process runs torch with ``--threads`` threads (default 1, limits included): with two
processes on a few shared cores, a copy split over two threads may wait for a descheduled
one; the hbm section prints memcpy and ``get_into`` at torch's own thread count beside (an
engine's client runs torch at its default, a thread per core), read against the same aims. The
daemon runs as shipped (its workers share the cores' torch threads).

GPU section (only where CUDA is available; the daemon needs cupy for its hbm pool on
``cuda:0``): hbm ``get_into`` a CUDA tensor through CUDA IPC beside a device-to-device copy
of the same bytes (aim >= 50%); ram (fp8) ``get_into`` a CUDA tensor beside a pinned
host-to-device copy of the same bytes (aim >= 50%); the fp8 codec's encode and decode on the
GPU. ``--gpu-only`` runs just that section. Ratios are what to read: the machine is shared.

    .venv/bin/python bench/shm.py [--quick] [--repeat N] [--threads N] [--gpu-only]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.args import bounded_int  # noqa: E402
from bench.shm_gpu import gpu_section  # noqa: E402
from bench.shm_rig import (  # noqa: E402
    AIM_GBS,
    AIM_GET,
    AIM_PUT,
    AIM_RAM,
    GB,
    LAYOUT,
    LMCACHE_GBS,
    MODEL,
    PREFIX,
    VLLM_BLOCK,
    VOCAB,
    Figure,
    block_slots,
    daemon,
    interleaved,
    machine,
    print_rates,
    shm_mount,
    summary,
    tiers_of,
    touched,
)
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.codecs import decode_frame, get_codec  # noqa: E402
from kvstore.kvbuffers import PagedKV  # noqa: E402
from kvstore.wire.messages import Finish, Locate, LocateOk  # noqa: E402


def vllm_destination(gen: torch.Generator) -> PagedKV:
    """vLLM's per-layer caches ([2, num_blocks, 16, H, D], twice the blocks the prefix needs) and a
    PagedKV over shuffled block ids for the prefix's tokens."""
    need = PREFIX // VLLM_BLOCK
    caches = [
        touched((2, 2 * need, VLLM_BLOCK, LAYOUT.num_kv_heads, LAYOUT.head_dim), LAYOUT.torch_dtype)
        for _ in range(LAYOUT.num_layers)
    ]
    ids = torch.randperm(2 * need, generator=gen)[:need]
    return PagedKV.vllm(caches, ids, PREFIX)


class ShmFile:
    """A file in /dev/shm mapped read-write holding a copy of some bytes: the kind of memory a shared
    pool is, to copy out of."""

    def __init__(self, data: np.ndarray, shm_dir: Path | None) -> None:
        self._file = tempfile.TemporaryFile(dir=shm_dir or "/dev/shm")
        self._file.truncate(data.nbytes)
        self._map = mmap.mmap(self._file.fileno(), data.nbytes, flags=mmap.MAP_SHARED)
        self._map.madvise(mmap.MADV_HUGEPAGE)  # as kvstore's segments are mapped (kvstore.shm.segment)
        self.tensor = torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8))
        self.tensor.numpy()[:] = data

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._map.close()
        self._file.close()


def fresh_tokens(base: list[int], i: int) -> list[int]:
    """A prefix no put stored before: its first token differs, so every chained key does."""
    return [VOCAB + i, *base[1:]]


@dataclass
class Rig:
    """What the CPU sections share: the daemon's two clients, the prefix, memcpy's buffers."""

    c: KVStoreClient  # shared memory
    sock: KVStoreClient  # socket only
    kv: torch.Tensor
    tokens: list[int]
    repeat: int
    default_threads: int  # torch's own choice in this process (the figures use the current setting)
    shm_dir: Path | None  # the daemon's segments (and the memcpy figure's shm file) live here; None: /dev/shm

    def __post_init__(self) -> None:
        self.src = self.kv.view(-1).view(torch.uint8)
        self.dst = touched((self.src.numel(),), torch.uint8)
        self.gb = self.src.numel() / GB

    def memcpy(self) -> dict[str, Callable[[], object]]:
        src, dst = self.src, self.dst
        src_np, dst_np = src.numpy(), dst.numpy()
        return {
            "memcpy (torch copy_)": lambda: dst.copy_(src),
            "memcpy (numpy copyto)": lambda: np.copyto(dst_np, src_np),
        }

    def block_memcpy(self) -> dict[str, Callable[[], object]]:
        """memcpy between the prefix's layout and whole blocks laid one after another (as a pool holds
        them): the copy a get (blocks -> prefix) and a put's store (prefix -> blocks) make, by numpy,
        on one thread. Each (block, layer, K/V) is one run of T*H*D values (24 KB for SmolLM2), too
        short for memcpy's non-temporal stores: this is the limit of the copy itself, which the aims
        are not read against (they keep the plain memcpy)."""
        T, n = LAYOUT.block_tokens, PREFIX // LAYOUT.block_tokens
        width = torch.int16  # numpy has no bfloat16: the same bytes as int16
        pool = touched((n, *LAYOUT.shape(T)), LAYOUT.torch_dtype)
        pool.copy_(self.kv.unflatten(2, (n, T)).permute(2, 0, 1, 3, 4, 5))
        prefix = touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype)
        blocks_np = pool.view(width).numpy()
        prefix_np = prefix.view(width).unflatten(2, (n, T)).permute(2, 0, 1, 3, 4, 5).numpy()
        return {
            "memcpy, blocks -> prefix layout (a get's copy)": lambda: np.copyto(prefix_np, blocks_np),
            "memcpy, prefix layout -> blocks (a put's copy)": lambda: np.copyto(blocks_np, prefix_np),
        }

    def rates(self, seconds: dict[str, float]) -> dict[str, float]:
        return {k: self.gb / v for k, v in seconds.items()}

    def get_into(self, client: KVStoreClient, dst: Any) -> Callable[[], object]:
        def run() -> None:
            if client.get_into(self.tokens, dst).matched_tokens != PREFIX:
                raise SystemExit("a get_into came back short")

        return run

    def get(self, client: KVStoreClient) -> Callable[[], object]:
        def run() -> None:
            if client.get(self.tokens).matched_tokens != PREFIX:
                raise SystemExit("a get came back short")

        return run


def split_memcpy(src: np.ndarray, dst: np.ndarray, threads: int) -> Callable[[], object]:
    """memcpy of ``src`` into ``dst`` split in ``threads`` parts, one per thread (numpy lets go of the
    GIL): the copy bandwidth of every core, which the daemon's copy of a put's blocks uses."""
    pool = ThreadPoolExecutor(max(1, threads - 1))
    cuts = [len(src) * i // threads for i in range(threads + 1)]

    def run() -> None:
        rest = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in zip(cuts[1:-1], cuts[2:], strict=True)]
        np.copyto(dst[: cuts[1]], src[: cuts[1]])
        for f in rest:
            f.result()

    return run


def limit_of(rates: dict[str, float]) -> tuple[str, float]:
    """The faster memcpy of the section: the limit its figures are read against."""
    name = max(("memcpy (torch copy_)", "memcpy (numpy copyto)"), key=lambda k: rates[k])
    return name, rates[name]


def hbm_section(rig: Rig) -> list[Figure]:
    """Sections 1-3 and 6: memcpy, get from hbm through shared memory and the socket, paged get_into."""
    c, sock, kv, tokens = rig.c, rig.sock, rig.kv, rig.tokens
    out = touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype)
    out_sock = touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype)
    paged = vllm_destination(torch.Generator().manual_seed(2))
    assert c.get_into(tokens, out).matched_tokens == PREFIX and torch.equal(out, kv)
    got = c.get(tokens).kv
    assert got is not None and torch.equal(got, kv)
    del got
    assert sock.get_into(tokens, out_sock).matched_tokens == PREFIX and torch.equal(out_sock, kv)
    assert c.get_into(tokens, paged).matched_tokens == PREFIX
    assert torch.equal(paged.read(0, touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype)), kv)
    shm_src = ShmFile(rig.src.numpy(), rig.shm_dir)
    n = torch.get_num_threads()
    many = rig.default_threads
    runs = {
        **rig.memcpy(),
        "memcpy out of a mapped /dev/shm file": lambda: rig.dst.copy_(shm_src.tensor),
        **{k: v for k, v in rig.block_memcpy().items() if "a get" in k},
        "get_into, shared memory": rig.get_into(c, out),
        "get (fresh tensor), shared memory": rig.get(c),
        "get_into, socket": rig.get_into(sock, out_sock),
        "get (fresh tensor), socket": rig.get(sock),
        "get_into vLLM paged buffers, shared memory": rig.get_into(c, paged),
    }
    threads: dict[str, int] = {}
    if many != n:  # the same two figures at torch's default thread count, for comparison
        runs[f"memcpy (torch copy_), {many} torch threads"] = runs["memcpy (torch copy_)"]
        runs[f"get_into, shared memory, {many} torch threads"] = runs["get_into, shared memory"]
        threads = {f"memcpy (torch copy_), {many} torch threads": many}
        threads[f"get_into, shared memory, {many} torch threads"] = many
    hbm = rig.rates(interleaved(runs, rig.repeat, threads=threads))
    shm_src.close()
    limit_name, limit = limit_of(hbm)
    print(f"\n-- get of the 4K prefix from hbm (raw blocks), {rig.src.numel() / 1e6:.1f} MB --")
    print_rates(hbm, limit_name)
    print(
        f"  {'LMCache 0.5.6 shm path (quoted, not measured here)':<52} "
        f"{f'{LMCACHE_GBS[0]:.1f}-{LMCACHE_GBS[1]:.1f}':>7} GB/s"
    )
    contiguous, paged_gbs = hbm["get_into, shared memory"], hbm["get_into vLLM paged buffers, shared memory"]
    print(f"  paged / contiguous get_into: {paged_gbs / contiguous:.2f}")
    figures = []
    for name in ("get_into, shared memory", "get (fresh tensor), shared memory"):
        g = hbm[name]
        aim = f">= {AIM_GET:.0%}, >= {AIM_GBS:.1f} GB/s"
        figures.append(
            Figure(f"hbm {name}", g, "memcpy", g / limit, aim, g / limit >= AIM_GET and g >= AIM_GBS)
        )
    gather = hbm["memcpy, blocks -> prefix layout (a get's copy)"]
    figures.append(
        Figure("hbm get_into, shared memory", contiguous, "block-layout memcpy", contiguous / gather)
    )
    for name in ("get_into, socket", "get (fresh tensor), socket"):
        figures.append(Figure(f"hbm {name}", hbm[name], "memcpy", hbm[name] / limit))
    if threads:
        g = hbm[f"get_into, shared memory, {many} torch threads"]
        m = hbm[f"memcpy (torch copy_), {many} torch threads"]
        # the same aims, for a client whose torch runs a thread per core (an engine's default)
        aim = f">= {AIM_GET:.0%}, >= {AIM_GBS:.1f} GB/s"
        figures.append(
            Figure(
                f"hbm get_into shm, {many} threads",
                g,
                f"memcpy, {many} threads",
                g / m,
                aim,
                g / m >= AIM_GET and g >= AIM_GBS,
            )
        )
    figures.append(
        Figure("hbm get_into vLLM paged", paged_gbs, "contiguous get_into", paged_gbs / contiguous)
    )
    mid = sum(LMCACHE_GBS) / 2
    figures.append(Figure("LMCache 0.5.6 shm (quoted)", mid, "memcpy", mid / limit))
    return figures


def round_trips(rig: Rig, rounds: int = 200) -> None:
    """What a same-host get pays before its copy: the locate round trip (the daemon pins the prefix's
    64 hbm blocks and says where they are; the finish that gives them back, sent and not awaited as a
    get sends it), beside a ping (answered by the daemon's event loop: the transport and protocol
    alone) and a lookup of the same prefix. Medians of ``rounds``, in ms."""
    c = rig.c
    mapping = c._shm.mapping()
    if mapping is None or c.namespace is None:
        raise SystemExit("the shared-memory client has no mapping")
    tokens = np.asarray(rig.tokens, dtype=np.uint32)
    locate = Locate(ns=c.namespace.id, tokens=tokens, tiers=mapping.tiers)

    def located() -> None:
        reply = c._conn.call(locate, idempotent=True)
        if not isinstance(reply, LocateOk) or len(reply.blocks) != PREFIX // LAYOUT.block_tokens:
            raise SystemExit(f"a Locate of the prefix came back short: {reply!r:.200}")
        c._conn.notify(Finish(handle=reply.handle, used=0))

    seconds = interleaved(
        {
            "ping": c.ping,
            "lookup of the prefix": lambda: c.lookup(rig.tokens),
            "locate, then finish": located,
        },
        rounds,
    )
    print(f"\n-- round trips before a same-host get's copy (ms; median of {rounds}) --")
    ping = seconds["ping"]
    for name, t in seconds.items():
        print(f"  {name:<52} {t * 1e3:7.3f} ms   {t / ping:5.2f} x ping")


def ram_section(rig: Rig) -> list[Figure]:
    """Section 4: the blocks moved down to ram (fp8 frames), read through shared memory and the socket,
    beside decoding as many fp8 frames in this process."""
    c, sock, kv, tokens = rig.c, rig.sock, rig.kv, rig.tokens
    c.evict(tier="hbm")
    where = tiers_of(c, tokens)
    if where != {"ram"}:
        raise SystemExit(f"after evict --tier hbm the blocks are in {sorted(where)}, not ram")
    codec = get_codec("fp8")
    T = LAYOUT.block_tokens
    frames = [codec.encode(kv[:, :, i * T : (i + 1) * T]) for i in range(PREFIX // T)]
    decoded = touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype)
    slots = block_slots(decoded)

    def decode_all() -> None:
        for f, s in zip(frames, slots, strict=True):
            decode_frame(f, layout=LAYOUT, out=s)

    decode_all()
    out = touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype)
    out_sock = touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype)
    assert c.get_into(tokens, out).matched_tokens == PREFIX and torch.equal(out, decoded)
    runs = {
        **rig.memcpy(),
        "fp8 decode in this process": decode_all,
        "get_into, shared memory": rig.get_into(c, out),
        "get (fresh tensor), shared memory": rig.get(c),
        "get_into, socket": rig.get_into(sock, out_sock),
    }
    ram = rig.rates(interleaved(runs, rig.repeat))
    frame_mb = sum(len(f) for f in frames) / 1e6
    print(
        f"\n-- get of the 4K prefix from ram (fp8 frames: {frame_mb:.1f} MB read, "
        f"{rig.src.numel() / 1e6:.1f} MB written) --"
    )
    print_rates(ram, "fp8 decode in this process")
    dec = ram["fp8 decode in this process"]
    g = ram["get_into, shared memory"]
    return [
        Figure(
            "ram get_into, shared memory", g, "fp8 decode", g / dec, f">= {AIM_RAM:.0%}", g / dec >= AIM_RAM
        ),
        Figure(
            "ram get (fresh), shared memory",
            ram["get (fresh tensor), shared memory"],
            "fp8 decode",
            ram["get (fresh tensor), shared memory"] / dec,
        ),
        Figure("ram get_into, socket", ram["get_into, socket"], "fp8 decode", ram["get_into, socket"] / dec),
        Figure("fp8 decode in this process", dec, "memcpy", dec / limit_of(ram)[1]),
    ]


def put_section(rig: Rig) -> list[Figure]:
    """Section 5: puts of new blocks into an emptied store, through shared memory and the socket."""
    c, kv, tokens = rig.c, rig.kv, rig.tokens
    counter = iter(range(1, 1 << 30))
    blocks = PREFIX // LAYOUT.block_tokens

    def put(client: KVStoreClient) -> Callable[[], object]:
        def run() -> None:
            r = client.put(fresh_tokens(tokens, next(counter)), kv)
            if r.stored != blocks:
                raise SystemExit(f"a put stored {r.stored} of {blocks} blocks: {r}")

        return run

    def empty_store() -> None:
        c.evict(all=True)

    cores = os.cpu_count() or 1
    every_core = f"memcpy on every core (numpy copyto, {cores} threads)"
    runs = {
        **rig.memcpy(),
        every_core: split_memcpy(rig.src.numpy(), rig.dst.numpy(), cores),
        **{k: v for k, v in rig.block_memcpy().items() if "a put" in k},
        "put, shared memory": put(c),
        "put, socket": put(rig.sock),
    }
    before = {"put, shared memory": empty_store, "put, socket": empty_store}
    puts = rig.rates(interleaved(runs, rig.repeat, before=before))
    print(f"\n-- put of a new 4K prefix into hbm, {rig.src.numel() / 1e6:.1f} MB --")
    limit_name, limit = limit_of(puts)
    print_rates(puts, limit_name)
    p = puts["put, shared memory"]
    return [
        Figure("put, shared memory", p, "memcpy", p / limit, f">= {AIM_PUT:.0%}", p / limit >= AIM_PUT),
        Figure("put, shared memory", p, "memcpy, every core", p / puts[every_core]),
        Figure(
            "put, shared memory",
            p,
            "block-layout memcpy",
            p / puts["memcpy, prefix layout -> blocks (a put's copy)"],
        ),
        Figure("put, socket", puts["put, socket"], "memcpy", puts["put, socket"] / limit),
    ]


def cpu_sections(repeat: int, default_threads: int, shm_dir: Path | None) -> list[Figure]:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYOUT.shape(PREFIX), generator=gen).to(LAYOUT.torch_dtype)
    tokens = torch.randint(0, VOCAB, (PREFIX,), generator=gen).tolist()
    with (
        tempfile.TemporaryDirectory(prefix="kvbench-shm-") as tmp,
        daemon(Path(tmp), device="cpu", shm_dir=shm_dir) as ep,
    ):
        c = KVStoreClient(ep, model=MODEL, layout=LAYOUT, timeout=120)
        sock = KVStoreClient(ep, model=MODEL, layout=LAYOUT, timeout=120, shared_memory=False)
        try:
            c.ping()
            sock.ping()
            if not c.shared_memory or sock.shared_memory:
                raise SystemExit(
                    f"expected one shared-memory client and one socket client, got {c.shared_memory} and "
                    f"{sock.shared_memory}: the daemon offers no shared memory here (see its log)"
                )
            r = c.put(tokens, kv)
            assert r.stored == PREFIX // LAYOUT.block_tokens, r
            print(f"\nprefix stored; blocks in {sorted(tiers_of(c, tokens))}")
            rig = Rig(c, sock, kv, tokens, repeat, default_threads, shm_dir)
            hbm = hbm_section(rig)
            round_trips(rig)
            return hbm + ram_section(rig) + put_section(rig)
        finally:
            c.close()
            sock.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 timed rounds instead of --repeat")
    ap.add_argument(
        "--repeat", type=bounded_int(1), default=9, help="timed rounds per figure (median; after a warm-up)"
    )
    ap.add_argument("--gpu-only", action="store_true", help="run only the GPU section")
    ap.add_argument(
        "--threads",
        type=bounded_int(0),
        default=1,
        help="torch threads in this process (default 1: with two processes on a few shared cores, "
        "several threads per process stall each other; 0 = torch's choice). The hbm section also "
        "prints get_into and memcpy at torch's choice",
    )
    ap.add_argument(
        "--shm-dir",
        type=Path,
        help="the daemon's [server] shm_dir (default: kvstore's, /dev/shm/kvstore-<uid>); e.g. a tmpfs "
        "mounted with huge=advise, where the segments are made of 2 MiB pages",
    )
    args = ap.parse_args()
    repeat = 3 if args.quick else max(1, args.repeat)
    default_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"kvstore shared-memory data plane; prefix {PREFIX} tokens = "
        f"{PREFIX * LAYOUT.bytes_per_token / 1e6:.1f} MB ({LAYOUT.num_layers}L x {LAYOUT.num_kv_heads}H x "
        f"{LAYOUT.head_dim}D bf16, {LAYOUT.block_tokens}-token blocks); median of {repeat} rounds"
    )
    print(f"machine: {machine()}")
    print(f"shared memory: {shm_mount(args.shm_dir or Path('/dev/shm'))}")
    figures = [] if args.gpu_only else cpu_sections(repeat, default_threads, args.shm_dir)
    figures += gpu_section(repeat, args.shm_dir)
    if figures:
        summary(figures)
    print(f"\nload average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
