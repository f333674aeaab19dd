"""Codec throughput beside memcpy, on SmolLM2-layout blocks, one core and all cores.

    .venv/bin/python bench/codec_speed.py [--blocks 48] [--repeat 5] [--device cpu]

For every registered codec (and raw with byte shuffle + zstd) it times, in GB/s
of native-dtype block bytes (30 layers x 2 x 64 tokens x 3 heads x 64 dims,
bfloat16 = 1.47 MB a block):

    encode   block -> frame (checksum included)
    decode   frame -> a preallocated block, checksum verified (what a tier does)
    dec-nv   frame -> a preallocated block, checksum not verified (to show what the CRC costs)

beside ``dst.copy_(src)`` of the same blocks into preallocated tensors, and
prints each figure as a ratio of memcpy. The blocks rotate through a working
set larger than the last-level cache (``--blocks``), and memcpy and both
decodes write block ``i`` into the same one of ``--blocks`` preallocated
destinations (decode's ``out=``), so that no side reads or writes from a hot
cache. Encode returns a fresh frame, as a tier's put does. Every figure is the
best of ``--repeat`` rounds, memcpy measured in the same round as the codec:
on a shared machine only the ratios mean much. With one thread the clock is
the thread's own CPU time (user + system, page faults included), so other
processes competing for the cores do not count; with several threads it is
wall time.
``int4-nvme`` is int4 as the nvme and cluster tiers store it by default (Hadamard
rotation, zstd 3). The process runs on the daemon's malloc settings (heap.py).
It also prints bits per value and the relative L2 error on random and on
heavy-tailed (K-like) data, so speed is never read apart from quality.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.args import bounded_int  # noqa: E402
from kvstore.codecs import CODECS, decode_frame, get_codec  # noqa: E402
from kvstore.codecs.base import Codec  # noqa: E402
from kvstore.codecs.rotation import bf16_matmul_fast  # noqa: E402
from kvstore.daemon.heap import keep_scratch  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=64)


def make_blocks(n: int, device: str, *, heavy: bool = False, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(LAYOUT.shape(), generator=g)
        if heavy:  # K-like: a few channels far larger than the rest, with an offset
            x[..., :4] = x[..., :4] * 30 + 20
        out.append(x.to(LAYOUT.torch_dtype).to(device))
    return out


def per_block(fn: Callable[[int], object], n: int, sync: Callable[[], None]) -> float:
    """Seconds per call of ``fn(i)`` over i in 0..n-1 (one pass over the working set)."""
    # One CPU thread: its own CPU time. Threads or a GPU: wall time.
    clock = time.thread_time if torch.get_num_threads() == 1 and sync is _no_sync else time.perf_counter
    sync()
    t = clock()
    for i in range(n):
        fn(i)
    sync()
    return (clock() - t) / n


def _no_sync() -> None:
    pass


def measure(codec: Codec, blocks: list[torch.Tensor], repeat: int, device: str) -> dict[str, float]:
    """GB/s of memcpy, encode, decode and unverified decode, each the best of ``repeat`` rounds."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else _no_sync
    n, nbytes = len(blocks), LAYOUT.block_nbytes
    # one destination per block, shared by memcpy and the decodes: a decode that allocated its
    # output would get the block it freed a call before back from the heap (keep_scratch), hot in
    # the cache, while memcpy wrote cold memory
    dsts = [torch.empty_like(b) for b in blocks]
    frames = [codec.encode(b) for b in blocks]
    runs: dict[str, Callable[[int], object]] = {
        "memcpy": lambda i: dsts[i].copy_(blocks[i]),
        "encode": lambda i: codec.encode(blocks[i]),
        "decode": lambda i: codec.decode(frames[i], device=device, out=dsts[i]),
        "dec-nv": lambda i: codec.decode(frames[i], device=device, verify=False, out=dsts[i]),
    }
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, fn in runs.items():  # interleaved, so a noisy moment hits every column alike
            best[name] = min(best[name], per_block(fn, n, sync))
    return {name: nbytes / t / 1e9 for name, t in best.items()}


def quality(codec: Codec) -> tuple[float, float, float]:
    """(bits per value, relative L2 on random data, relative L2 on heavy-tailed data)."""
    rels = []
    for heavy in (False, True):
        b = make_blocks(1, "cpu", heavy=heavy, seed=7)[0]
        frame = codec.encode(b)
        d = decode_frame(frame).double()
        rels.append(float((d - b.double()).norm() / b.double().norm()))
    return len(frame) * 8 / LAYOUT.block_numel, rels[0], rels[1]


def codecs_to_run(names: list[str] | None) -> list[tuple[str, Codec]]:
    chosen = [(n, get_codec(n)) for n in CODECS if not names or n in names]
    if not names or "raw+shuffle+zstd" in names:
        chosen.insert(1, ("raw+shuffle+zstd", get_codec("raw", shuffle=True, zstd=3)))
    if not names or "int4-nvme" in names:  # what the nvme and cluster tiers store by default
        chosen.append(("int4-nvme", get_codec("int4", rotate=True, zstd=3)))
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--blocks", type=bounded_int(1), default=48, help="working set in blocks (default 48 = 71 MB)"
    )
    ap.add_argument("--repeat", type=bounded_int(1), default=5, help="rounds; each figure is the best round")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--codecs", nargs="*", help="names to run (default: all, plus raw+shuffle+zstd)")
    args = ap.parse_args()
    keep_scratch()  # as in the daemon, whose tiers run these codecs (kvstore/daemon/heap.py)
    all_cores = torch.get_num_threads()
    blocks = make_blocks(args.blocks, args.device)
    codecs = codecs_to_run(args.codecs)
    print(
        f"layout {LAYOUT.canonical().decode()}  {LAYOUT.block_nbytes / 1e6:.2f} MB/block  "
        f"working set {args.blocks} blocks  device {args.device}  cpus {os.cpu_count()}  torch {torch.__version__}"
    )
    precision = "bfloat16" if bf16_matmul_fast(torch.device(args.device)) else "float32"
    print(f"int4 rotates bfloat16 blocks back in {precision} here (codecs/rotation.py: bf16_matmul_fast)")
    print(f"\n{'codec':<18}{'bits/val':>9}{'relL2 rand':>11}{'relL2 heavy':>12}")
    for label, codec in codecs:
        bits, r_rand, r_heavy = quality(codec)
        print(f"{label:<18}{bits:>9.3f}{r_rand:>11.4f}{r_heavy:>12.4f}")
    # on a GPU the kernels do not use the host's threads: one pass (a second repeats the table)
    for threads in sorted({1, all_cores}) if args.device == "cpu" else [all_cores]:
        torch.set_num_threads(threads)
        clock = "thread CPU time" if threads == 1 and args.device == "cpu" else "wall time"
        print(
            f"\n== {threads} thread{'s' if threads > 1 else ''} ({clock}): GB/s (ratio of memcpy measured alongside)"
        )
        print(f"{'codec':<18}{'memcpy':>8}{'encode':>16}{'decode':>16}{'dec-nv':>16}")
        for label, codec in codecs:
            r = measure(codec, blocks, args.repeat, args.device)
            m = r["memcpy"]
            cols = "".join(f"{r[k]:>8.2f} ({r[k] / m:>4.0%})" for k in ("encode", "decode", "dec-nv"))
            print(f"{label:<18}{m:>8.2f}{cols}", flush=True)
    torch.set_num_threads(all_cores)


if __name__ == "__main__":
    main()
