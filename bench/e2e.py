"""End to end: time to first token of SmolLM2-135M-Instruct recomputing a prefix vs. fetching it from each tier.

    .venv/bin/python bench/e2e.py [--sizes 512,2048,4096] [--repeat 3] [--tail 16]

Method. A prompt is ``P`` tokens of real text (the reference texts of
kvstore/quality.py, concatenated) followed by ``--tail`` more tokens (a new
question). Time to first token (TTFT):

    recompute   model(prompt)                                  -> argmax of the last position
    tier X      fetch_cache(client, prompt): get P tokens from the daemon, build a DynamicCache
                + model(tail, cache)                           -> argmax

One real daemon (``kvstore serve`` subprocess, config in a temp dir; blocks
stored in bfloat16, 64 tokens each; ``promote_on_hit = false`` so that
repeated reads stay in the tier measured) serves all three tiers in turn:

    hbm    the 4K prefix is put (save_cache) and lands in hbm (raw, on the CPU here)
    ram    ``evict --tier hbm`` moves every block down to ram: re-encoded fp8
    nvme   ``flush`` (durable on nvme), daemon stopped (SIGTERM) and started again: hbm and ram
           are empty, every block is read from LMDB (int4 + zstd); the OS page cache still holds
           the file, as it would for a conversation resumed on a host with free memory

Bandwidth beside each time: fetching beats recomputing while the K/V arrives faster than the
model could compute it. The break-even bandwidth is (bytes of K/V per token, in the stored
dtype) x (prefill tokens per second of the recompute run at that size); beside it, each tier's
fetch bandwidth: the prefix's K/V bytes / the fetch time (get and cache building, as in TTFT).

Quality beside each time, from the same runs: at every tail position (each
attends to the whole prefix) the next-token distribution through the cache
from that tier is compared with recomputing: KL(recompute || tier), mean over
the positions in nats, and top-1 agreement. hbm's KL is the bfloat16 storage
alone (the model computes in float32).
Every TTFT, recomputing's too, is the median of ``--repeat`` runs after one untimed warm-up run at
the same size. Ratios, not absolute times, are the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.args import bounded_int  # noqa: E402
from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.daemon.endpoint import probe  # noqa: E402
from kvstore.integrations.models import LoadedModel, load_smollm2  # noqa: E402
from kvstore.integrations.quality import reference_texts  # noqa: E402
from kvstore.integrations.transformers import cache_kwargs, fetch_cache, save_cache  # noqa: E402

TIERS = ("hbm", "ram", "nvme")
BLOCK_TOKENS = 64
AIM_SPEEDUP, AIM_NVME_VS_RAM, AIM_AT = 20.0, 3.0, 2048


class Daemon:
    """``kvstore serve --config FILE`` as a subprocess; ``restart`` stops it with SIGTERM and starts it again."""

    def __init__(self, root: Path, *, hbm: str, ram: str, extra: str = "") -> None:
        """``extra``: TOML appended to the config (another section, e.g. bench/cluster.py's [cluster])."""
        self.endpoint = f"ipc://{root / 'run' / 'kv.sock'}"
        self.config = root / "kvstore.toml"
        self.config.write_text(
            "\n".join(
                [
                    "[server]",
                    f'endpoint = "{self.endpoint}"',
                    "workers = 2",
                    'log_level = "warning"',
                    "[hbm]",
                    'device = "cpu"',
                    f'capacity = "{hbm}"',
                    "[ram]",
                    f'capacity = "{ram}"',
                    'codec = "fp8"',
                    "[nvme]",
                    f'path = "{root / "nvme"}"',
                    'capacity = "4GiB"',
                    'codec = "int4"',
                    "write_through = true",
                    "[policy]",
                    "promote_on_hit = false",
                ]
            )
            + "\n"
            + extra
        )
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        script = Path(sys.executable).parent / "kvstore"
        cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "kvstore.cli"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, "serve", "--config", str(self.config)], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        ctx = zmq.Context()
        try:
            deadline = time.monotonic() + timeout
            while probe(ctx, self.endpoint, timeout_ms=300) is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the daemon did not start:\n{self.log.read_text(errors='replace')}")
                time.sleep(0.1)
        finally:
            ctx.destroy(linger=0)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(180)
        self.proc = None
        return code

    def close(self) -> None:
        """Stop the daemon if it still runs: SIGTERM first, so that it removes its shared-memory
        segments (a killed daemon leaves them in /dev/shm until the next one starts), SIGKILL if that
        takes over a minute."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(frozen=True)
class Cell:
    """One tier at one prefix length: median TTFT, KL and top-1 agreement vs recomputing, tiers served."""

    ttft: float
    fetch: float  # of ttft: getting the blocks and building the cache (median)
    kl: float
    top1: float
    tiers: str


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, list[Any]]:
    """Median seconds of ``repeat`` runs of ``fn`` (after one untimed warm-up run), and every run's result."""
    fn()
    times, results = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        results.append(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), results


