"""The check of one configuration value (kvstore.config): each checker returns the value typed, or
raises ``Invalid`` saying what is allowed; config.py names the key and the source around it.

Endpoints are checked here for the CLI's flags too (``check_endpoint``, ``check_connect_endpoint``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstore.errors import ConfigError
from kvstore.units import parse_duration, parse_size

NEVER = ("never", "off", "inf")
PAGE_ALIGN = 256  # [policy] page_bytes is a multiple of it (see page_size)


class Invalid(Exception):
    """A value is not allowed; the message says what is."""


def ipc_socket_path(endpoint: str) -> Path | None:
    """The filesystem path of an ``ipc://`` endpoint, or None for tcp/inproc."""
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def choice(*allowed: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in allowed:
            raise Invalid(f"one of {', '.join(allowed)}")
        return v.lower()

    return check


def boolean(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return v.strip().lower() in ("true", "1", "yes", "on")
    raise Invalid("true or false")


def integer(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, str) and re.fullmatch(r"\s*-?\d+\s*", v):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise Invalid(f"an integer from {lo} to {hi}")
        return v

    return check


MAX_SIZE = 1 << 50  # 1024 TiB: any size past it is a typo (and past 2**63 the daemon's own numbers overflow)


def size(lo: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        try:
            n = parse_size(v)
        except ConfigError as e:
            raise Invalid(
                f"a size of at least {_bytes(lo)}, like '512MiB' or '8GiB' (units B, KiB, MiB, GiB, TiB; "
                "KB, MB, GB, TB decimal)"
            ) from e
        if n < lo:
            raise Invalid(f"a size of at least {_bytes(lo)}, like '512MiB' or '8GiB'")
        if n > MAX_SIZE:
            raise Invalid(f"a size of at most {MAX_SIZE >> 40}TiB")
        return n

    return check


def page_size(v: Any) -> int:
    # a block starts at a page boundary and the pools view it there as its dtype (up to 4 bytes an
    # element) and copy it with CUDA (256-byte aligned): page_bytes = 4097 was accepted, and every put
    # of a float16 block landing on an odd page failed `internal`
    allowed = f"a size of at least {PAGE_ALIGN} bytes and a multiple of {PAGE_ALIGN}, like '4KiB' or '64KiB'"
    try:
        n = size(PAGE_ALIGN)(v)
    except Invalid:
        raise Invalid(allowed) from None
    if n % PAGE_ALIGN:
        below = n - n % PAGE_ALIGN
        raise Invalid(f"{allowed}; {n} is not, {below} or {below + PAGE_ALIGN} is")
    return n


def duration(*, never: bool, most: tuple[float, str] | None = None) -> Callable[[Any], float]:
    """A positive duration; ``never`` allows "never" (infinity); ``most``: (seconds, as written) the
    longest allowed (a lease or a time-out that never ends is no lease or time-out)."""
    allowed = "a positive duration like '30s', '2h' or '7d'" + (", or 'never'" if never else "")
    if most is not None:
        allowed += f", at most {most[1]}"

    def check(v: Any) -> float:
        if never and isinstance(v, str) and v.strip().lower() in NEVER:
            return math.inf
        try:
            s = parse_duration(v)
        except ConfigError as e:
            raise Invalid(allowed) from e
        if s <= 0 or (math.isinf(s) and not never) or (most is not None and s > most[0]):
            raise Invalid(allowed)
        return s

    return check


# a tcp host: a name or IPv4 address, an [IPv6] address, or * (every interface)
_TCP = r"tcp://(\*|\[[0-9A-Fa-f:.%\w]+\]|[\w]([\w.-]*[\w])?):(\d+|\*)"


def endpoint(v: Any) -> str:
    m = re.fullmatch(rf"(ipc://[^@].*|{_TCP}|inproc://.+)", v.strip()) if isinstance(v, str) else None
    if m is not None:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes from the environment or a shell's $'\xff'
            raise Invalid("an endpoint in valid UTF-8 text") from None
    port = (m.group(4) if m is not None else None) or "*"
    if m is None or port != "*" and not 0 <= int(port) <= 65535:
        raise Invalid(
            "'ipc:///path/to/socket' (a file path), 'tcp://host:port' (a host name or address, [IPv6] "
            "or *; port up to 65535; 0 or *: any free one) or 'inproc://name'"
        )
    return v.strip()


def absolute_endpoint(endpoint: str, base: Path) -> str:
    """``endpoint`` with a relative ``ipc://`` path made absolute against ``base`` (``~`` expanded)."""
    path = ipc_socket_path(endpoint)
    if path is None:
        return endpoint
    try:
        return f"ipc://{(base / expand_home(path)).absolute()}"
    except ConfigError as e:
        raise Invalid(f"a socket path; {e}") from None


def check_endpoint(text: str) -> str:
    """``text`` stripped if it is a ZeroMQ endpoint kvstore can use; ConfigError saying what is allowed otherwise."""
    try:
        return absolute_endpoint(endpoint(text), Path.cwd())
    except Invalid as e:
        raise ConfigError(f"endpoint {text!r} is not allowed; expected {e}") from None


def check_connect_endpoint(text: str) -> str:
    """``text`` as check_endpoint returns it, if a client can connect there; ConfigError otherwise.

    A tcp host ``*`` or port ``*``/``0`` says where a daemon listens (every interface, any free port),
    never where to reach it: ZeroMQ refuses to connect there, or connects to nothing.
    """
    endpoint = check_endpoint(text)
    m = re.fullmatch(r"tcp://(.+):(\d+|\*)", endpoint)
    if m is None:
        return endpoint
    host, port = m.group(1), m.group(2)
    if port == "*" or int(port) == 0:
        raise ConfigError(
            f"endpoint {endpoint!r} is where a daemon listens (any free port), not an address to connect "
            "to; connect to tcp://HOST:PORT with the daemon's host and the port it bound"
        )
    if host == "*":
        raise ConfigError(
            f"endpoint {endpoint!r} is where a daemon listens (every interface), not an address to connect "
            f"to; connect to tcp://HOST:{port} with the daemon's host name or address "
            f"(tcp://127.0.0.1:{port} on its own host)"
        )
    return endpoint


def device(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v.strip().lower()):
        raise Invalid("'auto', 'cpu', 'cuda' or 'cuda:N'")
    return v.strip().lower()


def optional(check: Callable[[Any], Any], *off: Any) -> Callable[[Any], Any]:
    def opt(v: Any) -> Any:
        # compared with their types: False == 0 and 0.0 == 0, but `metrics_port = false` is no port number
        if any(type(v) is type(o) and v == o for o in off):
            return None
        # an environment variable's text: "0" is metrics_port's off as 0 is
        if isinstance(v, str) and v.strip().lower() in ("", "none", "off", *map(str, off)):
            return None
        try:
            return check(v)
        except Invalid as e:
            if not off:
                raise
            raise Invalid(f"{e}, or {' or '.join(map(repr, off))} or 'off' for none") from None

    return opt


def text(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise Invalid("a non-empty string")
    return v.strip()


def key_prefix(v: Any) -> str:
    """A Redis key prefix: text without braces (a {hash tag} in it would put every key on one node)."""
    out = text(v)
    if "{" in out or "}" in out:
        raise Invalid("a non-empty string without { or } (a Redis hash tag puts every key on one node)")
    return out


def pin(v: Any) -> bool | None:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return None
    try:
        return boolean(v)
    except Invalid as e:
        raise Invalid("true, false or 'auto'") from e


def nodes(v: Any) -> tuple[str, ...]:
    allowed = "cluster node URLs like 'redis://cache-1:7000', a list or comma-separated"
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise Invalid(allowed)
    urls = tuple(i.strip() for i in items if i.strip())
    if not urls:
        raise Invalid(allowed)
    for u in urls:
        if not re.fullmatch(r"(redis|rediss|valkey|valkeys)://\S+", u):
            raise Invalid(f"{allowed}; {redact_url(u)!r} is not one")
        try:
            urlsplit(u).port  # noqa: B018 - read for its check (ValueError: not a port number)
        except ValueError:
            raise Invalid(f"{allowed}; {redact_url(u)!r} has a port that is not a number 1-65535") from None
        if urlsplit(u).port == 0:
            raise Invalid(f"{allowed}; {redact_url(u)!r} has a port that is not a number 1-65535 (0)")
    return urls


_URL_PART = re.compile(r"([^\s,;]+)")  # one URL of several, however separated


def redact_url(url: str) -> str:
    """``url`` (or several, however separated) with every password (``user:secret@host``, with or
    without a scheme) shown as ``***``."""

    def one(m: re.Match[str]) -> str:
        scheme, sep, rest = m.group(1).rpartition("://")
        userinfo, at, host = rest.rpartition("@")
        if not at or ":" not in userinfo:
            return m.group(1)
        return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{host}"

    return _URL_PART.sub(one, url)


def path(v: Any) -> Path:
    if isinstance(v, Path):
        v = str(v)
    if not isinstance(v, str) or not v.strip() or "\x00" in v:
        raise Invalid("a directory path (relative paths resolve against the working directory; no NUL)")
    try:
        return expand_home(v.strip()).absolute()
    except ConfigError as e:
        raise Invalid(f"a directory path; {e}") from None


def expand_home(p: str | Path) -> Path:
    """``p`` with a leading ``~`` or ``~user`` made that home directory; ConfigError when there is
    none to make it (a user this host does not know, or no $HOME)."""
    try:
        return Path(p).expanduser()
    except RuntimeError:
        head = str(p).split("/", 1)[0]
        raise ConfigError(f"the home directory of {head!r} in {str(p)!r} is not known on this host") from None


def _bytes(n: int) -> str:
    return "1 byte" if n == 1 else f"{n} bytes"
