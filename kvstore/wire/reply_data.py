"""The data of operator replies, checked before a client uses it: ``DataOk`` carries any msgpack
value, so a map, a list or a result dataclass is built from it only when every field is there and
of its declared type; anything else is RemoteProtocolError ``bad_header`` naming what was wrong.
"""

from __future__ import annotations

import types
from dataclasses import MISSING, fields
from typing import Any, Union, get_args, get_origin, get_type_hints

from kvstore.wire.errors import RemoteProtocolError


def malformed(op: str, what: str) -> RemoteProtocolError:
    return RemoteProtocolError(
        "bad_header",
        f"the daemon's {op} reply is malformed: {what}; is the endpoint a kvstore daemon of this version?",
    )


def is_a(value: Any, hint: Any) -> bool:
    """Whether ``value`` (msgpack data) is of the type ``hint`` (a dataclass field's annotation)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(is_a(value, a) for a in args)
    if hint in (int, float):  # msgpack sends 2.0 as a float, 2 as an int; a bool is neither
        ok = (int,) if hint is int else (int, float)
        return isinstance(value, ok) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict) and all(
            is_a(k, args[0]) and is_a(v, args[1]) for k, v in value.items()
        )
    if origin is list:
        return isinstance(value, list) and all(is_a(v, args[0]) for v in value)
    return isinstance(value, origin or hint)


def as_map(op: str, value: Any, what: str = "its data") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise malformed(op, f"{what} is {type(value).__name__} {value!r:.60}, not a map")
    return value


def as_list(op: str, value: Any, what: str = "its data") -> list[Any]:
    if not isinstance(value, list):
        raise malformed(op, f"{what} is {type(value).__name__} {value!r:.60}, not a list")
    return value


def build(cls: type, data: Any, op: str) -> Any:
    """A ``cls`` from a reply's map: every field without a default present, each of its declared type.
    Keys ``cls`` does not have (a newer daemon's) are left out. RemoteProtocolError otherwise."""
    data = as_map(op, data, f"a {cls.__name__}")
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise malformed(op, f"a {cls.__name__} has no {f.name!r}")
            continue
        v = data[f.name]
        if not is_a(v, hints[f.name]):
            hint = hints[f.name]
            name = str(hint) if get_origin(hint) else getattr(hint, "__name__", str(hint))
            raise malformed(op, f"a {cls.__name__}'s {f.name!r} is {v!r:.60}, not {name}")
        values[f.name] = v
    return cls(**values)
