"""Namespaces and chained block keys.

::

    root   = H("kvstore/1" | len-prefixed model | revision | layout | tenant)
    key_0  = H(root  | tokens[0:T]   as little-endian uint32)
    key_1  = H(key_0 | tokens[T:2T])          T = layout.block_tokens
    ...

``key_i`` names the whole prefix ``[0, (i+1)*T)``, so a block can only ever
match at its absolute position, after exactly the tokens it was computed
from, for the same model, layout and tenant. Only full blocks get keys; the
tail is recomputed by the engine. H is SHA-256 over canonical bytes: the same
keys come out in every process, Python version and machine.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from kvstore.errors import InvalidNamespace, InvalidTokens
from kvstore.layout import KVLayout

KEY_BYTES = 32
ENGINE_KEY_TAG = b"kvstore/engine-key"  # 18 bytes, not a multiple of 4: see kvstore.chains
MAX_TOKEN_ID = 2**32 - 1
_U32 = np.dtype("<u4")
_MAX_FIELD = 256


def _lp(field: bytes) -> bytes:
    return struct.pack("<I", len(field)) + field


def _check_field(name: str, value: Any, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise InvalidNamespace(f"namespace {name} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidNamespace(f"namespace {name} must not be empty")
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise InvalidNamespace(f"namespace {name} {value!r} is not valid UTF-8 text") from None
    if size > _MAX_FIELD:
        raise InvalidNamespace(f"namespace {name} is longer than {_MAX_FIELD} bytes")
    if any(ord(c) < 32 for c in value):
        raise InvalidNamespace(f"namespace {name} {value!r} contains control characters")
    return value


@dataclass(frozen=True)
class Namespace:
    """Who a block belongs to: blocks of different namespaces never match each other.

    Two models with identical shapes, or two tenants sending identical tokens,
    get disjoint keys, so neither can read nor time-probe the other's blocks.
    """

    model: str
    layout: KVLayout
    tenant: str = "default"
    revision: str = ""

    def __post_init__(self) -> None:
        _check_field("model", self.model, allow_empty=False)
        _check_field("tenant", self.tenant, allow_empty=False)
        _check_field("revision", self.revision, allow_empty=True)
        if not isinstance(self.layout, KVLayout):
            raise InvalidNamespace(f"namespace layout must be a KVLayout, got {type(self.layout).__name__}")

    def root(self) -> bytes:
        """The chain's root digest (32 bytes)."""
        return self._root

    @cached_property
    def _root(self) -> bytes:
        # computed once per instance: every lookup starts its chain here (the instance is frozen)
        h = hashlib.sha256(b"kvstore/1")
        for field in (
            self.model.encode(),
            self.revision.encode(),
            self.layout.canonical(),
            self.tenant.encode(),
        ):
            h.update(_lp(field))
        return h.digest()

    def engine_root(self) -> bytes:
        """The digest engine-supplied page keys are hashed under (kvstore.chains.KeyChain)."""
        return self._engine_root

    @cached_property
    def _engine_root(self) -> bytes:
        return hashlib.sha256(self._root + ENGINE_KEY_TAG).digest()

    @cached_property
    def id(self) -> str:
        """A short stable identifier (hex) for logs, metrics and LMDB metadata."""
        return self._root[:8].hex()

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "revision": self.revision,
            "tenant": self.tenant,
            "layout": self.layout.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Any) -> Namespace:
        if not isinstance(d, dict):
            raise InvalidNamespace(f"namespace must be a mapping, got {type(d).__name__}")
        unknown = set(d) - {"model", "revision", "tenant", "layout"}
        if unknown:
            raise InvalidNamespace(f"unknown namespace field(s) {sorted(unknown)}")
        if "model" not in d or "layout" not in d:
            raise InvalidNamespace("namespace needs 'model' and 'layout'")
        return cls(
            model=d["model"],
            layout=KVLayout.from_dict(d["layout"]),
            tenant=d.get("tenant", "default"),
            revision=d.get("revision", ""),
        )


TokenInput = Sequence[int] | np.ndarray | torch.Tensor


