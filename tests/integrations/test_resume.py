"""Resume a day-old conversation: turn 1 is stored, the daemon goes away and comes back, turn 2 reuses it.

::

    turn 1   [ system + user 1 + answer 1 ............ ]      stored: hbm -> write-through -> nvme
    daemon   stopped (SIGTERM, or SIGKILL once ``flush`` acknowledged the blocks durable), started again:
             hbm and ram are empty, the blocks live only on nvme
    turn 2   [ system + user 1 + answer 1 ............ | user 2 ]
             every whole block of turn 1 comes back from nvme; only the rest is computed

With the nvme codec ``raw`` turn 2's greedy answer equals the one computed
from scratch, token for token; with ``int4`` the next-token distributions stay
within the int4 quality gate (KL <= 1e-2) of the ones computed from scratch.
The blocks are stored in float32, the model's dtype, so that ``raw`` is the
very K/V the model computed.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.integrations.chat import Conversation, run_turn
from kvstore.integrations.models import LoadedModel
from kvstore.integrations.quality import GATES
from kvstore.integrations.transformers import cache_kwargs, fetch_cache

pytestmark = [pytest.mark.model, pytest.mark.slow]

QUESTION_1 = (
    "Here are notes from my garden diary this spring. The tomatoes were planted in late April, in the "
    "raised bed by the south fence, after a week of hardening off on the porch. The beans went in two "
    "weeks later, along the trellis, and the first shoots came up after nine days of warm rain. The "
    "squash waited until the start of June, after the last frost, in the corner where the compost heap "
    "used to be. The lettuce was sown in March under a cold frame and has been picked every week since. "
    "In May a late hailstorm broke two tomato stems, so I replaced them with seedlings from a neighbour. "
    "Which crop went into the ground first, and which bed did it go into?"
)
QUESTION_2 = "And which one was planted last?"
ANSWER_TOKENS = 24


def durable(client: KVStoreClient, blocks: int, timeout: float = 120.0) -> dict[str, Any]:
    """The daemon's durable acknowledgement: ``flush`` returns True once every block stored before it is
    on nvme and synced. The stats then show an empty write-through queue and ``blocks`` blocks on nvme."""
    assert client.flush(timeout=timeout), f"no durable acknowledgement within {timeout}s"
    s: dict[str, Any] = client.stats()["store"]
    assert s["write_queue"] == 0 and s["write_deferred"] == 0 and s["tiers"]["nvme"]["blocks"] == blocks, s
    return s


@torch.inference_mode()
def greedy_from_scratch(model: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    cache = None
    step = torch.tensor([ids])
    for _ in range(n):
        r = model(step, **cache_kwargs(model, cache)) if cache is not None else model(step, use_cache=True)
        cache = r.past_key_values
        out.append(int(r.logits[0, -1].argmax()))
        step = torch.tensor([[out[-1]]])
    return out


@torch.inference_mode()
def next_token_kl(model: Any, client: KVStoreClient, ids: list[int]) -> tuple[float, int, list[str]]:
    """Mean KL(scratch || cached) of the next-token distributions at every position computed after the
    reused prefix (so every one of them attends to the reused K/V); also the reused tokens and tiers."""
    t = torch.tensor(ids)
    hit = fetch_cache(client, t, config=model.config)
    cached = model(t[hit.tokens :].unsqueeze(0), **cache_kwargs(model, hit.cache)).logits[0].log_softmax(-1)
    scratch = model(t.unsqueeze(0), use_cache=True).logits[0, hit.tokens :].log_softmax(-1)
    kl = (scratch.exp() * (scratch - cached)).sum(-1)
    return float(kl.mean()), hit.tokens, hit.tiers


@pytest.mark.parametrize(
    ("stop", "codec"),
    [
        (signal.SIGTERM, "raw"),
        (signal.SIGTERM, "int4"),
        (signal.SIGKILL, "raw"),
        (signal.SIGKILL, "int4"),
    ],
    ids=["sigterm-raw", "sigterm-int4", "sigkill-raw", "sigkill-int4"],
)
def test_a_conversation_resumes_from_nvme_after_a_restart(
    serve: Callable[..., Any], smollm2: LoadedModel, stop: signal.Signals, codec: str
) -> None:
    model, layout = smollm2.model, smollm2.layout(dtype="float32")
    daemon = serve(hbm="4MiB", ram="4MiB", nvme_codec=codec)  # a block is 2.9 MB: hbm and ram hold one
    chat = Conversation(smollm2.tokenizer)
    with KVStoreClient(daemon.endpoint, model=smollm2.model_id, layout=layout, timeout=60.0) as c:
        first = run_turn(model, c, chat.ask(QUESTION_1), max_new_tokens=ANSWER_TOKENS, session="garden")
        chat.answer(first.output_ids)
        computed = first.prompt_tokens + len(first.output_ids) - 1  # the last answer token was never fed
        blocks = computed // layout.block_tokens
        assert first.reused_tokens == 0 and first.stored_blocks == blocks >= 2
        if stop == signal.SIGKILL:
            durable(c, blocks)
        # a day later: the daemon went away (cleanly, or killed) and came back
        code = daemon.restart(stop)
        assert code == (0 if stop == signal.SIGTERM else -signal.SIGKILL), daemon.output()
        s = c.stats()["store"]
        assert (s["tiers"]["hbm"]["blocks"], s["tiers"]["ram"]["blocks"]) == (0, 0)
        assert s["tiers"]["nvme"]["blocks"] == blocks
        assert [x.name for x in c.sessions()] == ["garden"]

        ids = chat.ask(QUESTION_2)
        assert c.lookup(ids).matched_tokens == blocks * layout.block_tokens  # the whole earlier prefix
        if codec == "raw":
            second = run_turn(model, c, ids, max_new_tokens=ANSWER_TOKENS, store=False)
            assert second.reused_tokens == blocks * layout.block_tokens
            assert second.tiers == ["nvme"] * blocks
            assert second.output_ids == greedy_from_scratch(model, ids, len(second.output_ids))
        else:
            kl, reused, tiers = next_token_kl(model, c, ids)
            assert reused == blocks * layout.block_tokens and tiers == ["nvme"] * blocks
            assert 0.0 < kl <= GATES["int4"].max_kl  # lossy, but within the gate
