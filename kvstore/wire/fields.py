"""Checkers for the header fields of protocol messages (no I/O).

Each checker takes (field name, value as msgpack decoded it) and returns the
typed value, or raises RemoteProtocolError with a stable code (``bad_header``,
``invalid_tokens``, ``invalid_namespace``, ``layout``). ``wire`` is the way
back: a typed value as msgpack can carry it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.errors import InvalidNamespace, InvalidTokens, KVStoreError, LayoutError
from kvstore.keys import KEY_BYTES, Namespace, as_tokens
from kvstore.results import InvalidRequest
from kvstore.store.sessions import MAX_SESSION_BYTES, check_session_name
from kvstore.wire.errors import RemoteProtocolError

Check = Callable[[str, Any], Any]


def bad(name: str, want: str, got: Any) -> RemoteProtocolError:
    """The error for field ``name``: what it must be, and what it was (a number's value, else its type)."""
    shown = type(got).__name__
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        shown = f"{got!r}"[:40]
    return RemoteProtocolError("bad_header", f"field {name!r} must be {want}, got {shown}")


def nonneg_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise bad(name, "a non-negative integer", v)
    return v


def opt_int(name: str, v: Any) -> int | None:
    return None if v is None else nonneg_int(name, v)


def text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise bad(name, "a string", v)
    return v


def opt_text(name: str, v: Any) -> str | None:
    return None if v is None else text(name, v)


def session(name: str, v: Any) -> str:
    """A session name as a client gives it: a non-empty string of at most MAX_SESSION_BYTES (UTF-8).
    Control characters pass here, so that a session an earlier build stored under such a name can
    still be named (inspected, evicted); a put refuses them in a new name (Store.put)."""
    try:
        return check_session_name(text(name, v), MAX_SESSION_BYTES, allow_control=True)
    except InvalidRequest as e:
        raise RemoteProtocolError("bad_header", f"field {name!r}: {e}") from None


def opt_session(name: str, v: Any) -> str | None:
    return None if v is None else session(name, v)


def boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise bad(name, "true or false", v)
    return v


def opt_number(name: str, v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:  # no NaN, no inf
        raise bad(name, "a finite non-negative number", v)
    return float(v)


def anything(name: str, v: Any) -> Any:
    return v


def a_list(name: str, v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise bad(name, "a list", v)
    return v


def a_map(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise bad(name, "a map", v)
    return v


def opt_list(name: str, v: Any) -> list[Any] | None:
    return None if v is None else a_list(name, v)


def opt_map(name: str, v: Any) -> dict[str, Any] | None:
    return None if v is None else a_map(name, v)


def text_list(name: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v) or len(v) > 16:
        raise bad(name, "a list of at most 16 strings", v)
    return v


def shape(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) != 5:
        raise bad(name, "a list of 5 integers [L, 2, T, H, D]", v)
    return tuple(nonneg_int(name, x) for x in v)


def tokens(name: str, v: Any) -> np.ndarray:
    """Token ids from a ``bin`` of little-endian uint32 or a list of ints (range-checked)."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        if len(v) % 4:
            raise RemoteProtocolError(
                "invalid_tokens", f"field {name!r} holds {len(v)} bytes, not a multiple of 4"
            )
        return np.frombuffer(v, dtype="<u4")
    if isinstance(v, list):
        try:
            return as_tokens(v)
        except InvalidTokens as e:
            raise RemoteProtocolError("invalid_tokens", str(e)) from None
    raise bad(name, "bytes (uint32 little-endian) or a list of ints", v)


def opt_engine_keys(name: str, v: Any) -> bytes | None:
    """Engine page keys (kvstore.chains.KeyChain): a ``bin`` of 32 bytes per key, at least one."""
    if v is None:
        return None
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise bad(name, f"bytes ({KEY_BYTES} per engine key)", v)
    if not len(v) or len(v) % KEY_BYTES:
        raise RemoteProtocolError(
            "invalid_tokens",
            f"field {name!r} holds {len(v)} bytes; engine keys take {KEY_BYTES} bytes each (at least one)",
        )
    return bytes(v)


def opt_key(name: str, v: Any) -> bytes | None:
    """One engine key (32 bytes), or absent."""
    if v is None:
        return None
    if not isinstance(v, (bytes, bytearray, memoryview)) or len(v) != KEY_BYTES:
        raise RemoteProtocolError(
            "invalid_tokens", f"field {name!r} must be {KEY_BYTES} bytes (one engine key)"
        )
    return bytes(v)


def opt_tokens(name: str, v: Any) -> np.ndarray | None:
    return None if v is None else tokens(name, v)


def namespace(name: str, v: Any) -> Namespace:
    try:
        return Namespace.from_dict(v)
    except (InvalidNamespace, LayoutError) as e:
        raise RemoteProtocolError(e.code, str(e)) from None
    except (KVStoreError, TypeError, ValueError) as e:  # e.g. a layout field of the wrong type
        raise RemoteProtocolError("invalid_namespace", f"namespace does not describe one: {e}") from None


def wire(value: Any) -> Any:
    """A field value as msgpack can carry it."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value, dtype="<u4").tobytes()
    if isinstance(value, Namespace):
        return value.to_dict()
    if isinstance(value, tuple):
        return list(value)
    return value
