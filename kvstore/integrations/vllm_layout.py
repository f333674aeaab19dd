"""Where K and V lie in vLLM's paged KV caches, per attention backend (views, never copies), and
which models' caches the connector can read at all (``model_layout``, ``check_attention``).

vLLM 0.32+ gives each layer one ``[num_blocks, H, block_size, 2*D]`` tensor. FlashAttention,
FlashInfer, Triton and FlexAttention keep K and V side by side in the last dimension; the CPU
backend's "vec" kernels keep, per block and head, K transposed (``[D, block_size]``) then V
(``[block_size, D]``). The older ``[2, num_blocks, block_size, H, D]`` is read as it is.

A shape alone does not say which: B12X and ROCm's backends keep a page as two head slots, all
K heads then all V heads (``[num_blocks, 2, block_size, H*D]``), which for 2 KV heads has the
shape of FlashAttention's. So the 4-dimensional caches are read only for the backends named in
SIDE_BY_SIDE (each checked against its ``forward``'s layout), and the CPU backend's "vec"; a cache
whose backend vLLM cannot name is read by its shape (its specs' packing is checked at start).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from kvstore.errors import LayoutError
from kvstore.layout import KVLayout, dtype_name

log = logging.getLogger(__name__)

CPU_LAYOUTS = ("vec",)  # vLLM CPU attention flavours whose block interior kvstore reads (checked against HF)
# the backends whose [num_blocks, H, block_size, 2*D] cache holds K then V in its last dimension
SIDE_BY_SIDE = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")


def split_kv(
    cache: torch.Tensor, backend: str, num_kv_heads: int, head_dim: int, cpu_isa: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as ``[num_blocks, block_size, H, D]`` views (no copy).

    ``cpu_isa``: for vLLM's CPU backend, the kernel flavour it picked (``_get_attn_isa``): its
    blocks hold, per head, K transposed (``[D, block_size]``) then V (``[block_size, D]``) for
    "vec"; other flavours pack K for their instructions and are refused."""
    H, D = num_kv_heads, head_dim
    shape = tuple(cache.shape)
    if cache.dim() == 5 and shape[0] == 2 and shape[3:] == (H, D):  # [2, nb, bs, H, D]
        return cache[0], cache[1]
    if cache.dim() == 5 and shape[1] == 2 and shape[3:] == (H, D):  # [nb, 2, bs, H, D]
        return cache[:, 0], cache[:, 1]
    # (no name: a vLLM whose backends cannot be asked; packed pages are refused from its KV cache
    # specs at start, check_attention, so the shape is read as FlashAttention's)
    if (
        cache.dim() == 4
        and backend
        and not backend.upper().startswith("CPU")
        and backend.upper() not in SIDE_BY_SIDE
    ):
        raise LayoutError(
            f"vLLM's {backend} attention backend keeps K and V in a {shape} cache whose "
            "layout kvstore has not been checked against (B12X and ROCm's keep all K heads, then all "
            f"V heads); kvstore reads the caches of {', '.join(SIDE_BY_SIDE)} and CPU_ATTN: pick one "
            "with --attention-backend"
        )
    if cache.dim() == 4 and shape[1] == H and shape[3] == 2 * D:  # [nb, H, bs, 2D]
        if backend.upper().startswith("CPU"):
            if cpu_isa not in CPU_LAYOUTS:
                raise LayoutError(
                    f"vLLM's CPU attention packs K for {cpu_isa or 'an unknown instruction set'} in a way "
                    f"kvstore does not read; supported: {', '.join(CPU_LAYOUTS)}"
                )
            nb, _, bs, _ = shape
            try:
                halves = cache.view(nb, H, 2, bs * D)
            except RuntimeError:
                raise LayoutError(f"a {backend} cache {shape} must be contiguous per head") from None
            k = halves[:, :, 0].view(nb, H, D, bs).permute(0, 3, 1, 2)
            v = halves[:, :, 1].view(nb, H, bs, D).permute(0, 2, 1, 3)
            return k, v
        return cache[..., :D].permute(0, 2, 1, 3), cache[..., D:].permute(0, 2, 1, 3)
    if cache.dim() == 4 and shape[1] == 2 * H and shape[3] == D:  # [nb, 2H, bs, D]: K heads, then V heads
        return cache[:, :H].permute(0, 2, 1, 3), cache[:, H:].permute(0, 2, 1, 3)
    raise LayoutError(
        f"cannot find K and V of {H} heads x {D} in a {backend} KV cache of shape {shape}; "
        "kvstore reads [num_blocks, H, block_size, 2*D] and [2, num_blocks, block_size, H, D]"
    )


def layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else 0


