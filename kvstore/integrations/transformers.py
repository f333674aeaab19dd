"""Attach a Hugging Face transformers model to kvstore.

::

    cache, n = load_cache(client, input_ids, config=model.config)   # n tokens come from kvstore
    out = model(input_ids[:, n:], past_key_values=cache)             # compute only the rest
    save_cache(client, input_ids, cache, session="conv-42")         # keep the full blocks

kvstore's block tensor is ``[L, 2, T, H, D]``; a transformers cache layer holds
``[batch, H, T, D]`` per layer for K and for V. Batch size 1 only: a batch of
several prompts gets a clear error rather than a mix of their caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvstore.errors import LayoutError


class CacheClient(Protocol):
    layout: Any

    def get(self, token_ids: Any) -> Any: ...
    def put(self, token_ids: Any, kv: torch.Tensor, *, session: str | None = None) -> Any: ...


def single_sequence(input_ids: Any) -> torch.Tensor:
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"kvstore caches one sequence at a time; got a batch of {ids.shape[0]} "
                             "(call once per sequence)")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
    return ids.to("cpu")


def _check_full_attention(config: Any) -> None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        raise LayoutError("kvstore keeps full-attention caches only; this model has layer types "
                          f"{sorted(set(types))}")


@dataclass
class CacheHit:
    """What kvstore supplied for a prompt: the cache, the tokens it covers, the tier of each block."""

    cache: Any
    tokens: int
    tiers: list[str]


def fetch_cache(client: CacheClient, input_ids: Any, *, config: Any, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> CacheHit:
    """Like ``load_cache``, also saying which tier each reused block came from."""
    from transformers import DynamicCache

    _check_full_attention(config)
    ids = single_sequence(input_ids)
    cache = DynamicCache(config=config)
    if len(ids) < 2:
        return CacheHit(cache, 0, [])
    r = client.get(ids[:-1])
    if r.matched_tokens == 0 or r.kv is None:
        return CacheHit(cache, 0, [])
    want = dtype or getattr(config, "dtype", None) or r.kv.dtype
    if isinstance(want, str):
        want = getattr(torch, want)
    kv = r.kv.to(device=device or "cpu", dtype=want)
    n_layers = kv.shape[0]
    expected = getattr(config.get_text_config(decoder=True), "num_hidden_layers", n_layers)
    if n_layers != expected:
        raise LayoutError(f"store layout has {n_layers} layers, the model {expected}")
    for layer in range(n_layers):
        # [T, H, D] -> [1, H, T, D]
        k = kv[layer, 0].permute(1, 0, 2).unsqueeze(0).contiguous()
        v = kv[layer, 1].permute(1, 0, 2).unsqueeze(0).contiguous()
        cache.update(k, v, layer)
    return CacheHit(cache, int(r.matched_tokens), list(getattr(r, "tiers", []) or []))


def load_cache(client: CacheClient, input_ids: Any, *, config: Any, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> tuple[Any, int]:
    """A fresh ``DynamicCache`` holding the longest cached prefix of ``input_ids``, and its length.

    The length is block-aligned and at most ``len(input_ids) - 1``: the last
    prompt token is always left for the model to compute, since its logits
    are what generation starts from. ``dtype``/``device`` default to the
    model config's dtype and the CPU. With nothing cached the cache is empty
    and the length 0.
    """
    hit = fetch_cache(client, input_ids, config=config, dtype=dtype, device=device)
    return hit.cache, hit.tokens


def cache_to_kv(cache: Any, tokens: int) -> torch.Tensor:
    """The first ``tokens`` positions of a transformers cache as ``[L, 2, tokens, H, D]``."""
    layers = getattr(cache, "layers", None)
    if not layers:
        raise ValueError("the cache is empty")
    ks, vs = [], []
    for layer in layers:
        k, v = layer.keys, layer.values
        if k is None or k.dim() != 4:
            raise ValueError("cache layer is not initialized or not [batch, heads, tokens, head_dim]")
        if k.shape[0] != 1:
            raise ValueError(f"kvstore caches one sequence at a time; the cache holds a batch of {k.shape[0]}")
        if k.shape[2] < tokens:
            raise ValueError(f"the cache holds {k.shape[2]} tokens, {tokens} were asked for")
        ks.append(k[0, :, :tokens].permute(1, 0, 2))
        vs.append(v[0, :, :tokens].permute(1, 0, 2))
    return torch.stack([torch.stack(ks), torch.stack(vs)], dim=1)


def save_cache(client: CacheClient, input_ids: Any, cache: Any, *, session: str | None = None) -> Any:
    """Store the full blocks of ``cache`` for ``input_ids``; returns the client's put result.

    The cache may hold fewer positions than ``input_ids`` (after generation the
    last token has no K/V yet): only positions the cache holds are stored, and
    only whole blocks of them. Returns None when there is no whole block.
    """
    ids = single_sequence(input_ids)
    held = int(cache.get_seq_length())
    n = min(held, len(ids))
    block = client.layout.block_tokens
    n -= n % block
    if n == 0:
        return None
    kv = cache_to_kv(cache, n).to(client.layout.torch_dtype)
    return client.put(ids[:n], kv, session=session)
