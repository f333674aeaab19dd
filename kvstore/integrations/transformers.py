"""Attach a Hugging Face transformers model (5.x) to kvstore.

::

    cache, n = load_cache(client, input_ids, model=model)           # n tokens come from kvstore
    out = model(input_ids[:, n:], **cache_kwargs(model, cache))      # compute only the rest
    save_cache(client, input_ids, cache, session="conv-42")         # keep the full blocks

kvstore's block tensor is ``[L, 2, T, H, D]``; a transformers cache layer holds
``[batch, H, T, D]`` per layer for K and for V. ``cache_to_kv`` and
``kv_to_cache`` convert between the two. Batch size 1 only: a batch of several
prompts raises BatchNotSupported rather than mixing their caches.

::

    prompt     [0 ........................................ n)
    blocks     [ block 0 | block 1 | ... | block k-1 ] tail      (block_tokens each)
    load_cache returns k*T tokens with k*T <= n-1: the last prompt token is always
               computed, its logits start the answer
    save_cache stores the whole blocks among the positions the cache holds
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvstore.errors import KVStoreError, LayoutError
from kvstore.layout import KVLayout
from kvstore.results import GetResult, InvalidRequest, PutResult


class BatchNotSupported(KVStoreError, ValueError):
    """A batch of several sequences was given; kvstore caches one sequence per call."""

    code = "batch_not_supported"


class CacheClient(Protocol):
    """What the integration needs of a client (KVStoreClient satisfies it)."""

    namespace: Any  # kvstore.keys.Namespace: .layout is the KVLayout of the stored blocks

    def get(self, token_ids: Any, *, device: torch.device | str = "cpu") -> GetResult: ...
    def put(self, token_ids: Any, kv: torch.Tensor, session: str | None = None) -> PutResult: ...


@dataclass(frozen=True)
class CacheHit:
    """What kvstore supplied for a prompt: a fresh cache, the tokens it covers, the tier of each block."""

    cache: Any  # transformers.DynamicCache
    tokens: int
    tiers: list[str] = field(default_factory=list)


def single_sequence(input_ids: Any) -> torch.Tensor:
    """``input_ids`` (``[T]``, ``[1, T]``, a list, ...) as a 1-D CPU tensor; BatchNotSupported for a batch > 1."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise BatchNotSupported(
                f"kvstore caches one sequence at a time; got a batch of {ids.shape[0]} "
                "(call once per sequence, with input_ids[i:i+1])"
            )
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
    return ids.to("cpu")


def client_layout(client: CacheClient) -> KVLayout:
    """The layout the client stores blocks in; LayoutError for an operator's client without one."""
    ns = getattr(client, "namespace", None)
    if ns is None:
        raise LayoutError("this client has no namespace; create it with model= and layout=")
    layout: KVLayout = ns.layout
    return layout


def token_limit(client: CacheClient, block_tokens: int) -> int:
    """The most tokens one get or put of ``client`` may name (the daemon's max_tokens_per_request, in
    whole blocks; its hello says it, made first if need be), or no limit. A conversation longer than
    that is fetched and stored up to it, as the engines' connectors do: every block's key chains from
    the first token, so its first blocks are the ones a call can carry (a call naming more is refused
    whole, and the conversation would reuse nothing from then on)."""
    limit = getattr(client, "max_tokens", None)
    if limit is None and callable(getattr(client, "ping", None)):
        client.ping()  # type: ignore[attr-defined]
        limit = getattr(client, "max_tokens", None)
    return sys.maxsize if not isinstance(limit, int) else limit // block_tokens * block_tokens


