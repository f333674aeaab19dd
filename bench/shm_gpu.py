"""The GPU section of bench/shm.py: hbm on cuda:0 read through CUDA IPC, ram (fp8) decoded on the GPU,
the fp8 codec on the GPU. Run by ``bench/shm.py`` (``--gpu-only`` for just this)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.shm_rig import (  # noqa: E402
    AIM_GPU,
    GB,
    LAYOUT,
    MODEL,
    PREFIX,
    VOCAB,
    Figure,
    block_slots,
    daemon,
    interleaved,
    print_rates,
    tiers_of,
    touched,
)
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.codecs import decode_frames, get_codec  # noqa: E402
from kvstore.wire.messages import Finish, Locate, LocateOk  # noqa: E402


def gpu_section(repeat: int, shm_dir: Path | None = None) -> list[Figure]:
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

    with (
        tempfile.TemporaryDirectory(prefix="kvbench-shm-gpu-") as tmp,
        daemon(Path(tmp), device=dev, shm_dir=shm_dir) as ep,
    ):
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
            # the copies alone: one Locate held, its blocks read again and again (a get_into adds a
            # round trip to the daemon and the client's Python work per block, which a 94 MB copy at
            # device speed, tens of microseconds, does not hide)
            assert c.namespace is not None and mapping is not None
            held = Locate(ns=c.namespace.id, tokens=np.asarray(tokens, dtype=np.uint32), tiers=mapping.tiers)
            reply = c._conn.call(held, idempotent=True)
            if not isinstance(reply, LocateOk) or len(reply.blocks) != PREFIX // T:
                raise SystemExit(f"a Locate of the prefix came back short: {reply!r:.200}")

            def copies() -> None:
                if mapping.read_blocks(reply.blocks, LAYOUT, out, 0, reply.staging) != PREFIX // T:
                    raise SystemExit("the located blocks moved while they were read")

            try:
                t = interleaved({"hbm copies of a held Locate (CUDA IPC)": copies}, repeat, sync=sync)
            finally:
                c._conn.call(Finish(handle=reply.handle, used=0), idempotent=True)
            hbm.update({k: gb / v for k, v in t.items()})
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
