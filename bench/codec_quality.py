"""Codec quality on SmolLM2-135M-Instruct: the full table, with the gates and aims beside it.

    .venv/bin/python bench/codec_quality.py [--quick] [--continuation 256] [--prefix-blocks 16]

Method (kvstore/quality.py): for each real text on this host (GPL-3, Apache-2.0,
CPython's LICENSE and reference-manual prose), a 1,024-token prefix is prefilled
once; its bfloat16 KV cache is cut into 64-token blocks, each block is encoded
and decoded by the codec, and the next ``--continuation`` tokens are run
teacher-forced through a fresh cache built from the decoded blocks. Their
next-token distributions are compared with those through the exact cache.
The model computes in float32; the blocks the codecs see are bfloat16.

Columns: KL(ref || codec) in nats (mean over positions), top-1 agreement,
perplexity change of the true next tokens, relative L2 error of K and of V,
bits per value (frame bytes x 8 / values, header and stats included), and
whether the row meets the gate (tests/model) and the aim.

Part 1 is every registered codec at its defaults. Part 2 is what each int4
choice buys (group sizes, per-channel vs per-token K, a Hadamard rotation of
the head dimension, keeping the first block -- the attention sink -- exact,
zstd on top). Part 3 tries other settings of fp8 and int8. Part 4 is the nvme tier as
the default config sets it up (``[nvme]`` codec, rotate, zstd, head_codec, head_blocks):
bits per value there count every frame of the prefix as stored (header, stats, the
int8 head block, zstd), for the 1,024-token prefixes scored and, from frame sizes
alone, for a 4,096-token prefix of the longest text. No timings here:
bench/codec_speed.py measures speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.args import bounded_int  # noqa: E402
from kvstore.codecs import CODECS, Codec, get_codec  # noqa: E402
from kvstore.config import NvmeConfig  # noqa: E402
from kvstore.integrations.quality import AIMS, GATES, QualityHarness, QualityResult, reference_texts  # noqa: E402
from kvstore.integrations.transformers import cache_to_kv  # noqa: E402


@dataclass(frozen=True)
class Row:
    label: str
    codec: str
    params: dict[str, Any] = field(default_factory=dict)
    head_blocks: int = 0  # leading blocks stored with head_codec instead (raw: exact)
    head_codec: str = "raw"


INT4_ROWS = [
    Row("KIVI g32 (default)", "int4"),
    Row("groups of 64 (K and V)", "int4", {"k_group": 64, "v_group": 64}),
    Row("K groups of 64, V 32", "int4", {"k_group": 64}),
    Row("K groups of 16, V 64", "int4", {"k_group": 16, "v_group": 64}),
    Row("K per token (like V)", "int4", {"k_axis": "token"}),
    Row("Hadamard rotation", "int4", {"rotate": True}),
    Row("rotation + K per token", "int4", {"rotate": True, "k_axis": "token"}),
    Row("first block exact", "int4", {}, head_blocks=1),
    Row("first block int8", "int4", {}, head_blocks=1, head_codec="int8"),
    Row("K groups of 64, first block int8", "int4", {"k_group": 64}, head_blocks=1, head_codec="int8"),
    Row("rotation, first block int8", "int4", {"rotate": True}, head_blocks=1, head_codec="int8"),
    Row("zstd 3 (nvme tier)", "int4", {"zstd": 3}),
]
OTHER_ROWS = [
    Row("int8 symmetric", "int8", {"symmetric": True}),
    Row("int8 first block exact", "int8", {}, head_blocks=1),
    Row("fp8 first block exact", "fp8", {}, head_blocks=1),
]
QUICK = {"KIVI g32 (default)", "groups of 64 (K and V)", "Hadamard rotation", "first block exact"}


def prefix_bits(
    harness: QualityHarness, tokens: int, codec: Codec, head_blocks: int, head: Codec | None
) -> tuple[str, float] | None:
    """(text, bits per value) of the frames of a ``tokens``-token prefix of the longest reference
    text, as the nvme tier would store them; None when no text is that long."""
    loaded = harness.loaded
    best = None
    for name, text in reference_texts():
        ids = loaded.tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() >= tokens and (best is None or ids.numel() > best[1].numel()):
            best = (name, ids)
    if best is None:
        return None
    with torch.no_grad():
        out = loaded.model(best[1][:tokens].unsqueeze(0), use_cache=True)
    kv = cache_to_kv(out.cache if hasattr(out, "cache") else out.past_key_values, dtype=harness.block_dtype)
    _, nbytes = harness.roundtrip(codec, kv, head_blocks=head_blocks, head_codec=head)
    return best[0], nbytes * 8 / kv.numel()


def verdict(name: str, result: QualityResult) -> tuple[str, str]:
    out = []
    for targets in (GATES, AIMS):
        target = targets.get(name)
        out.append("-" if target is None else ("ok" if not target.misses(result) else "MISS"))
    return out[0], out[1]


def fmt_params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items() if not (k == "zstd" and v == 0)) or "-"


def print_header(title: str) -> None:
    print(f"\n{title}")
    head = (
        f"{'row':34} {'params':54} {'KL':>9} {'top-1':>7} {'ppl':>8} {'relL2 K':>8} {'relL2 V':>8} "
        f"{'bits':>6} {'gate':>5} {'aim':>5}"
    )
    print(head)
    print("-" * len(head), flush=True)


def print_row(row: Row, r: QualityResult) -> None:
    gate, aim = verdict(row.codec, r)
    params = fmt_params(r.params) + (f" +{r.head_blocks} {r.head_codec}" if r.head_blocks else "")
    print(
        f"{row.label:34} {params:54} {r.kl:9.2e} {r.top1:7.2%} {r.ppl_change:+8.3%} "
        f"{r.rel_l2_k:8.4f} {r.rel_l2_v:8.4f} {r.bits_per_value:6.3f} {gate:>5} {aim:>5}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="defaults and a few int4 rows only")
    ap.add_argument("--nvme", action="store_true", help="part 4 only: the nvme tier as configured by default")
    ap.add_argument("--continuation", type=bounded_int(1), default=256, help="scored tokens per text")
    ap.add_argument(
        "--prefix-blocks", type=bounded_int(1), default=16, help="64-token blocks of prefix per text"
    )
    args = ap.parse_args()

    from kvstore.integrations.models import load_smollm2

    t0 = time.perf_counter()
    harness = QualityHarness(load_smollm2())
    harness.prepare(reference_texts(), prefix_blocks=args.prefix_blocks, continuation=args.continuation)
    texts = ", ".join(t.name for t in harness.texts)
    print(
        f"SmolLM2-135M-Instruct, float32 compute, bfloat16 blocks of 64 tokens; "
        f"{harness.positions} scored positions after {args.prefix_blocks * 64}-token prefixes of: {texts} "
        f"(prepared in {time.perf_counter() - t0:.0f} s)"
    )

    def run(title: str, rows: list[Row]) -> None:
        print_header(title)
        for row in rows:
            if row.codec in CODECS and row.head_codec in CODECS:
                codec, head = get_codec(row.codec, **row.params), get_codec(row.head_codec)
                print_row(row, harness.measure(codec, head_blocks=row.head_blocks, head_codec=head))

    if not args.nvme:
        run("1. Registered codecs at their defaults", [Row(n, n) for n in CODECS])
        run("2. int4: what each choice buys", [r for r in INT4_ROWS if not args.quick or r.label in QUICK])
    if not args.quick and not args.nvme:
        run("3. fp8 / int8 settings", OTHER_ROWS)

    nvme = NvmeConfig()
    codec, head = nvme.codecs()
    n_head = nvme.head_blocks if head is not None else 0
    print_header("4. nvme tier as configured by default (configs/default.toml [nvme])")
    row = Row(
        "nvme tier as configured by default",
        codec.name,
        codec.params(),
        n_head,
        head.name if head is not None else "raw",
    )
    print_row(row, harness.measure(codec, head_blocks=n_head, head_codec=head))
    long = prefix_bits(harness, 4096, codec, n_head, head)
    if long is not None:
        print(
            f"  the same for a 4,096-token prefix of {long[0]} (frame sizes only): {long[1]:.3f} bits/value"
        )
    print("\ngates (tests/model) and aims:")
    for name in CODECS:
        if name in GATES:
            print(f"  {name:5} gate {GATES[name].describe():40} aim {AIMS[name].describe()}")
    print(
        "KL is in nats; ppl is the relative change of perplexity on the true next tokens; "
        "bits include frame header and per-group stats."
    )


if __name__ == "__main__":
    main()