def check_model(layout: KVLayout, config: Any) -> None:
    """Refuse (LayoutError) a model whose cache does not have the client layout's shape, or that is
    not all full attention (a sliding-window layer's cache is not a prefix of the sequence)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        raise LayoutError(
            f"kvstore keeps full-attention caches only; this model has layer types {sorted(set(types))}"
        )
    if _sliding_layers(config):  # a sliding window without layer types (Mistral's config)
        raise LayoutError(
            f"kvstore keeps full-attention caches only; this model's attention is a sliding window of "
            f"{getattr(text, 'sliding_window', '?')} tokens"
        )
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    model_shape = (text.num_hidden_layers, heads, head_dim)
    store_shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if model_shape != store_shape:
        raise LayoutError(
            f"the model's cache is (layers, kv heads, head dim) = {model_shape} but the client's "
            f"layout is {store_shape}; build the layout from the model (models.layout_of)"
        )


def _sliding_layers(config: Any) -> bool:
    """Whether the cache transformers builds for ``config`` keeps a sliding window in some layer (its
    own reading of the config: layer types, or a ``sliding_window`` alone)."""
    try:
        from transformers import DynamicCache

        layers = getattr(DynamicCache(config=config), "layers", None) or []
    except Exception:  # noqa: BLE001 - a config it cannot build a cache from: judged by its fields
        return False
    return any(getattr(layer, "is_sliding", False) is True for layer in layers)


def config_dtype(config: Any) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword arguments that hand ``cache`` to ``model``'s forward: ``cache=`` in transformers
    5.x (where ``past_key_values=`` is deprecated), ``past_key_values=`` before."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return {name: cache, "use_cache": True}


def cache_to_kv(cache: Any, *, tokens: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first ``tokens`` positions (default: all) of a batch-1 cache as ``[L, 2, T, H, D]`` (a new tensor).

    Raises BatchNotSupported for a cache of several sequences, ValueError for an
    empty cache or one holding fewer than ``tokens`` positions, LayoutError for a cache with a
    layer that does not hold the sequence from its start (a sliding window's).
    """
    layers = getattr(cache, "layers", None)
    if not layers or getattr(layers[0], "keys", None) is None or layers[0].keys.dim() != 4:
        raise ValueError("the cache is empty (no layer holds [batch, heads, tokens, head_dim] keys)")
    k0 = layers[0].keys
    if k0.shape[0] != 1:
        raise BatchNotSupported(
            f"kvstore caches one sequence at a time; the cache holds a batch of {k0.shape[0]}"
        )
    sliding = next((i for i, layer in enumerate(layers) if getattr(layer, "is_sliding", False) is True), None)
    if sliding is not None:  # it holds the last positions, however many the sequence has
        raise LayoutError(
            f"layer {sliding} of the cache ({type(layers[sliding]).__name__}) is a sliding window: "
            "kvstore keeps full-attention caches only"
        )
    held = int(k0.shape[2])
    t = held if tokens is None else tokens
    if t > held:
        raise ValueError(f"the cache holds {held} tokens, {t} were asked for")
    for i, layer in enumerate(layers):
        # a sliding window's (or a shorter) layer keeps the last positions, not the first: storing
        # it as positions 0.. would store K/V of other tokens
        keys = getattr(layer, "keys", None)
        if (
            getattr(layer, "is_sliding", False) is True
            or keys is None
            or keys.dim() != 4
            or keys.shape[2] < t
        ):
            raise LayoutError(
                f"layer {i} of the cache ({type(layer).__name__}) does not hold positions 0..{t - 1} "
                "of the sequence: kvstore keeps full-attention caches only"
            )
    _, heads, _, dim = k0.shape
    out = torch.empty((len(layers), 2, t, heads, dim), dtype=dtype or k0.dtype, device=k0.device)
    for i, layer in enumerate(layers):
        out[i, 0].copy_(layer.keys[0, :, :t].transpose(0, 1))  # [H, T, D] -> [T, H, D], cast in the copy
        out[i, 1].copy_(layer.values[0, :, :t].transpose(0, 1))
    return out


