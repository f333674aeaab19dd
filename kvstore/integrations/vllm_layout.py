"""Where K and V lie in vLLM's paged KV caches, per attention backend: views, never copies.

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
