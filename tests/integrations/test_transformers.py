"""load_cache / save_cache / run_turn against a real daemon, with a tiny random Llama (fast, no weights).

The blocks are stored in float32, the model's dtype, through hbm (raw): a
reused prefix is then the very K/V the model computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.errors import LayoutError
from kvstore.integrations.backoff import Backoff
from kvstore.integrations.chat import run_turn
from kvstore.integrations.models import layout_of
from kvstore.integrations.transformers import (
    BatchNotSupported,
    cache_kwargs,
    cache_to_kv,
    config_dtype,
    kv_to_cache,
    load_cache,
    save_cache,
)
from tests.hardening.conftest import daemons, write_config  # noqa: F401 - a fixture

T = 4  # block tokens


def tiny_model(config_cls: Any, model_cls: Any, **kw: Any) -> Any:
    """A random model of 2 layers, 2 KV heads of 8 dims (seeded: the same weights every time)."""
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **kw,
    )
    return model_cls(config).eval()


@pytest.fixture(scope="module")
def tiny() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny_model(LlamaConfig, LlamaForCausalLM)


@pytest.fixture
def client(serve: Callable[..., Any], tiny: Any) -> Iterator[KVStoreClient]:
    d = serve(hbm="8MiB", ram="8MiB")
    layout = layout_of(tiny.config, dtype="float32", block_tokens=T)
    with KVStoreClient(d.endpoint, model="tiny-llama", layout=layout, timeout=30.0) as c:
        yield c


def logits(model: Any, ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
    with torch.inference_mode():
        kwargs = cache_kwargs(model, cache) if cache is not None else {}
        return model(ids.unsqueeze(0), **kwargs).logits[0]


def test_save_then_load_reuses_the_prefix_and_gives_the_same_logits(client: KVStoreClient, tiny: Any) -> None:
    ids = torch.randint(0, 96, (30,))
    # nothing stored yet: an empty cache, nothing reused
    cache, n = load_cache(client, ids, config=tiny.config)
    assert n == 0 and cache.get_seq_length() == 0
    # turn 1 computes 18 tokens and stores their 4 whole blocks (16 tokens); the tail of 2 is not stored
    with torch.inference_mode():
        out = tiny(ids[:18].unsqueeze(0), use_cache=True)
    r = save_cache(client, ids[:18], out.past_key_values, session="s")
    assert (r.stored, r.present, r.failed) == (4, 0, [])
    # turn 2 (30 tokens) finds those 16 and computes only the other 14
    cache, n = load_cache(client, ids, config=tiny.config)
    assert n == 16 and cache.get_seq_length() == 16
    assert torch.allclose(logits(tiny, ids[16:], cache)[-1], logits(tiny, ids)[-1], atol=1e-5)
    # saving again rewrites nothing: the blocks are present
    with torch.inference_mode():
        out = tiny(ids[:18].unsqueeze(0), use_cache=True)
    assert save_cache(client, ids[:18], out.past_key_values).present == 4


def test_a_model_cast_after_loading_gets_a_cache_in_its_own_dtype(client: KVStoreClient, tiny: Any) -> None:
    # its config still says float32: load_cache(config=...) gave a float32 cache, and the bf16 forward failed
    import copy

    from kvstore.results import InvalidRequest

    ids = torch.randint(0, 96, (14,))
    with torch.inference_mode():
        out = tiny(ids.unsqueeze(0), use_cache=True)
    assert save_cache(client, ids, out.past_key_values).stored == 3
    half = copy.deepcopy(tiny)
    half.config.dtype = torch.float32  # as from_pretrained(dtype=torch.float32) records it
    half = half.to(torch.bfloat16)
    assert config_dtype(half.config) == torch.float32
    cache, n = load_cache(client, ids, model=half)
    assert n == 12 and cache.layers[0].keys.dtype == torch.bfloat16
    assert logits(half, ids[12:], cache).dtype == torch.bfloat16  # it runs
    with pytest.raises(InvalidRequest, match="needs the model"):
        load_cache(client, ids)


def test_the_last_prompt_token_is_always_computed(client: KVStoreClient, tiny: Any) -> None:
    ids = torch.randint(0, 96, (8,))
    with torch.inference_mode():
        out = tiny(ids.unsqueeze(0), use_cache=True)
    assert save_cache(client, ids, out.past_key_values).stored == 2
    # both blocks are stored, but the prompt's last token must run through the model: only block 0 comes back
    _, n = load_cache(client, ids, config=tiny.config)
    assert n == 4
    # a prompt of one whole block only: nothing can be reused
    _, n = load_cache(client, ids[:4], config=tiny.config)
    assert n == 0


def test_a_short_cache_stores_nothing(client: KVStoreClient, tiny: Any) -> None:
    ids = torch.randint(0, 96, (3,))
    with torch.inference_mode():
        out = tiny(ids.unsqueeze(0), use_cache=True)
    r = save_cache(client, ids, out.past_key_values)
    assert (r.stored, r.present) == (0, 0)


def test_a_batch_is_refused(client: KVStoreClient, tiny: Any) -> None:
    ids = torch.randint(0, 96, (2, 12))
    with pytest.raises(BatchNotSupported, match="batch of 2"):
        load_cache(client, ids, config=tiny.config)
    with torch.inference_mode():
        out = tiny(ids, use_cache=True)
    with pytest.raises(BatchNotSupported, match="batch of 2"):
        save_cache(client, ids[:1], out.past_key_values)
    with pytest.raises(BatchNotSupported):
        run_turn(tiny, client, ids, max_new_tokens=2)


def test_a_model_of_another_shape_is_refused(serve: Callable[..., Any], tiny: Any) -> None:
    d = serve()
    wrong = layout_of(tiny.config, dtype="float32", block_tokens=T)
    wrong = type(wrong)(
        num_layers=3,
        num_kv_heads=wrong.num_kv_heads,
        head_dim=wrong.head_dim,
        dtype="float32",
        block_tokens=T,
    )
    with (
        KVStoreClient(d.endpoint, model="tiny-llama", layout=wrong) as c,
        pytest.raises(LayoutError, match="layers, kv heads, head dim"),
    ):
        load_cache(c, torch.arange(12), config=tiny.config)


def test_cache_and_block_tensor_convert_both_ways(tiny: Any) -> None:
    ids = torch.randint(0, 96, (9,))
    with torch.inference_mode():
        cache = tiny(ids.unsqueeze(0), use_cache=True).past_key_values
    kv = cache_to_kv(cache)
    assert kv.shape == (2, 2, 9, 2, 8)  # [L, 2, T, H, D]
    assert torch.equal(kv[1, 0, :, 1], cache.layers[1].keys[0, 1])  # layer 1, K, head 1: [T, D]
    back = kv_to_cache(kv, tiny.config)
    assert back.get_seq_length() == 9
    assert torch.equal(cache_to_kv(back), kv)
    assert torch.equal(cache_to_kv(cache, tokens=4, dtype=torch.bfloat16), kv[:, :, :4].to(torch.bfloat16))
    with pytest.raises(ValueError, match="holds 9 tokens, 12 were asked"):
        cache_to_kv(cache, tokens=12)


def test_run_turn_reuses_the_last_turn_and_answers_as_without_cache(client: KVStoreClient, tiny: Any) -> None:
    prompt = torch.randint(0, 96, (10,))
    first = run_turn(tiny, client, prompt, max_new_tokens=8, session="chat", eos_token_id=-1)
    # prompt 10 + 8 answer tokens; the cache holds 17 of them (the last answer token was never fed): 4 blocks
    assert (first.reused_tokens, first.stored_blocks, len(first.output_ids)) == (0, 4, 8)
    follow = torch.cat([prompt, torch.tensor(first.output_ids), torch.randint(0, 96, (5,))])
    second = run_turn(tiny, client, follow, max_new_tokens=6, store=False, eos_token_id=-1)
    assert second.reused_tokens == 16 and second.tiers == ["hbm"] * 4
    # the same answer without kvstore at all
    with torch.inference_mode():
        out = tiny.generate(
            follow.unsqueeze(0), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert out[0, len(follow) :].tolist() == second.output_ids


def test_a_sliding_window_cache_is_refused_and_nothing_is_stored(client: KVStoreClient) -> None:
    # a Mistral-style config: a sliding window of 8 and no layer types; the cache keeps only the last
    # positions of every layer once the sequence is longer than the window
    from transformers import MistralConfig, MistralForCausalLM

    model = tiny_model(MistralConfig, MistralForCausalLM, sliding_window=8)
    ids = torch.randint(0, 96, (12,))
    with torch.inference_mode():
        cache = model(ids.unsqueeze(0), use_cache=True).past_key_values
    with pytest.raises(LayoutError, match="full-attention"):
        save_cache(client, ids[:4], cache)
    # a sequence longer than the window: "the cache holds 8 tokens, 12 were asked for", a ValueError
    # that ended run_turn after its answer was generated
    with pytest.raises(LayoutError, match="sliding window"):
        save_cache(client, ids, cache)
    assert client.lookup(ids).matched_tokens == 0
    # and the model is refused before anything runs (the config has no layer types to say so)
    with pytest.raises(LayoutError, match="sliding window of 8 tokens"):
        load_cache(client, ids, model=model)
    with pytest.raises(LayoutError, match="sliding window"):
        run_turn(model, client, ids, max_new_tokens=2)


def test_a_conversation_longer_than_the_daemons_limit_is_fetched_and_stored_up_to_it(
    serve: Callable[..., Any], tiny: Any
) -> None:
    # a get or put naming more tokens than max_tokens_per_request was refused whole: past it, a
    # conversation reused nothing, turn after turn. Its first blocks are what a call can carry
    d = serve(hbm="8MiB", ram="8MiB", max_tokens="18")
    layout = layout_of(tiny.config, dtype="float32", block_tokens=T)
    ids = torch.randint(0, 96, (30,))
    with KVStoreClient(d.endpoint, model="tiny-llama", layout=layout, timeout=30.0) as c:
        with torch.inference_mode():
            cache = tiny(ids.unsqueeze(0), use_cache=True).past_key_values
        assert save_cache(c, ids, cache).stored == 4  # 16 tokens: the blocks within 18
        cache, n = load_cache(c, ids, model=tiny)
        assert n == 16
        assert torch.allclose(logits(tiny, ids[n:], cache)[-1], logits(tiny, ids)[-1], atol=1e-4)


def test_a_daemon_that_does_not_answer_costs_a_miss_not_the_turn(tiny: Any, tmp_path: Any) -> None:
    ids = torch.randint(0, 96, (12,))
    layout = layout_of(tiny.config, dtype="float32", block_tokens=T)
    with KVStoreClient(f"ipc://{tmp_path}/nobody.sock", model="tiny-llama", layout=layout, timeout=0.3) as c:
        backoff = Backoff(logging.getLogger("test"))
        turn = run_turn(tiny, c, ids, max_new_tokens=3, backoff=backoff)
        # the next turns do not wait for it again: the chat's daemon is left alone a while
        t0 = time.perf_counter()
        again = run_turn(tiny, c, ids, max_new_tokens=3, backoff=backoff)
        assert time.perf_counter() - t0 < 0.3 <= turn.ttft_s
        assert again.output_ids == turn.output_ids and again.reused_tokens == 0
    assert (turn.reused_tokens, turn.stored_blocks, len(turn.output_ids)) == (0, 0, 3)
    with torch.inference_mode():
        want = int(tiny(ids.unsqueeze(0)).logits[0, -1].argmax())
    assert turn.output_ids[0] == want


def test_run_turn_fetches_the_cache_in_the_models_own_dtype(serve: Callable[..., Any], tiny: Any) -> None:
    """The blocks are kept in float32, the model computes in bfloat16 (cast after loading: its
    config names no dtype): the reused prefix comes in the model's dtype, not the store's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(LlamaConfig, LlamaForCausalLM).to(torch.bfloat16)
    assert config_dtype(model.config) in (None, torch.float32)
    d = serve(hbm="8MiB", ram="8MiB", ram_codec="raw")
    layout = layout_of(model.config, dtype="float32", block_tokens=T)
    prompt = torch.randint(0, 96, (10,))
    seen: list[torch.dtype] = []  # the dtype of the cache handed to each forward, once it holds K/V

    def cache_dtype(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and cache.get_seq_length() > 0:
            seen.append(cache.layers[0].keys.dtype)

    hook = model.register_forward_pre_hook(cache_dtype, with_kwargs=True)
    with KVStoreClient(d.endpoint, model="tiny-llama-bf16", layout=layout, timeout=30.0) as c:
        first = run_turn(model, c, prompt, max_new_tokens=4, eos_token_id=-1)
        follow = torch.cat([prompt, torch.tensor(first.output_ids), torch.randint(0, 96, (3,))])
        seen.clear()
        second = run_turn(model, c, follow, max_new_tokens=4, store=False, eos_token_id=-1)
    hook.remove()
    assert second.reused_tokens == 12
    assert seen and set(seen) == {torch.bfloat16}
    with torch.inference_mode():
        out = model.generate(
            follow.unsqueeze(0), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
        )
    assert out[0, len(follow) :].tolist() == second.output_ids


def test_any_store_failure_of_a_fetch_is_a_miss_not_the_turn(
    daemons: Any,  # noqa: F811 - the fixture imported above
    tmp_path: Any,
    tiny: Any,
) -> None:
    """Not only a time-out or an error reply: a prompt over the daemon's max_tokens_per_request is
    refused by the client itself (a LocalProtocolError); the turn is answered all the same."""
    d = daemons(write_config(tmp_path, server={"max_tokens_per_request": 8}))
    layout = layout_of(tiny.config, dtype="float32", block_tokens=T)
    ids = torch.randint(0, 96, (12,))
    with KVStoreClient(d.endpoint, model="tiny-llama", layout=layout, timeout=10.0) as c:
        c.lookup(ids[:8])  # the hello: the client knows the daemon's limits from now on
        turns = [run_turn(tiny, c, ids, max_new_tokens=3, store=False) for _ in range(2)]
    assert [t.reused_tokens for t in turns] == [0, 0]
    with torch.inference_mode():
        want = int(tiny(ids.unsqueeze(0)).logits[0, -1].argmax())
    assert turns[0].output_ids[0] == want and turns[1].output_ids == turns[0].output_ids