def attention_backends(vllm_config: Any) -> dict[str, str]:
    """Attention backend name per layer name (empty when vLLM cannot say)."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
        return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}
    except Exception as e:  # an older or newer vLLM: fall back to reading the shapes
        log.debug("attention backends not found (%s)", e)
        return {}


def cpu_isa(vllm_config: Any, cache: torch.Tensor, head_dim: int) -> str:
    """The kernel flavour vLLM's CPU attention picks for these caches ("" when it cannot say)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(cache.dtype, cache.shape[2], head_dim, vllm_config.cache_config.cache_dtype))
    except Exception as e:
        log.debug("CPU attention flavour not found (%s)", e)
        return ""


def model_layout(vllm_config: Any, block_tokens: int) -> KVLayout:
    """The K/V layout of this vLLM instance's share of the model (its pipeline stage's layers, its
    tensor-parallel rank's KV heads), in the dtype vLLM keeps K/V in."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(mc, "use_mla", False):
        raise LayoutError("kvstore's vLLM connector keeps per-head K and V; MLA models are not supported")
    if getattr(vllm_config, "speculative_config", None) is not None:
        # a drafter's attention layers (EAGLE, MTP, a draft model) share the target's KV cache: their
        # K/V is no function of the target's layers kvstore keeps, and vLLM registers them beside
        raise LayoutError(
            "kvstore's vLLM connector keeps the target model's layers; speculative decoding "
            "(--speculative-config) is not supported with it"
        )
    cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
    if cache_dtype not in ("auto", str(mc.dtype).removeprefix("torch.")):
        raise LayoutError(
            f"kvstore keeps K/V in the model's dtype ({mc.dtype}); --kv-cache-dtype {cache_dtype} is not supported"
        )
    return KVLayout(
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        dtype=dtype_name(mc.dtype),
        block_tokens=block_tokens,
    )


# The KV cache groups whose blocks stay the request's for its whole life: a group of another kind
# (sliding window, chunked local, R-SWA) frees the blocks behind its window while the request runs, and
# a save planned on the request's block list would read blocks vLLM has given to another request.
_WHOLE_ATTENTION = ("FullAttentionSpec",)


def check_attention(vllm_config: Any, kv_cache_config: Any) -> None:
    """LayoutError unless every layer keeps the K/V of every token of a request in the blocks vLLM
    gave it, in the order of its block table: no sliding-window or chunked-local attention (vLLM
    frees their blocks behind the window as the request runs), no decode context parallelism
    (tokens interleaved across ranks)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if int(getattr(pc, "decode_context_parallel_size", 1) or 1) > 1:
        raise LayoutError(
            "kvstore's vLLM connector reads a request's tokens in the order of its block table; "
            "--decode-context-parallel-size > 1 is not supported"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:  # the connector follows one block table per request: the first group's
        raise LayoutError(
            f"kvstore's vLLM connector follows one block table per request, and this model's KV cache "
            f"has {len(groups)} groups ({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}); "
            "it is not supported"
        )
    kinds = {type(s).__name__ for group in groups for s in _members(group.kv_cache_spec)}
    packed = [
        s
        for group in groups
        for s in _members(group.kv_cache_spec)
        if getattr(s, "num_head_slots", None) is not None
        or getattr(s, "state_content_bytes", None) is not None
    ]
    if packed:  # B12X, ROCm's, quantized caches: K and V are not one head's side by side
        raise LayoutError(
            "this model's attention backend packs its KV cache pages "
            f"({getattr(packed[0], 'num_head_slots', None) or 'per head'} head slots of "
            f"{getattr(packed[0], 'state_content_bytes', None) or 'dense'} bytes); kvstore's vLLM "
            "connector reads unpacked caches only (FlashAttention, FlashInfer, Triton, FlexAttention "
            "or the CPU backend, without a quantized KV cache)"
        )
    other = sorted(kinds - set(_WHOLE_ATTENTION))
    window = getattr(mc, "get_sliding_window", lambda: None)() if kv_cache_config is None else None
    chunk = getattr(mc, "attention_chunk_size", None) if kv_cache_config is None else None
    if other or window or chunk:
        what = ", ".join(other) if other else "sliding-window" if window else "chunked-local"
        raise LayoutError(
            f"kvstore's vLLM connector keeps every token's K/V, and this model's attention ({what}) "
            "has vLLM free the blocks behind its window while a request runs; it is not supported "
            "(a model of full attention only, or one vLLM runs with --disable-sliding-window)"
        )


def _members(spec: Any) -> list[Any]:
    """The specs of a group's layers: UniformTypeKVCacheSpecs holds one kind per layer."""
    members = getattr(spec, "kv_cache_specs", None)
    return list(members.values()) if isinstance(members, dict) else [spec]
