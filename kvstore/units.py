"""Sizes and durations as people write them in configs and on the command line.

Sizes: ``4096``, ``64KiB``, ``512MiB``, ``8GiB`` (binary), ``1.5GB`` (decimal),
``64k``/``2G`` (K/M/G/T alone are binary, as in systemd). Durations:
``500ms``, ``30s``, ``15m``, ``2h``, ``7d``, ``1w``, ``1h30m``, or plain seconds.
Both raise ConfigError saying what a valid value looks like.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from kvstore.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (``"8GiB"``, ``"1.5GB"``, ``"64k"``, ``4096``). Raises ConfigError."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ConfigError(f"size {text!r} must be a string like '8GiB' or a number of bytes")
    if isinstance(text, float) and not float(text).is_integer():
        raise ConfigError(f"size {text!r} must be a whole, non-negative number of bytes")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"size {text!r} must be a whole, non-negative number of bytes")
        return int(text)
    m = _SIZE_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"size {text!r} is not a size; write e.g. 4096, '64KiB', '512MiB', '8GiB' or '1.5GB'"
        )
    try:
        value = Decimal(m.group(1)) * _SIZE_UNITS[unit]
    except InvalidOperation as e:  # pragma: no cover - the regex only admits decimals
        raise ConfigError(f"size {text!r} is not a number") from e
    if value != value.to_integral_value():
        raise ConfigError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def parse_duration(text: str | int | float) -> float:
    """Seconds in ``text`` (``"500ms"``, ``"30s"``, ``"2h"``, ``"7d"``, ``"1h30m"``, ``12.5``). Raises ConfigError."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ConfigError(f"duration {text!r} must be a string like '30s' or a number of seconds")
    if isinstance(text, (int, float)):
        if math.isnan(text) or text < 0:
            raise ConfigError(f"duration {text!r} must be a non-negative number of seconds")
        return float(text)
    s = text.strip().lower()
    parts = _DURATION_PART.findall(s)
    if (
        not s
        or "".join(n + u for n, u in parts) != s.replace(" ", "")
        or any(u and u not in _DURATION_UNITS for _, u in parts)
        or (len(parts) > 1 and not all(u for _, u in parts))
    ):
        raise ConfigError(
            f"duration {text!r} is not a duration; write e.g. '500ms', '30s', '15m', '2h', '7d' or '1h30m'"
        )
    return sum(float(n) * _DURATION_UNITS[u or "s"] for n, u in parts)


_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float | None) -> str:
    """``1536 -> "1.5 KiB"``, ``512 -> "512 B"``; binary units, three significant digits."""
    if n is None:
        return "-"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_BINARY) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(n)} B"
    return f"{value:.1f} {_BINARY[unit]}" if abs(value) < 100 else f"{value:.0f} {_BINARY[unit]}"
