"""What a request names: a chain of blocks, by token ids or by an engine's own page keys.

::

    TokenChain   tokens t            key_0 = H(root | t[0:T]),  key_i = H(key_{i-1} | t[iT:(i+1)T])
    KeyChain     engine keys e_i     key_i = H(eroot | e_i)     eroot = H(root | "kvstore/engine-key")
                 (+ the key p of       parent of key_0: H(eroot | p), or the root without p
                  the page before)

Both are chains: block ``i``'s parent is block ``i - 1``, so the store's
prefix tree, prefix-closed lookups and eviction, sessions and restarts treat
them alike. An engine key (SGLang's page hash, say) already names its whole
prefix, so its block key mixes in nothing but the namespace root: the same
page is the same block whatever prefix a call passes, and the same engine
key in another namespace or tenant is another block. Token blocks and engine
blocks never share a key: ``eroot``'s input is 50 bytes, never the 32 + 4T of
a token step, so no token chain reaches ``eroot`` (short of a SHA-256
collision).

A chain also says what the record of block ``i`` keeps to identify it
(``identity``): its token ids, or its engine key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from kvstore.errors import InvalidTokens
from kvstore.keys import KEY_BYTES, Namespace, as_tokens, iter_block_keys


def as_engine_key(key: Any) -> bytes:
    """One engine key as 32 bytes: ``bytes`` of 32, or 64 hex digits (SGLang's page hashes).
    Raises InvalidTokens otherwise."""
    if isinstance(key, str):
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raise InvalidTokens(f"engine key {key[:80]!r} is not hex") from None
    elif isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
    else:
        raise InvalidTokens(f"an engine key must be 32 bytes or 64 hex digits, got {type(key).__name__}")
    if len(raw) != KEY_BYTES:
        raise InvalidTokens(f"an engine key must be {KEY_BYTES} bytes (64 hex digits), got {len(raw)} bytes")
    return raw


@dataclass(frozen=True)
class TokenChain:
    """Blocks named by token ids (little-endian uint32): the whole prefix from block 0."""

    tokens: np.ndarray

    def blocks(self, block_tokens: int) -> int:
        """Full blocks named."""
        return len(self.tokens) // block_tokens

    def tokens_named(self, block_tokens: int) -> int:
        return len(self.tokens)

    def head(self, blocks: int, block_tokens: int) -> TokenChain:
        """The chain of the first ``blocks`` blocks."""
        return TokenChain(self.tokens[: blocks * block_tokens])

    def fields(self) -> dict[str, Any]:
        """This chain as message fields."""
        return {"tokens": self.tokens}

    def iter_keys(self, ns: Namespace, start: int = 0) -> Iterator[bytes]:
        """Block keys from block ``start``, each hashed when asked for (the ones before are hashed
        first: a token chain has no shortcut)."""
        keys = iter_block_keys(ns, self.tokens)
        if start:
            for _ in islice(keys, start):
                pass
        return keys

    def keys(self, ns: Namespace, stop: int) -> list[bytes]:
        """Block keys ``0 .. stop-1``."""
        return list(islice(self.iter_keys(ns), stop))

    def parent_key(self, ns: Namespace) -> bytes | None:
        """Block key of the block before block 0; None: block 0 hangs off the namespace root."""
        return None

    def identity(self, i: int, block_tokens: int) -> tuple[bytes, bytes]:
        """(token id bytes, engine key) the record of block ``i`` keeps: here, its tokens."""
        t = self.tokens[i * block_tokens : (i + 1) * block_tokens]
        return np.ascontiguousarray(t, dtype="<u4").tobytes(), b""


@dataclass(frozen=True)
class KeyChain:
    """Blocks named by an engine's chained page keys (``keys``: n * 32 bytes), after the page whose
    engine key is ``parent`` (None: from the namespace root)."""

    keys_raw: bytes
    parent: bytes | None = None

    def __post_init__(self) -> None:
        if len(self.keys_raw) % KEY_BYTES:
            raise InvalidTokens(f"engine keys take {KEY_BYTES} bytes each, got {len(self.keys_raw)} bytes")
        if self.parent is not None and len(self.parent) != KEY_BYTES:
            raise InvalidTokens(f"the parent engine key must be {KEY_BYTES} bytes, got {len(self.parent)}")

    @classmethod
    def of(cls, keys: Any, prefix: Any = ()) -> KeyChain:
        """From engine keys (each 32 bytes or 64 hex digits) and the keys of the pages before them
        (only the last one matters: it is the first page's parent)."""
        raw = b"".join(as_engine_key(k) for k in keys)
        prefix = list(prefix or ())
        return cls(raw, as_engine_key(prefix[-1]) if prefix else None)

    def __len__(self) -> int:
        return len(self.keys_raw) // KEY_BYTES

    def key(self, i: int) -> bytes:
        """Engine key ``i``."""
        return self.keys_raw[i * KEY_BYTES : (i + 1) * KEY_BYTES]

    def blocks(self, block_tokens: int) -> int:
        return len(self)

    def tokens_named(self, block_tokens: int) -> int:
        return len(self) * block_tokens

    def head(self, blocks: int, block_tokens: int) -> KeyChain:
        return KeyChain(self.keys_raw[: blocks * KEY_BYTES], self.parent)

    def fields(self) -> dict[str, Any]:
        return {"keys": self.keys_raw, "parent": self.parent}

    def iter_keys(self, ns: Namespace, start: int = 0) -> Iterator[bytes]:
        """Block keys from block ``start`` (each depends on its engine key alone: nothing before is hashed)."""
        sha, root, raw = hashlib.sha256, self._root(ns), self.keys_raw
        for off in range(start * KEY_BYTES, len(raw), KEY_BYTES):
            yield sha(root + raw[off : off + KEY_BYTES]).digest()

    def keys(self, ns: Namespace, stop: int) -> list[bytes]:
        return list(islice(self.iter_keys(ns), stop))

    def parent_key(self, ns: Namespace) -> bytes | None:
        if self.parent is None:
            return None
        return hashlib.sha256(self._root(ns) + self.parent).digest()

    def identity(self, i: int, block_tokens: int) -> tuple[bytes, bytes]:
        return b"", self.key(i)

    @staticmethod
    def _root(ns: Namespace) -> bytes:
        return ns.engine_root()


Chain = TokenChain | KeyChain


def as_chain(names: Any) -> Chain:
    """A chain as given, or token ids (anything ``as_tokens`` takes) as a TokenChain."""
    if isinstance(names, (TokenChain, KeyChain)):
        return names
    return TokenChain(as_tokens(names))
