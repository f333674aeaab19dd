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
  3. the same gets over the socket (a client with ``shared_memory=False``);
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
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.args import bounded_int  # noqa: E402
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.codecs import decode_frame, decode_frames, get_codec  # noqa: E402
from kvstore.daemon.endpoint import probe  # noqa: E402
from kvstore.kvbuffers import PagedKV  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=64)
MODEL = "smollm2-135m-instruct"
PREFIX = 4096
VOCAB = 49152
VLLM_BLOCK = 16  # vLLM's default block_size
LMCACHE_GBS = (2.8, 3.3)  # LMCache 0.5.6, shared-memory path, same 94 MB request: quoted, not measured here
AIM_GBS = 6.5  # about twice LMCACHE_GBS
AIM_GET, AIM_RAM, AIM_PUT, AIM_GPU = 0.5, 0.8, 0.4, 0.5
GB = 1e9
SHM_DIR: Path | None = None  # --shm-dir: where the daemon's segments (and the bench's own shm file) live


# -- the daemon -------------------------------------------------------------------------------


@contextmanager
def daemon(root: Path, *, device: str) -> Iterator[str]:
    """A daemon subprocess with its hbm pool on ``device``; yields its ipc endpoint, SIGTERM at the end."""
    endpoint = f"ipc://{root / 'run' / 'kv.sock'}"
    config = root / "kvstore.toml"
    config.write_text(
        "\n".join(
            [
                "[server]",
                f'endpoint = "{endpoint}"',
                "workers = 2",
                'log_level = "warning"',
                'shared_memory = "auto"',
                'shm_staging = "256MiB"',
                'shm_staging_per_client = "128MiB"',
                *([f'shm_dir = "{SHM_DIR}"'] if SHM_DIR is not None else []),
                "[hbm]",
                f'device = "{device}"',
                'capacity = "512MiB"',
                "[ram]",
                'capacity = "512MiB"',
                'codec = "fp8"',
                "[nvme]",
                "enabled = false",
                "[policy]",
                "promote_on_hit = false",
            ]
        )
        + "\n"
    )
    log = root / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.daemon", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        ctx = zmq.Context()
        try:
            deadline = time.monotonic() + 120
            while probe(ctx, endpoint, 300) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the daemon did not start:\n{log.read_text(errors='replace')}")
                time.sleep(0.1)
        finally:
            ctx.destroy(linger=0)
        yield endpoint
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- timing -------------------------------------------------------------------------------------


def interleaved(
    runs: dict[str, Callable[[], object]],
    repeat: int,
    *,
    before: Mapping[str, Callable[[], object]] | None = None,
    threads: Mapping[str, int] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds of each of ``runs``, all timed in the same rounds (one warm-up round first, not
    counted), so that a noisy moment on the machine hits every figure alike. ``before[name]`` runs
    untimed ahead of each run of ``name``; ``threads[name]`` is the torch thread count for ``name``
    (the others keep the current one); ``sync`` waits for a device before the clock is read."""
    before, threads = before or {}, threads or {}
    base = torch.get_num_threads()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(repeat + 1):
        for name, fn in runs.items():
            if name in before:
                before[name]()
            torch.set_num_threads(threads.get(name, base))
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            if rnd:
                times[name].append(time.perf_counter() - t0)
    torch.set_num_threads(base)
    return {name: statistics.median(ts) for name, ts in times.items()}


@dataclass(frozen=True)
class Figure:
    """One line of the summary: our figure, the limit or peer it is read against, and the aim."""

    name: str
    gbs: float
    against: str
    ratio: float
    aim: str = "-"
    met: bool | None = None


def verdict(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "NO")


def print_rates(rates: dict[str, float], ref: str) -> None:
    """GB/s of each figure and its ratio to ``rates[ref]``."""
    for name, gbs in rates.items():
        print(f"  {name:<52} {gbs:7.2f} GB/s  {gbs / rates[ref]:6.2f} of {ref}")


# -- pieces of K/V ------------------------------------------------------------------------------


def block_slots(out: torch.Tensor) -> list[torch.Tensor]:
    """``out`` ([L, 2, PREFIX, H, D]) as one strided view per block, as the client writes blocks."""
    T = LAYOUT.block_tokens
    return [out[:, :, i * T : (i + 1) * T] for i in range(PREFIX // T)]


def touched(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A destination whose memory is already faulted in (as an engine's buffers are)."""
    return torch.zeros(shape, dtype=dtype, device=device)


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

    def __init__(self, data: np.ndarray) -> None:
        self._file = tempfile.TemporaryFile(dir=SHM_DIR or "/dev/shm")
        self._file.truncate(data.nbytes)
        self._map = mmap.mmap(self._file.fileno(), data.nbytes, flags=mmap.MAP_SHARED)
        self._map.madvise(mmap.MADV_HUGEPAGE)  # as kvstore's segments are mapped (kvstore.shm.segment)
        self.tensor = torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8))
        self.tensor.numpy()[:] = data

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._map.close()
        self._file.close()