@torch.inference_mode()
def recompute(model: Any, prompt: torch.Tensor, tail: int) -> tuple[torch.Tensor, Any]:
    """TTFT without kvstore: the whole prompt through the model. The tail's log-probabilities and the cache."""
    out = model(prompt.unsqueeze(0), use_cache=True)
    int(out.logits[0, -1].argmax())
    return out.logits[0, -tail:].float().log_softmax(-1), out.past_key_values


@torch.inference_mode()
def reuse(
    model: Any, client: KVStoreClient, prompt: torch.Tensor, expect: int
) -> tuple[torch.Tensor, list[str], float]:
    """TTFT with kvstore: fetch the prefix, compute the tail. The tail's log-probabilities, the tiers read,
    and the seconds spent fetching (get from the daemon and building the cache)."""
    t0 = time.perf_counter()
    hit = fetch_cache(client, prompt, config=model.config)
    fetch = time.perf_counter() - t0
    if hit.tokens != expect:
        raise SystemExit(f"expected {expect} cached tokens, the daemon served {hit.tokens}")
    out = model(prompt[hit.tokens :].unsqueeze(0), **cache_kwargs(model, hit.cache))
    int(out.logits[0, -1].argmax())
    return out.logits[0].float().log_softmax(-1), hit.tiers, fetch


