"""``kvstore demo``: a multi-turn conversation with SmolLM2-135M-Instruct through a running daemon.

Turn 1 hands the model a document and a question; every later turn asks
another question about it. Each turn prints the tokens kvstore supplied, the
time to first token with the cache and recomputing the whole prompt without
it, and the tier each reused block came from::

    turn 2: 1,310 prompt tokens, 1,280 reused (hbm x20)   TTFT 0.081 s with kvstore, 2.95 s without (36x)

Run it twice: the second run's first turn is served from the blocks the first
run stored (after a daemon restart, from nvme).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from kvstore.errors import KVStoreError
from kvstore.tiers.base import TierName

if TYPE_CHECKING:
    from kvstore.integrations.models import LoadedModel

QUESTIONS = (
    "In one sentence, what is this document about?",
    "Who does it say the licensor is?",
    "Does it allow me to sell copies? Answer briefly.",
    "What happens to the license if I sue someone over a patent in the work?",
)


class DemoUnavailable(KVStoreError):
    """The demo cannot run here (no model, no document text)."""

    code = "demo_unavailable"


@dataclass(frozen=True)
class DemoTurn:
    """What one turn printed, for callers that want the figures."""

    prompt_tokens: int
    reused_tokens: int
    tiers: list[str]
    ttft_cached_s: float
    ttft_scratch_s: float
    answer: str

    @property
    def speedup(self) -> float:
        return self.ttft_scratch_s / self.ttft_cached_s if self.ttft_cached_s > 0 else float("inf")


def document(max_tokens: int, tokenizer: Any) -> str:
    """The first ``max_tokens`` tokens of a real text found on this host (the Apache 2.0 license first)."""
    from kvstore.integrations.quality import reference_texts

    texts = dict(reference_texts())
    text = texts.get("Apache-2.0") or next(iter(texts.values()), "")
    if not text:
        raise DemoUnavailable(
            "no reference text found on this host (see kvstore.integrations.quality.reference_texts)"
        )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    out: str = tokenizer.decode(ids)
    return out


def tier_summary(tiers: Sequence[str]) -> str:
    """``["hbm", "hbm", "nvme"]`` -> ``"hbm x2, nvme x1"`` (in tier order)."""
    counts = Counter(tiers)
    return ", ".join(f"{t} x{counts[t]}" for t in map(str, TierName) if counts[t]) or "-"


def run_demo(
    endpoint: str,
    out: IO[str],
    *,
    session: str = "demo",
    tenant: str = "default",
    questions: Sequence[str] = QUESTIONS,
    document_tokens: int = 1024,
    max_new_tokens: int = 48,
    dtype: str = "bfloat16",
    timeout: float = 30.0,
    loaded: LoadedModel | None = None,
) -> list[DemoTurn]:
    """Hold the conversation against the daemon at ``endpoint``, printing each turn to ``out``.

    Stores every turn's prompt and answer under ``session`` (namespace: SmolLM2,
    ``tenant``, blocks kept in ``dtype``). Raises ModelUnavailable without the
    model, RequestTimeout when the daemon does not answer. ``loaded``: a model
    already loaded (default: load SmolLM2 now, ~15-50 s).
    """
    from kvstore.client import KVStoreClient
    from kvstore.integrations.chat import Conversation, run_turn, time_to_first_token
    from kvstore.integrations.models import load_smollm2

    if loaded is None:
        t0 = time.perf_counter()
        loaded = load_smollm2()
        out.write(f"loaded {loaded.model_id} in {time.perf_counter() - t0:.1f} s\n")
    out.write(f"daemon at {endpoint}; session {session!r}, tenant {tenant!r}\n")
    layout = loaded.layout(dtype=dtype)
    chat = Conversation(loaded.tokenizer)
    doc = document(document_tokens, loaded.tokenizer)
    turns: list[DemoTurn] = []
    with KVStoreClient(
        endpoint, model=loaded.model_id, layout=layout, tenant=tenant, timeout=timeout
    ) as client:
        client.ping()
        for i, question in enumerate(questions, 1):
            ids = chat.ask(f"{doc}\n\n{question}" if i == 1 else question)
            scratch = time_to_first_token(loaded.model, ids)  # the same prompt, recomputed from nothing
            turn = run_turn(
                loaded.model,
                client,
                ids,
                max_new_tokens=max_new_tokens,
                session=session,
                backoff=chat.backoff,
            )
            answer = chat.answer(turn.output_ids)
            result = DemoTurn(
                turn.prompt_tokens, turn.reused_tokens, turn.tiers, turn.ttft_s, scratch, answer
            )
            turns.append(result)
            out.write(f"\nturn {i}: {question}\n  {answer.strip()}\n")
            out.write(
                f"  {result.prompt_tokens:,} prompt tokens, {result.reused_tokens:,} reused "
                f"({tier_summary(result.tiers)}); stored {turn.stored_blocks} new "
                f"block{'' if turn.stored_blocks == 1 else 's'}\n"
            )
            # nothing reused: both computed the whole prompt, and their ratio is the machine's noise
            ratio = f"{result.speedup:.1f}x" if result.reused_tokens else "nothing reused yet"
            out.write(
                f"  time to first token: {result.ttft_cached_s:.3f} s with kvstore, "
                f"{result.ttft_scratch_s:.3f} s recomputing ({ratio})\n"
            )
            out.flush()
    return turns