def as_tokens(tokens: Any) -> np.ndarray:
    """Validate token ids and return them as a 1-D little-endian uint32 array.

    Accepts a sequence of ints, a 1-D integer numpy array or a 1-D integer
    tensor (a ``[1, n]`` batch of one is flattened). Raises InvalidTokens for
    anything else, or for ids outside ``[0, 2**32)``.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise InvalidTokens(f"token ids must be integers, got a tensor of {tokens.dtype}")
        arr = tokens.detach().to("cpu", torch.int64).numpy()
    elif isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise InvalidTokens(f"token ids must be integers, got an array of {tokens.dtype}")
        arr = tokens
    elif isinstance(tokens, (bytes, bytearray, memoryview, str)) or not isinstance(tokens, Sequence):
        # bytes-like are Sequences of small ints (a memoryview of uint32 ids one id a byte): refused
        raise InvalidTokens(f"token ids must be a sequence of ints, got {type(tokens).__name__}")
    else:
        arr = _sequence_tokens(tokens)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise InvalidTokens(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.dtype == _U32:  # every uint32 is in range (ids off the wire are already this): no scan
        return np.ascontiguousarray(arr)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise InvalidTokens(f"token id {lo if lo < 0 else hi} out of range [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(arr, dtype="<u4")


def _sequence_tokens(tokens: Sequence[Any]) -> np.ndarray:
    """A sequence of Python (or numpy) ints as int64, in C loops only: no Python code per element.

    vLLM and SGLang hold prompts as lists; a per-element ``isinstance`` cost 9 ms for 32K ids
    where this costs about 1 ms (bench/protocol.py prints the list/array ratio). ``array('q')``
    refuses floats, strings and None itself (TypeError) and ids past int64 (OverflowError); it
    takes bools as 0 and 1, so only ids of 0 or 1 are looked at again.
    """
    try:
        arr = np.frombuffer(array("q", tokens), dtype=np.int64)
    except (TypeError, ValueError):
        bad = next((t for t in tokens if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
        raise InvalidTokens(f"token ids must be ints, found {bad!r}") from None
    except OverflowError:
        big = next((t for t in tokens if isinstance(t, int) and not 0 <= t <= MAX_TOKEN_ID), "?")
        raise InvalidTokens(f"token id {big} out of range [0, {MAX_TOKEN_ID}]") from None
    for i in np.flatnonzero(arr <= 1).tolist():  # rare: ids 0 and 1, or bools (a bool tensor too)
        t = tokens[i]
        if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
            raise InvalidTokens(f"token ids must be ints, found {t!r}")
    return arr


def chain(parent: bytes, block: np.ndarray) -> bytes:
    """The key of a block whose predecessor's key (or the root) is ``parent``; ``block``: its token
    ids (see ``as_tokens``: InvalidTokens for ids out of range, never wrapped onto others)."""
    return hashlib.sha256(parent + as_tokens(block).tobytes()).digest()


def block_keys(namespace: Namespace, tokens: Any) -> list[bytes]:
    """Keys of every full block of ``tokens``; a trailing partial block gets none."""
    return list(iter_block_keys(namespace, tokens))


def iter_block_keys(namespace: Namespace, tokens: Any) -> Iterator[bytes]:
    """The keys of ``block_keys``, each computed when the caller asks for it.

    A walk that stops at the first block not held hashes no further: a miss
    costs one SHA-256, not one per block of the prompt. Raises InvalidTokens
    at once (not at the first ``next``) for malformed ``tokens``.
    """
    arr = as_tokens(tokens)
    return _chain_keys(namespace.root(), arr.data.cast("B"), 4 * namespace.layout.block_tokens)


def _chain_keys(key: bytes, raw: memoryview, step: int) -> Iterator[bytes]:
    # a view of the prompt's bytes, sliced per block: no copy of the prompt, no array object per block
    sha = hashlib.sha256
    for off in range(0, len(raw) - step + 1, step):
        key = sha(key + raw[off : off + step]).digest()
        yield key
