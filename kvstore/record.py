"""The block record: what kvstore knows about a block besides its tensor.

Stored next to the frame on nvme (so the index can be rebuilt after a
restart) and kept in the index while the block is cached. Serialized with
msgpack, never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import numpy as np

from kvstore.errors import FrameError, UnsupportedVersion
from kvstore.keys import KEY_BYTES

RECORD_VERSION = 1
ENGINE_KEY = "engine_key"  # the ``extra`` field of a block named by an engine's page key (kvstore.chains)


@dataclass(frozen=True)
class BlockRecord:
    """Metadata of one block.

    ``parent`` is the previous block's key, or the namespace root for block 0;
    ``position`` is the block's index in its prefix (block ``i`` covers tokens
    ``[i*T, (i+1)*T)``); ``tokens`` are its token ids (little-endian uint32
    bytes) so that a hit can be verified and ``inspect`` can show the text. A block
    named by an engine's page key (kvstore.chains.KeyChain) keeps that key in
    ``extra`` instead, and no tokens.
    """

    key: bytes
    parent: bytes
    namespace: str
    position: int
    tokens: bytes
    sessions: tuple[str, ...] = ()
    created: float = 0.0
    last_access: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<u4")

    @property
    def engine_key(self) -> bytes:
        """The engine's page key naming this block; empty for a block named by tokens."""
        k = self.extra.get(ENGINE_KEY, b"")
        return bytes(k) if isinstance(k, (bytes, bytearray)) and len(k) == KEY_BYTES else b""

    def describe(self) -> str:
        """What the block holds, for people: its tokens' count, or its engine key."""
        if self.engine_key:
            return f"engine key {self.engine_key.hex()[:16]}"
        return f"{len(self.tokens) // 4} tokens"

    def with_session(self, session: str | None) -> BlockRecord:
        if session is None or session in self.sessions:
            return self
        return replace(self, sessions=(*self.sessions, session))

    def touched(self, now: float) -> BlockRecord:
        return replace(self, last_access=now)

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "v": RECORD_VERSION,
                "k": self.key,
                "p": self.parent,
                "ns": self.namespace,
                "i": self.position,
                "t": self.tokens,
                "s": list(self.sessions),
                "c": self.created,
                "a": self.last_access,
                "x": self.extra,
            },
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> BlockRecord:
        """Decode a packed record; anything malformed raises FrameError."""
        try:
            d = msgpack.unpackb(data, raw=False)
        except Exception as e:  # msgpack raises many types on damaged input
            raise FrameError(f"block record does not decode: {e}") from e
        if isinstance(d, dict) and isinstance(d.get("v"), int) and d["v"] > RECORD_VERSION:
            raise UnsupportedVersion(
                f"block record version {d['v']}; this build reads version {RECORD_VERSION}"
            )
        try:
            if not isinstance(d, dict) or d.get("v") != RECORD_VERSION:
                raise ValueError(f"unknown record version {d.get('v') if isinstance(d, dict) else d!r}")
            sessions = _typed(d, "s", (list, tuple))
            if not all(isinstance(s, str) for s in sessions):
                raise ValueError("session tags are not all strings")
            rec = cls(
                key=_typed(d, "k", bytes),
                parent=_typed(d, "p", bytes),
                namespace=_typed(d, "ns", str),
                position=_typed(d, "i", int),
                tokens=_typed(d, "t", bytes),
                sessions=tuple(sessions),
                created=float(_typed(d, "c", (int, float))),
                last_access=float(_typed(d, "a", (int, float))),
                extra=dict(_typed(d, "x", dict) if d.get("x") is not None else {}),
            )
        except Exception as e:  # msgpack raises many types on damaged input
            raise FrameError(f"block record does not decode: {e}") from e
        if len(rec.key) != KEY_BYTES or len(rec.parent) != KEY_BYTES or len(rec.tokens) % 4:
            raise FrameError("block record has malformed key, parent or tokens")
        return rec


def _typed(d: dict[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    """Field ``name`` of a record's dict, refused (ValueError) unless of ``types``: a field of the
    wrong type is damage, never converted into something that passes the checks (an int as
    ``bytes(n)`` zero bytes, a string as one session tag per character)."""
    v = d[name]
    if not isinstance(v, types) or isinstance(v, bool):
        raise ValueError(f"field {name!r} is a {type(v).__name__}")
    return v
