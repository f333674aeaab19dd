"""What the same-host benchmarks (bench/shm.py, bench/shm_gpu.py) share: SmolLM2's 4K-token prefix,
a daemon subprocess, interleaved timing and the summary's figures."""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.daemon.endpoint import probe  # noqa: E402
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


@contextmanager
def daemon(root: Path, *, device: str, shm_dir: Path | None = None) -> Iterator[str]:
    """A daemon subprocess with its hbm pool on ``device`` and its segments in ``shm_dir`` (None:
    kvstore's default); yields its ipc endpoint, SIGTERM at the end."""
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
                *([f'shm_dir = "{shm_dir}"'] if shm_dir is not None else []),
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
            deadline = time.monotonic() + 45  # inside gpu-check's step limit, so that the log is printed
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


def block_slots(out: torch.Tensor) -> list[torch.Tensor]:
    """``out`` ([L, 2, PREFIX, H, D]) as one strided view per block, as the client writes blocks."""
    T = LAYOUT.block_tokens
    return [out[:, :, i * T : (i + 1) * T] for i in range(PREFIX // T)]


def touched(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A destination whose memory is already faulted in (as an engine's buffers are)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def tiers_of(client: KVStoreClient, tokens: list[int]) -> set[str]:
    r = client.lookup(tokens)
    if r.matched_tokens != len(tokens):
        raise SystemExit(f"the daemon holds {r.matched_tokens} of the prefix's {len(tokens)} tokens")
    return set(r.tiers)


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


def summary(figures: list[Figure]) -> None:
    print("\n-- summary (GB/s of bfloat16 K/V; ratio to the figure it is read against) --")
    print(f"{'figure':<38} {'GB/s':>7}  {'against':<20} {'ratio':>6}  {'aim':<20} {'met':>4}")
    for f in figures:
        print(f"{f.name:<38} {f.gbs:7.2f}  {f.against:<20} {f.ratio:6.2f}  {f.aim:<20} {verdict(f.met):>4}")
