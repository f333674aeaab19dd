"""The checks of ``KVStoreClient``'s arguments: a wrong one raises the error a caller expects (naming
it), before anything is sent."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvstore.errors import ConfigError, LayoutError
from kvstore.results import InvalidRequest, as_int


def endpoint_arg(endpoint: str | None) -> str:
    """``endpoint`` (default: $KVSTORE_ENDPOINT or $KVSTORE_SERVER_ENDPOINT, else the default
    socket); ConfigError for one a daemon listens on but nobody can connect to (``tcp://*:5555``),
    or no text at all, or for the two variables naming different endpoints."""
    from kvstore.config import check_connect_endpoint, default_endpoint, env_endpoint

    if endpoint is not None and not isinstance(endpoint, str):
        raise ConfigError(f"endpoint must be a string like 'ipc:///path/kv.sock', got {endpoint!r}")
    return check_connect_endpoint(endpoint or env_endpoint() or default_endpoint())


def count_arg(name: str, v: Any, *, least: int = 0, none: bool = False) -> Any:
    """``v``, an int >= ``least`` (or None when ``none``); InvalidRequest naming ``name``."""
    if v is None and none:
        return v
    i = as_int(v, least)
    if i is None:
        raise InvalidRequest(
            f"{name} must be an int of {least} or more{' (or None)' if none else ''}; got {v!r}"
        )
    return i


def start_arg(v: Any) -> int:
    """A ``start`` token position: an int >= 0; LayoutError otherwise."""
    i = as_int(v)
    if i is None:
        raise LayoutError(f"start must be a token position, an int of 0 or more; got {v!r}")
    return i


def device_arg(v: Any) -> torch.device:
    """Where ``get`` puts the K/V: a cpu or (on a host that has one) cuda device; InvalidRequest otherwise."""
    try:
        d = torch.device(v)
    except (TypeError, RuntimeError) as e:
        raise InvalidRequest(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {v!r} ({e})") from None
    if d.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {v!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(
            f"device {v!r}: this process has no CUDA device (torch.cuda.is_available() is False)"
        )
    return d


def seconds_arg(name: str, v: Any, *, zero: bool = False) -> float:
    """``v`` seconds, a finite number above 0 (or 0 when ``zero``); InvalidRequest naming ``name``."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if not ok or v < 0 or (v == 0 and not zero):
        least = "0 or more" if zero else "more than 0"
        raise InvalidRequest(f"{name} must be a finite number of seconds, {least}; got {v!r}")
    return float(v)
