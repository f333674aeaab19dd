"""Sessions at start, on a disk that holds blocks: each ends where its conversation can resume.

::

    session row on disk ── tail block on disk? ── yes: as recorded
                                                └─ no (a crash before its last put was written):
                              its deepest block on disk, if that continues its tail before the put
                              else its tail before the put, if on disk
                              else dead: the row is removed

Rows go in least recently used first, so that a tenant past its cap (rows of an earlier build)
keeps its most recent sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from kvstore.store.index import Entry
from kvstore.store.parts import StoreParts
from kvstore.store.sessions import SessionState

log = logging.getLogger("kvstore.store")


def restore_sessions(
    parts: StoreParts, rows: Iterable[tuple[str, dict[str, Any]]], forget: Callable[[str], object]
) -> None:
    """(At start, before the store serves.) Put the sessions of the disk's ``rows`` (name, fields)
    into ``parts.sessions``, each ending where it can resume (see the module sketch); ``forget(name)``
    removes the row of a session that is damaged or dead."""
    sessions = parts.sessions
    states: list[SessionState] = []
    for name, d in rows:
        try:
            states.append(SessionState.from_dict(name, d))
        except (KeyError, TypeError, ValueError) as err:
            log.warning("nvme: the session row %r lacks or mangles a field (%s); it is dropped", name, err)
            forget(name)
            sessions.dropped_dead += 1
    lost = {s.name: s.namespace for s in states if s.tail is not None and s.tail not in parts.index}
    deepest: dict[str, tuple[int, Entry]] = {}
    if lost:
        for e in parts.index.entries():
            for name in e.sessions:
                if lost.get(name) == e.ns:
                    depth = e.position()
                    if name not in deepest or depth > deepest[name][0]:
                        deepest[name] = (depth, e)
    states.sort(key=lambda s: s.last_access)
    for s in states:
        if s.name in lost:
            s = _resumed(parts, s, deepest.get(s.name))
        if s.tail is None:  # dead: nothing of its conversation is left to resume
            forget(s.name)
            sessions.dropped_dead += 1
            continue
        sessions.set(s)


def _resumed(parts: StoreParts, s: SessionState, found: tuple[int, Entry] | None) -> SessionState:
    """Session ``s``, whose tail is not on disk, ending where it can resume: at its tail before its
    last put (``before``, on disk), or deeper at ``found`` (its deepest block that is, by its tag)
    when that continues ``before`` (a block of the put that did reach the disk; one on another
    branch is an older turn's); with neither, nowhere (tail None)."""
    start = parts.index.get(s.before) if s.before is not None else None
    if found is not None and (start is None or _descends(found[1], start)):
        T = parts.namespaces.block_tokens(s.namespace)
        return replace(s, tail=found[1].key, tokens=(found[0] + 1) * T)
    if start is not None:
        return replace(s, tail=s.before, tokens=s.before_tokens)  # where its last flush left it
    return replace(s, tail=None, tokens=0)


def _descends(e: Entry | None, ancestor: Entry) -> bool:
    """Whether block ``e`` is ``ancestor`` or below it."""
    while e is not None:
        if e is ancestor:
            return True
        e = e.parent
    return False