def compare(ref: torch.Tensor, logp: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || logp) in nats and top-1 agreement over the positions."""
    kl = float((ref.exp() * (ref - logp)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == logp.argmax(-1)).float().mean())


def text_tokens(llm: LoadedModel, need: int) -> torch.Tensor:
    ids: list[int] = []
    for _, text in reference_texts():
        ids += llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            return torch.tensor(ids[:need])
    raise SystemExit(f"the reference texts hold {len(ids)} tokens, {need} are needed")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="512,2048,4096", help="prefix lengths in tokens (multiples of 64)")
    parser.add_argument(
        "--repeat",
        type=bounded_int(1),
        default=3,
        help="timed runs per cell, recomputing's too (median; after a warm-up run)",
    )
    parser.add_argument(
        "--tail",
        type=bounded_int(
            1,
            BLOCK_TOKENS,
            " (0 leaves no token to compute; a longer tail holds a whole block stored with the longest "
            "prefix, so a shorter prefix's get would match more than that prefix)",
        ),
        default=16,
        help=f"new tokens after the prefix, 1..{BLOCK_TOKENS} (computed every time; quality is measured at "
        "these positions)",
    )
    parser.add_argument(
        "--threads",
        type=bounded_int(0),
        default=1,
        help="torch threads (default 1: on a machine whose "
        "cores are oversubscribed, several threads per process run several times slower; 0 = "
        "torch's choice)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()
    llm = load_smollm2()
    model, layout = llm.model, llm.layout(dtype="bfloat16", block_tokens=BLOCK_TOKENS)
    if any(s % layout.block_tokens for s in sizes):
        raise SystemExit(f"prefix lengths must be multiples of {layout.block_tokens}")
    top = max(sizes)
    tokens = text_tokens(llm, top + args.tail)
    print(
        f"SmolLM2-135M-Instruct, float32 compute on {model.device}, torch threads {torch.get_num_threads()}; "
        f"blocks bfloat16 x {layout.block_tokens} tokens ({layout.block_nbytes / 2**20:.2f} MiB); "
        f"tail {args.tail} tokens; median of {args.repeat}"
    )

    # recomputing: the baseline TTFT and the reference distributions; the longest run's cache is stored.
    # Timed as the tier cells are (a warm-up run, then the median of --repeat), so that a ratio of the
    # two compares like with like.
    scratch: dict[int, float] = {}
    refs: dict[int, torch.Tensor] = {}
    for p in sizes:
        scratch[p], runs = timed(partial(recompute, model, tokens[: p + args.tail], args.tail), args.repeat)
        refs[p], cache = runs[-1]
        if p == top:
            full_cache = cache
        print(f"  recompute {p:>5} tokens: {scratch[p]:.3f} s", flush=True)

    cells: dict[tuple[str, int], Cell] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-e2e-") as tmp:
        daemon = Daemon(Path(tmp), hbm="512MiB", ram="512MiB")
        daemon.start()
        try:
            with KVStoreClient(daemon.endpoint, model=llm.model_id, layout=layout, timeout=120.0) as c:
                r = save_cache(c, tokens[:top], full_cache, session="e2e")
                assert r.stored == top // layout.block_tokens, r
                for tier in TIERS:
                    if tier == "ram":  # every block down one tier: hbm -> ram (fp8)
                        c.evict(tier="hbm")
                    if tier == "nvme":  # every block durable on nvme, then restart: only nvme holds them
                        assert c.flush(timeout=300), "the daemon did not acknowledge the blocks durable"
                        daemon.stop()
                        daemon.start()
                    held = {t: v["blocks"] for t, v in c.stats()["store"]["tiers"].items()}
                    print(f"  {tier}: blocks per tier {held}", flush=True)
                    for p in sizes:
                        prompt = tokens[: p + args.tail]
                        ttft, runs = timed(partial(reuse, model, c, prompt, p), args.repeat)
                        logp, read, _ = runs[-1]
                        fetch = statistics.median(r[2] for r in runs)
                        kl, top1 = compare(refs[p], logp)
                        served = "+".join(t for t in TIERS if t in read)
                        cells[tier, p] = Cell(ttft, fetch, kl, top1, served)
                        print(
                            f"  {tier:>4} {p:>5} tokens: {ttft:.3f} s (fetch {fetch:.3f} s) from {served}",
                            flush=True,
                        )
        finally:
            daemon.close()
    load_after = os.getloadavg()
    report(sizes, scratch, cells, load_before, load_after)
    report_bandwidth(sizes, scratch, cells, layout.bytes_per_token, args.tail)
    return 0


def report(
    sizes: list[int],
    scratch: dict[int, float],
    cells: dict[tuple[str, int], Cell],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    print()
    head = f"{'prefix':>6} | {'recompute':>9} |" + "|".join(
        f" {t + ' TTFT':>10} {'fetch':>7} {'speed-up':>8} {'KL':>8} {'top-1':>6} " for t in TIERS
    )
    print(head)
    print("-" * len(head))
    for p in sizes:
        row = f"{p:>6} | {scratch[p]:>8.3f}s |"
        for t in TIERS:
            c = cells[t, p]
            row += f" {c.ttft:>9.4f}s {c.fetch:>6.3f}s {scratch[p] / c.ttft:>7.1f}x {c.kl:>8.1e} {c.top1:>6.1%} |"
        print(row.rstrip("|"))
    print(
        "fetch: of the TTFT, getting the prefix from the daemon and building the cache; KL: nats, mean over "
        "the tail positions"
    )
    print("\nserved from: " + "; ".join(f"{t}: {cells[t, sizes[0]].tiers}" for t in TIERS))
    at = AIM_AT if AIM_AT in sizes else sizes[len(sizes) // 2]
    print(
        f"\nat {at} tokens (aim: >= {AIM_SPEEDUP:.0f}x faster than recomputing from every tier, "
        f"nvme within {AIM_NVME_VS_RAM:.0f}x of ram):"
    )
    for t in TIERS:
        s = scratch[at] / cells[t, at].ttft
        print(
            f"  {t:>4}: {s:6.1f}x faster than recomputing  {'meets' if s >= AIM_SPEEDUP else 'MISSES'} the aim"
        )
    for p in sizes:
        ratio = cells["nvme", p].ttft / cells["ram", p].ttft
        flag = "meets" if ratio <= AIM_NVME_VS_RAM else "MISSES"
        print(f"  nvme / ram TTFT at {p:>5}: {ratio:5.2f}x  {flag if p == at else ''}".rstrip())
    print(
        f"\nload average (1, 5, 15 min): before {', '.join(f'{x:.1f}' for x in load_before)}; "
        f"after {', '.join(f'{x:.1f}' for x in load_after)}; {os.cpu_count()} CPUs"
    )


def report_bandwidth(
    sizes: list[int], scratch: dict[int, float], cells: dict[tuple[str, int], Cell], per_token: int, tail: int
) -> None:
    """Per size: the bandwidth at which fetching the prefix costs what recomputing it does, beside the
    bandwidth each tier's fetch reached (x: fetch / break-even; above 1, fetching wins)."""
    print(
        f"\nbreak-even bandwidth = {per_token} B of K/V per token x prefill tokens/s of recomputing "
        "(prefix + tail tokens / recompute time); fetch MB/s = prefix K/V bytes / fetch time"
    )
    head = f"{'prefix':>6} | {'prefill tok/s':>13} {'break-even MB/s':>15} |" + "|".join(
        f" {t + ' MB/s':>9} {'x':>6} " for t in TIERS
    )
    print(head)
    print("-" * len(head))
    for p in sizes:
        rate = (p + tail) / scratch[p]
        even = per_token * rate / 1e6
        row = f"{p:>6} | {rate:>13.0f} {even:>15.2f} |"
        for t in TIERS:
            got = p * per_token / cells[t, p].fetch / 1e6
            row += f" {got:>9.0f} {got / even:>5.0f}x |"
        print(row.rstrip("|"))


if __name__ == "__main__":
    sys.exit(main())
