"""One conversation turn through kvstore: look up, compute only the new tokens, generate, store.

::

    turn = run_turn(model, client, prompt_ids, max_new_tokens=64, session="conv-42")
    turn.reused_tokens, turn.ttft_s, turn.output_ids

Greedy decoding, batch size 1: enough for a chat loop and for measuring the
time to first token with and without the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.integrations.transformers import CacheClient, fetch_cache, save_cache, single_sequence


@dataclass
class TurnResult:
    output_ids: list[int]
    reused_tokens: int
    prompt_tokens: int
    tiers: list[str] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    stored_blocks: int = 0


@torch.inference_mode()
def run_turn(model: Any, client: CacheClient, input_ids: Any, *, max_new_tokens: int = 64,
             session: str | None = None, eos_token_id: int | None = None, store: bool = True) -> TurnResult:
    """Answer ``input_ids`` greedily, reusing every cached block and storing the new ones.

    The time to first token covers the lookup, the fetch, building the cache
    and computing the uncached tokens. With ``store`` the prompt and the
    answer's full blocks are saved under ``session`` for the next turn.
    """
    ids = single_sequence(input_ids)
    eos = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    t0 = time.perf_counter()
    hit = fetch_cache(client, ids, config=model.config, device=model.device)
    out = model(ids[hit.tokens:].unsqueeze(0).to(model.device), past_key_values=hit.cache, use_cache=True)
    nxt = int(out.logits[0, -1].argmax())
    ttft = time.perf_counter() - t0
    generated = [nxt]
    cache = out.past_key_values
    while len(generated) < max_new_tokens and nxt != eos:
        out = model(torch.tensor([[nxt]], device=model.device), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
        generated.append(nxt)
    stored = 0
    if store:
        full = torch.cat([ids, torch.tensor(generated, dtype=ids.dtype)])
        result = save_cache(client, full, cache, session=session)
        stored = int(getattr(result, "stored", 0) or 0) if result is not None else 0
    return TurnResult(generated, hit.tokens, len(ids), hit.tiers, ttft, time.perf_counter() - t0, stored)


@torch.inference_mode()
def time_to_first_token(model: Any, input_ids: Any) -> float:
    """Seconds to compute the first answer token from scratch (no cache): the baseline."""
    ids = single_sequence(input_ids)
    t0 = time.perf_counter()
    out = model(ids.unsqueeze(0).to(model.device), use_cache=True)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - t0
