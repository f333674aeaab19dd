"""Conversation: the chat template, extended turn by turn so that each prompt starts with the last one."""

from __future__ import annotations

import pytest

from kvstore.integrations.chat import Conversation
from kvstore.integrations.models import LoadedModel

pytestmark = pytest.mark.model


def test_each_prompt_extends_the_last_turn_token_for_token(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    chat = Conversation(tok)
    first = chat.ask("What is a prime number?")
    # turn 1 is the template's rendering, assistant header included
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "What is a prime number?"}], tokenize=False, add_generation_prompt=True
    )
    assert first == tok(rendered, add_special_tokens=False)["input_ids"]
    answer = tok("A number with exactly two divisors.", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids(tok.eos_token)
    assert chat.answer([*answer, end]) == "A number with exactly two divisors."
    second = chat.ask("Is 9 one?")
    # turn 2 starts with turn 1's prompt, the answer as generated and its end token ...
    assert second[: len(first) + len(answer) + 1] == [*first, *answer, end]
    # ... and is what the template renders for the whole conversation
    whole = tok.apply_chat_template(chat.messages, tokenize=False, add_generation_prompt=True)
    assert tok.decode(second) == whole


def test_an_answer_cut_short_gets_its_end_token(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    chat = Conversation(tok, system="Be brief.")
    first = chat.ask("Count to ten.")
    cut = tok("1, 2, 3", add_special_tokens=False)["input_ids"]  # max_new_tokens ran out
    chat.answer(cut)
    second = chat.ask("Go on.")
    assert second[len(first) : len(first) + len(cut) + 1] == [*cut, tok.convert_tokens_to_ids(tok.eos_token)]
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}


def test_asking_twice_without_an_answer_is_refused(smollm2: LoadedModel) -> None:
    chat = Conversation(smollm2.tokenizer)
    chat.ask("Hello?")
    with pytest.raises(ValueError, match="call Conversation.answer"):
        chat.ask("Anyone?")
