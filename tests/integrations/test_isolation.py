"""Namespaces through the transformers integration: the same tokens under another tenant, or from
another model with the same cache shapes, never reuse each other's blocks.

Different tenants must not see each other's blocks (a prefix-cache hit leaks that another tenant sent
the prompt, by its timing); different models must not, because the K/V of one is garbage to the other
even when the shapes agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvstore.client import KVStoreClient
from kvstore.integrations.chat import Conversation, run_turn
from kvstore.integrations.models import LoadedModel

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = (
    "The committee met on Tuesday to review the budget for the new library wing. After a long "
    "discussion of the heating costs, the roof repairs and the price of shelving, the members agreed "
    "to postpone the decision on the reading room until the architect sends revised drawings. "
    "The treasurer then presented the figures for the autumn book fair, which raised more than "
    "expected thanks to a donation of rare maps. The secretary reminded everyone that the minutes of the "
    "previous meeting still had to be approved, and that two members had asked for the agenda to be "
    "sent a week in advance. A volunteer offered to catalogue the donated maps over the winter, and "
    "the chair thanked the staff for keeping the old wing open during the repairs to the boiler. "
    "Please summarise the meeting in one sentence."
)


def test_tenants_and_models_never_share_blocks(serve: Callable[..., Any], smollm2: LoadedModel) -> None:
    model, layout = smollm2.model, smollm2.layout(dtype="float32")
    d = serve(hbm="64MiB", ram="16MiB")
    ids = Conversation(smollm2.tokenizer).ask(PROMPT)
    alice = KVStoreClient(d.endpoint, model=smollm2.model_id, layout=layout, tenant="alice", timeout=60.0)
    bob = KVStoreClient(d.endpoint, model=smollm2.model_id, layout=layout, tenant="bob", timeout=60.0)
    # a fine-tune with the same shapes: another model id, so another namespace
    tuned = KVStoreClient(d.endpoint, model="smollm2-135m-instruct-finetune", layout=layout, timeout=60.0)
    with alice, bob, tuned:
        a = run_turn(model, alice, ids, max_new_tokens=4, session="a")
        assert a.reused_tokens == 0 and a.stored_blocks >= 2
        # alice asks again: her own blocks come back
        assert run_turn(model, alice, ids, max_new_tokens=4, store=False).reused_tokens > 0
        # bob sends the very same tokens: nothing of alice's is reused, his blocks are stored apart
        b = run_turn(model, bob, ids, max_new_tokens=4, session="b")
        assert b.reused_tokens == 0 and b.stored_blocks == a.stored_blocks
        # another model with the same layout: no reuse either
        assert tuned.lookup(ids).matched_tokens == 0
        t = run_turn(model, tuned, ids, max_new_tokens=4)
        assert t.reused_tokens == 0 and t.stored_blocks == a.stored_blocks
        assert alice.stats()["store"]["blocks"] == 3 * a.stored_blocks
        # dropping bob's blocks leaves alice's and the fine-tune's in place
        assert bob.evict(tenant="bob").blocks == b.stored_blocks
        assert alice.lookup(ids).matched_tokens == a.stored_blocks * layout.block_tokens
        assert tuned.lookup(ids).matched_tokens == a.stored_blocks * layout.block_tokens
        assert bob.lookup(ids).matched_tokens == 0