def shm_mount(path: Path) -> str:
    """The filesystem ``path`` is on and its mount options (huge=... says whether pages may be 2 MiB)."""
    best = ("?", "?", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, where, kind, options, *_ = line.split()
            if str(path.resolve()).startswith(where) and len(where) >= len(best[0]):
                best = (where, kind, options)
    except OSError:
        pass
    return f"{path} on {best[0]} ({best[1]}, {best[2]})"


def machine() -> str:
    model = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{model}; {os.cpu_count()} cores; torch {torch.__version__} ({torch.get_num_threads()} threads); "
        f"numpy {np.__version__}; python {platform.python_version()}; load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )


def fresh_tokens(base: list[int], i: int) -> list[int]:
    """A prefix no put stored before: its first token differs, so every chained key does."""
    return [VOCAB + i, *base[1:]]


def tiers_of(client: KVStoreClient, tokens: list[int]) -> set[str]:
    r = client.lookup(tokens)
    if r.matched_tokens != len(tokens):
        raise SystemExit(f"the daemon holds {r.matched_tokens} of the prefix's {len(tokens)} tokens")
    return set(r.tiers)


# -- the CPU sections ---------------------------------------------------------------------------


@dataclass
class Rig:
    """What the CPU sections share: the daemon's two clients, the prefix, memcpy's buffers."""

    c: KVStoreClient  # shared memory
    sock: KVStoreClient  # socket only
    kv: torch.Tensor
    tokens: list[int]
    repeat: int
    default_threads: int  # torch's own choice in this process (the figures use the current setting)

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
    shm_src = ShmFile(rig.src.numpy())
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


def cpu_sections(repeat: int, default_threads: int) -> list[Figure]:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYOUT.shape(PREFIX), generator=gen).to(LAYOUT.torch_dtype)
    tokens = torch.randint(0, VOCAB, (PREFIX,), generator=gen).tolist()
    with tempfile.TemporaryDirectory(prefix="kvbench-shm-") as tmp, daemon(Path(tmp), device="cpu") as ep:
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
            rig = Rig(c, sock, kv, tokens, repeat, default_threads)
            return hbm_section(rig) + ram_section(rig) + put_section(rig)
        finally:
            c.close()
            sock.close()


# -- the GPU section ----------------------------------------------------------------------------


