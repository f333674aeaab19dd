"""The namespaces the store has seen, by id, and the root key of each.

A namespace (model, layout, tenant) is registered by the first put under it
and persisted to nvme; its root is block 0's parent key in the chain
(``Namespace.root()``; a restored store reads it from block 0's record when
the namespace's own row could not be read).

Not thread-safe: the store holds its lock around every call.
"""

from __future__ import annotations

from kvstore.keys import Namespace


class NamespaceTable:
    """Namespaces by id, and their roots."""

    def __init__(self) -> None:
        self._by_id: dict[str, Namespace] = {}
        self._roots: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def items(self) -> list[tuple[str, Namespace]]:
        return list(self._by_id.items())

    def get(self, ns_id: str) -> Namespace | None:
        return self._by_id.get(ns_id)

    def add(self, ns: Namespace) -> bool:
        """Register ``ns``; True when it was new (then it needs persisting)."""
        if ns.id in self._by_id:
            return False
        self._by_id[ns.id] = ns
        self._roots[ns.id] = ns.root()
        return True

    def discard(self, ns_id: str) -> None:
        """Forget ``ns_id`` (registered by a put that then stored nothing: none of its blocks exists).
        Its root stays known: a namespace's root is its hash, the same whoever notes it."""
        self._by_id.pop(ns_id, None)

    def note_root(self, ns_id: str, root: bytes) -> None:
        """The root of ``ns_id`` as block 0's record names it (kept if one is known already)."""
        self._roots.setdefault(ns_id, root)

    def root(self, ns_id: str) -> bytes:
        """The root key of ``ns_id``; KeyError when neither the namespace nor a block 0 of it is known."""
        return self._roots[ns_id]

    def roots(self) -> dict[str, bytes]:
        """A copy of every known root, by namespace id."""
        return dict(self._roots)

    def block_tokens(self, ns_id: str) -> int:
        """Tokens per block of ``ns_id``; 0 when its description is unknown (it could not be read back)."""
        ns = self._by_id.get(ns_id)
        return ns.layout.block_tokens if ns is not None else 0
