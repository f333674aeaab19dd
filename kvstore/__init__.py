"""kvstore: a tiered KV-cache store for LLM inference (GPU, compressed host RAM, LMDB on NVMe).

Public names are imported on first use, so ``import kvstore`` stays cheap and
a client process never loads the store engine::

    from kvstore import KVLayout, KVStoreClient, Namespace, Store
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.client import KVStoreClient
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    from kvstore.store.engine import Store

__version__ = "0.1.0"

_EXPORTS = {
    "KVLayout": "kvstore.layout",
    "Namespace": "kvstore.keys",
    "KVStoreClient": "kvstore.client",
    "Store": "kvstore.store.engine",
}

__all__ = ["KVLayout", "KVStoreClient", "Namespace", "Store", "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