def gpu_section(repeat: int) -> list[Figure]:
    """hbm on cuda:0 read through CUDA IPC, ram (fp8) decoded on the GPU, the fp8 codec on the GPU."""
    print("\n-- GPU: hbm on cuda:0 (CUDA IPC), ram fp8 decoded on the GPU --")
    if not torch.cuda.is_available():
        print("  skipped: no CUDA")
        return []
    try:
        import cupy  # noqa: F401 - the daemon's GPU pool and this client's IPC mapping need it
    except ImportError:
        print(
            "  skipped: cupy is not installed (cupy-cuda12x or -cuda13x, as torch's CUDA); CUDA IPC needs it"
        )
        return []
    dev = "cuda:0"
    sync = torch.cuda.synchronize
    print(f"  {torch.cuda.get_device_name(0)}; CUDA {torch.version.cuda}")
    nbytes = PREFIX * LAYOUT.bytes_per_token
    gb = nbytes / GB
    T = LAYOUT.block_tokens
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(LAYOUT.shape(PREFIX), generator=gen).to(LAYOUT.torch_dtype)
    tokens = torch.randint(0, VOCAB, (PREFIX,), generator=gen).tolist()
    kv_gpu = kv.to(dev)
    d2d_src = kv_gpu.view(-1).view(torch.uint8)
    d2d_dst = touched((nbytes,), torch.uint8, dev)
    pinned = kv.view(-1).view(torch.uint8).pin_memory()
    h2d_dst = touched((nbytes,), torch.uint8, dev)
    out = touched(LAYOUT.shape(PREFIX), LAYOUT.torch_dtype, dev)
    figures: list[Figure] = []

    def get_into() -> None:
        if c.get_into(tokens, out).matched_tokens != PREFIX:
            raise SystemExit("a get_into came back short")

    with tempfile.TemporaryDirectory(prefix="kvbench-shm-gpu-") as tmp, daemon(Path(tmp), device=dev) as ep:
        c = KVStoreClient(ep, model=MODEL, layout=LAYOUT, timeout=120)
        try:
            c.ping()
            if not c.shared_memory:
                raise SystemExit("the daemon offers no shared memory here (see its log)")
            r = c.put(tokens, kv)
            assert r.stored == PREFIX // T, r
            where = tiers_of(c, tokens)
            # The route measured: the pools this client reads in place; without "hbm" its blocks would
            # come through host staging, and the figure would not be CUDA IPC's.
            mapping = c._shm.mapping()
            in_place = [] if mapping is None else mapping.tiers
            print(f"  prefix stored in {sorted(where)}; pools read in place: {in_place}")
            if "hbm" not in in_place:
                raise SystemExit("the hbm pool on the GPU is not mapped through CUDA IPC in this client")

            assert c.get_into(tokens, out).matched_tokens == PREFIX and torch.equal(out.cpu(), kv)
            t = interleaved(
                {
                    "device-to-device copy": lambda: d2d_dst.copy_(d2d_src),
                    "hbm get_into (CUDA IPC)": get_into,
                },
                repeat,
                sync=sync,
            )
            hbm = {k: gb / v for k, v in t.items()}
            print_rates(hbm, "device-to-device copy")
            g = hbm["hbm get_into (CUDA IPC)"] / hbm["device-to-device copy"]
            figures.append(
                Figure(
                    "GPU hbm get_into (CUDA IPC)",
                    hbm["hbm get_into (CUDA IPC)"],
                    "D2D copy",
                    g,
                    f">= {AIM_GPU:.0%}",
                    g >= AIM_GPU,
                )
            )

            c.evict(tier="hbm")
            where = tiers_of(c, tokens)
            if where != {"ram"}:
                raise SystemExit(f"after evict --tier hbm the blocks are in {sorted(where)}, not ram")
            assert c.get_into(tokens, out).matched_tokens == PREFIX
            t = interleaved(
                {
                    "pinned host-to-device copy": lambda: h2d_dst.copy_(pinned, non_blocking=True),
                    "ram fp8 get_into a GPU tensor": get_into,
                },
                repeat,
                sync=sync,
            )
            ram = {k: gb / v for k, v in t.items()}
            print_rates(ram, "pinned host-to-device copy")
            g = ram["ram fp8 get_into a GPU tensor"] / ram["pinned host-to-device copy"]
            figures.append(
                Figure(
                    "GPU ram fp8 get_into",
                    ram["ram fp8 get_into a GPU tensor"],
                    "pinned H2D copy",
                    g,
                    f">= {AIM_GPU:.0%}",
                    g >= AIM_GPU,
                )
            )
        finally:
            c.close()

    codec = get_codec("fp8")
    blocks = [kv_gpu[:, :, i * T : (i + 1) * T].contiguous() for i in range(PREFIX // T)]
    frames = [codec.encode(b) for b in blocks]
    slots = block_slots(out)

    def encode_all() -> None:
        for b in blocks:
            codec.encode(b)

    def decode_all() -> None:
        for f, s in zip(frames, slots, strict=True):
            codec.decode(f, layout=LAYOUT, device=dev, out=s)

    def decode_batch() -> None:
        if decode_frames(frames, layout=LAYOUT, device=dev)[1] != len(frames):
            raise SystemExit("a batch of frames came back short")

    t = interleaved(
        {
            "device-to-device copy": lambda: d2d_dst.copy_(d2d_src),
            "fp8 encode": encode_all,
            "fp8 decode": decode_all,
            "fp8 decode, one batch": decode_batch,
        },
        repeat,
        sync=sync,
    )
    codec_rates = {k: gb / v for k, v in t.items()}
    print("  fp8 codec on the GPU (encode returns a host frame; decode takes one, or all 64 at once):")
    print_rates(codec_rates, "device-to-device copy")
    for name in ("fp8 encode", "fp8 decode", "fp8 decode, one batch"):
        figures.append(
            Figure(
                f"GPU {name}",
                codec_rates[name],
                "D2D copy",
                codec_rates[name] / codec_rates["device-to-device copy"],
            )
        )
    return figures


# -- main ---------------------------------------------------------------------------------------


def summary(figures: list[Figure]) -> None:
    print("\n-- summary (GB/s of bfloat16 K/V; ratio to the figure it is read against) --")
    print(f"{'figure':<38} {'GB/s':>7}  {'against':<20} {'ratio':>6}  {'aim':<20} {'met':>4}")
    for f in figures:
        print(f"{f.name:<38} {f.gbs:7.2f}  {f.against:<20} {f.ratio:6.2f}  {f.aim:<20} {verdict(f.met):>4}")


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
    global SHM_DIR
    SHM_DIR = args.shm_dir
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
    print(f"shared memory: {shm_mount(SHM_DIR or Path('/dev/shm'))}")
    figures = [] if args.gpu_only else cpu_sections(repeat, default_threads)
    figures += gpu_section(repeat)
    if figures:
        summary(figures)
    print(f"\nload average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