def kv_to_cache(
    kv: torch.Tensor,
    config: Any,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Any:
    """A fresh batch-1 ``DynamicCache`` holding ``kv`` ``[L, 2, T, H, D]``, cast to ``dtype`` on ``device``."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    # one pass does the permute to [L, 2, H, T, D], the cast and the move; each layer's K/V is then a
    # contiguous view of it
    buf = torch.empty(
        (kv.shape[0], 2, kv.shape[3], kv.shape[2], kv.shape[4]),
        dtype=dtype or kv.dtype,
        device=device if device is not None else kv.device,
    )
    buf.copy_(kv.permute(0, 1, 3, 2, 4))
    cache = DynamicCache(config=config)
    for i in range(buf.shape[0]):
        k, v = buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0)
        layer = cache.layers[i] if i < len(cache.layers) else None
        if type(layer) is DynamicLayer:
            # update() concatenates onto what the layer holds: a second copy of the whole prefix. An
            # empty update initializes the layer (whatever that sets in this transformers version).
            layer.update(k[:, :, :0], v[:, :, :0])
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, i)
    return cache


def fetch_cache(
    client: CacheClient,
    input_ids: Any,
    *,
    config: Any = None,
    model: Any = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CacheHit:
    """Like ``load_cache``, also saying which tier each reused block came from (``CacheHit.tiers``)."""
    from transformers import DynamicCache

    if model is not None:  # what the model runs in now: a model cast after loading keeps its config's dtype
        config = config if config is not None else model.config
        dtype = dtype or model.dtype
        device = device if device is not None else model.device
    if config is None:
        raise InvalidRequest("load_cache needs the model (model=model) or its config (config=model.config)")
    layout = client_layout(client)
    check_model(layout, config)
    ids = single_sequence(input_ids)
    dtype = dtype or config_dtype(config) or layout.torch_dtype
    empty = CacheHit(DynamicCache(config=config), 0, [])
    if len(ids) <= layout.block_tokens:  # no whole block fits before the last token
        return empty
    r = client.get(ids[: min(len(ids) - 1, token_limit(client, layout.block_tokens))])
    if r.matched_tokens == 0 or r.kv is None:
        return empty
    cache = kv_to_cache(r.kv, config, dtype=dtype, device=device or "cpu")
    return CacheHit(cache, int(r.matched_tokens), list(r.tiers))


def load_cache(
    client: CacheClient,
    input_ids: Any,
    *,
    config: Any = None,
    model: Any = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[Any, int]:
    """A fresh ``DynamicCache`` holding the longest cached prefix of ``input_ids``, and its length.

    The length is block-aligned and at most ``len(input_ids) - 1``: the last
    prompt token is always left for the model to compute, since its logits
    are what generation starts from. Give the ``model`` (its config, dtype and
    device are used) or its ``config``; ``dtype``/``device`` default to the
    model's (with ``config`` alone: the config's dtype, which a model cast
    after loading does not update, and the CPU). With nothing cached the cache
    is empty and the length 0. Raises BatchNotSupported for a batch > 1,
    LayoutError when the model does not match the client's layout,
    InvalidRequest when neither ``model`` nor ``config`` is given.
    """
    hit = fetch_cache(client, input_ids, config=config, model=model, dtype=dtype, device=device)
    return hit.cache, hit.tokens


def save_cache(client: CacheClient, input_ids: Any, cache: Any, *, session: str | None = None) -> PutResult:
    """Store the whole blocks of ``cache`` for ``input_ids`` (cast to the client layout's dtype).

    The cache may hold fewer positions than ``input_ids`` (after generation the
    last token has no K/V yet): only positions both cover are stored, and only
    whole blocks of them; blocks the daemon already holds are not rewritten.
    Returns the client's PutResult (all zero when there is no whole block).
    """
    layout = client_layout(client)
    ids = single_sequence(input_ids)
    n = min(int(cache.get_seq_length()), len(ids), token_limit(client, layout.block_tokens))
    n -= n % layout.block_tokens
    if n == 0:
        return PutResult(0, 0, [])
    kv = cache_to_kv(cache, tokens=n, dtype=layout.torch_dtype).cpu()  # the client sends host memory
    return client.put(ids[:n], kv, session=session)
