"""One conversation turn through kvstore: look up, compute only the new tokens, generate, store.

::

    chat = Conversation(tokenizer)
    for question in questions:
        turn = run_turn(model, client, chat.ask(question), session="conv-42", backoff=chat.backoff)
        print(chat.answer(turn.output_ids), turn.reused_tokens, turn.ttft_s, turn.tiers)

``Conversation`` keeps the conversation as token ids and extends it with the
tokenizer's chat template, so turn k+1's prompt starts with exactly the tokens
turn k computed (prompt and answer) and every whole block of them is reused.
Greedy decoding, batch size 1: enough for a chat loop and for measuring the
time to first token with and without the cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import KVStoreError, LayoutError
from kvstore.integrations.backoff import Backoff
from kvstore.integrations.transformers import (
    CacheClient,
    CacheHit,
    cache_kwargs,
    fetch_cache,
    save_cache,
    single_sequence,
)

log = logging.getLogger("kvstore.integrations.chat")


@dataclass(frozen=True)
class TurnResult:
    """One answered turn: the generated ids (the end-of-turn token included when it came), how many
    prompt tokens came from kvstore and from which tier each block, timings, blocks stored."""

    output_ids: list[int]
    reused_tokens: int
    prompt_tokens: int
    tiers: list[str] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    stored_blocks: int = 0


@torch.inference_mode()
def run_turn(
    model: Any,
    client: CacheClient,
    input_ids: Any,
    *,
    max_new_tokens: int = 64,
    session: str | None = None,
    eos_token_id: int | list[int] | None = None,
    store: bool = True,
    backoff: Backoff | None = None,
) -> TurnResult:
    """Answer ``input_ids`` greedily, reusing every cached block and storing the new ones.

    The time to first token covers the fetch from the daemon, building the
    cache and computing the uncached tokens. Generation stops after
    ``max_new_tokens`` or at an end token (``eos_token_id``, default the
    model's). With ``store`` the whole blocks of the prompt and the answer are
    saved under ``session`` for the next turn (after the answer; not timed in
    the TTFT). Raises BatchNotSupported for a batch > 1, LayoutError for a model whose cache does
    not fit the client's layout. A daemon that does not answer (or is busy, or fails) costs the
    fetch at most its time-out and counts as a miss; with a ``backoff`` kept across turns
    (``Conversation.backoff``) it is then not asked again, for fetches nor stores, for a while: the
    next turns do not each wait for it. A store that fails is logged, and the turn's answer is
    returned with ``stored_blocks`` 0.
    """
    ids = single_sequence(input_ids)
    eos = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    backoff = backoff or Backoff(log)
    t0 = time.perf_counter()
    hit = None
    if backoff.available():
        try:
            hit = fetch_cache(client, ids, model=model)
        except LayoutError:  # a model that does not fit the client's layout: the caller's to fix
            raise
        except KVStoreError as e:  # the daemon away, busy or failing: a miss, not a failed turn
            backoff.failed("fetch of the cached prefix (the whole prompt is computed)", e)
    if hit is None:
        from transformers import DynamicCache

        hit = CacheHit(DynamicCache(config=model.config), 0, [])
    cache = hit.cache
    out = model(ids[hit.tokens :].unsqueeze(0).to(model.device), **cache_kwargs(model, cache))
    nxt = int(out.logits[0, -1].argmax())
    ttft = time.perf_counter() - t0
    generated = [nxt]
    while len(generated) < max_new_tokens and nxt not in stops:
        out = model(torch.tensor([[nxt]], device=model.device), **cache_kwargs(model, cache))
        nxt = int(out.logits[0, -1].argmax())
        generated.append(nxt)
    stored = 0
    if store and backoff.available():  # the cache now holds the prompt and every answer token but the last
        full = torch.cat([ids, torch.tensor(generated, dtype=ids.dtype)])
        try:
            stored = save_cache(client, full, cache, session=session).stored
        except KVStoreError as e:  # the answer stands; the next turn recomputes what was not stored
            backoff.failed("store of this turn's cache (not stored)", e)
    return TurnResult(generated, hit.tokens, len(ids), hit.tiers, ttft, time.perf_counter() - t0, stored)


@torch.inference_mode()
def time_to_first_token(model: Any, input_ids: Any) -> float:
    """Seconds to compute the first answer token from scratch (no cache): the baseline."""
    ids = single_sequence(input_ids)
    t0 = time.perf_counter()
    out = model(ids.unsqueeze(0).to(model.device), use_cache=True)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - t0


class Conversation:
    """A chat as token ids, extended turn by turn with the tokenizer's chat template.

    ``ask`` returns the prompt ids of the next turn: the ids so far (earlier
    prompts and the answers exactly as generated) plus the template's text for
    the new user message and the assistant header. Re-tokenizing a decoded
    answer can give other ids than the model generated; appending keeps the
    prefix identical, so the store's blocks match it.
    """

    def __init__(self, tokenizer: Any, *, system: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = (
            [] if system is None else [{"role": "system", "content": system}]
        )
        self.ids: list[int] = []
        self._end = tokenizer.eos_token  # the template's end-of-turn string, e.g. <|im_end|>
        self.backoff = Backoff(log)  # this chat's daemon, left alone a while once it did not answer

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        text: str = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def ask(self, text: str) -> list[int]:
        """Add a user message; the prompt ids of the whole conversation, ending with the assistant header.

        Raises ValueError when the previous question has no answer yet (call ``answer`` first).
        """
        if self.messages and self.messages[-1]["role"] == "user":
            raise ValueError(
                "the last question has no answer yet; call Conversation.answer(output_ids) first"
            )
        new = [*self.messages, {"role": "user", "content": text}]
        rendered = self._render(new, generation_prompt=True)
        if not self.ids:
            self.ids = self._encode(rendered)
        else:
            before = self._render(self.messages, generation_prompt=False)
            cut = before.rfind(self._end) + len(self._end)  # our ids end at the last answer's end token
            if cut < len(self._end) or not rendered.startswith(before[:cut]):
                self.ids = self._encode(rendered)  # the template rewrites history: start over
            else:
                self.ids = self.ids + self._encode(rendered[cut:])
        self.messages = new
        return list(self.ids)

    def answer(self, output_ids: list[int]) -> str:
        """Record the assistant's answer (ids as generated); returns its text. An answer cut short
        gets the end-of-turn token appended, as the template would render it."""
        end_id = self.tokenizer.convert_tokens_to_ids(self._end)
        ids = list(output_ids)
        if not ids or ids[-1] != end_id:
            ids.append(end_id)
        self.ids = self.ids + ids
        text: str = self.tokenizer.decode(ids[:-1], skip_special_tokens=True)
        self.messages = [*self.messages, {"role": "assistant", "content": text}]
        return text
