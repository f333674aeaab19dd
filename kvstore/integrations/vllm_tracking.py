"""The vLLM connector's scheduler-side bookkeeping of which of vLLM's blocks hold K/V known good.

``Tracked``: a scheduled request (its blocks, what of it is saved, where it stands on wrong K/V).
``Unsettled``: the loads of the steps whose output (their load errors) vLLM has not had yet, and
which requests share their blocks. ``Poisoned``: blocks whose K/V is wrong while vLLM's prefix
cache may still hand them out. kvstore.integrations.vllm decides from these what it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.integrations.vllm_settings import Variant


@dataclass
class Tracked:
    """A scheduled request, on the scheduler side."""

    request: Any
    variant: Variant
    block_ids: list[int]
    saved: int  # tokens [0, saved) are in kvstore, or on their way
    session: str | None
    saving: bool = False  # a save was scheduled: its blocks are freed only when the workers say
    loaded_at: int = -(1 << 30)  # the step that last loaded it from kvstore
    scheduled_at: int = 0  # the step that last scheduled it
    # the first token of a poisoned block it took from vLLM's prefix cache (see Poisoned): what it
    # computes from there on stands on wrong K/V, and is never saved
    poisoned_at: int | None = None
    # the first position of a failed block it shares with the load's request, which vLLM left for
    # that request to compute again (see update_connector_output); None once it has been
    relies_at: int | None = None


@dataclass(frozen=True)
class Load:
    """A load of step ``step`` by ``req_id`` into the vLLM blocks at positions ``first .. end-1`` of
    its block table."""

    step: int
    req_id: str
    first: int
    end: int
    block_ids: tuple[int, ...]


class Unsettled:
    """The loads of the steps not settled yet, and which requests share their blocks.

    vLLM's prefix cache shares a block only at its own position (its hash chains every token before
    it): a request holds a loaded block, if at all, at the position the load filled. So only those
    positions of a request are looked at, and each stretch of positions that loads cover once (a
    set of all their blocks there), whatever the number of loads::

        loader   [ a | b | L1 | L2 | L3 | c ]     loaded positions 2..4
        sharer   [ a | b | L1 | L2 | d ]          positions 2..4 looked at: L1, L2 shared
    """

    def __init__(self) -> None:
        self._loads: list[Load] = []
        self._spans: list[tuple[int, int, frozenset[int]]] | None = None  # merged, made when asked
        self._loader: dict[int, str] = {}  # loaded block -> the request that loads it

    def add(self, load: Load) -> None:
        self._loads.append(load)
        self._spans = None

    def settle(self, step: int) -> None:
        """Forget the loads of steps before ``step``: their output has reached the scheduler."""
        if self._loads and self._loads[0].step < step:
            self._loads = [u for u in self._loads if u.step >= step]
            self._spans = None

    def shared_by(self, t: Tracked) -> bool:
        """Whether ``t`` holds a block of a load by another request."""
        if not self._loads:
            return False
        if self._spans is None:
            self._spans, self._loader = self._merge()
        rid = t.request.request_id
        for first, end, blocks in self._spans:
            held = t.block_ids[first:end]
            if not blocks.isdisjoint(held) and any(self._loader.get(b, rid) != rid for b in held):
                return True
        return False

    def load_of(self, block: int, position: int) -> Load | None:
        """The oldest load not settled that filled ``position`` of its request with ``block``."""
        for u in self._loads:  # in step order
            i = position - u.first
            if 0 <= i < len(u.block_ids) and u.block_ids[i] == block:
                return u
        return None

    def _merge(self) -> tuple[list[tuple[int, int, frozenset[int]]], dict[int, str]]:
        loader: dict[int, str] = {}
        for u in self._loads:  # a block freed and loaded again: its latest loader
            loader.update(dict.fromkeys(u.block_ids, u.req_id))
        spans: list[tuple[int, int, set[int]]] = []
        for u in sorted(self._loads, key=lambda u: u.first):
            if spans and u.first <= spans[-1][1]:
                first, end, blocks = spans[-1]
                spans[-1] = (first, max(end, u.end), blocks)
                blocks.update(u.block_ids)
            else:
                spans.append((u.first, u.end, set(u.block_ids)))
        return [(a, b, frozenset(c)) for a, b, c in spans], loader


class Poisoned:
    """vLLM blocks whose K/V is wrong while vLLM's prefix cache may still hand them out.

    vLLM (0.32 and 0.33, ``_handle_invalid_blocks``) rolls back only the running requests that hold
    a block whose load failed. When the loader was aborted or preempted before that step's output,
    nobody recomputes it, yet the block keeps its hash, and so do the blocks computed over it: a
    later request takes them from the prefix cache and computes over garbage. Such a request is
    *tainted* at the first poisoned block it took (``Tracked.poisoned_at``): nothing from there on
    is saved, and the blocks it computes are poisoned in turn::

        failed load, loader gone      [ a | X | Y ]          X failed, Y computed over it: poisoned
        later request, prefix hit     [ a | X | Y | c | d ]  tainted at X: saves stop before it, c, d poisoned

    Where vLLM lends the connector its KV cache manager (0.33), a block nobody will compute again
    (no running request holds it) is dropped from vLLM's prefix cache as it is poisoned (``evict``:
    its hash goes, the block stays with whoever holds it): no later request takes it from there.
    With vLLM 0.32 the blocks stay in the prefix cache, and a request that takes one is tainted.

    A block stops being poisoned once a clean request writes all of it itself (computed, or loaded
    from kvstore): vLLM handed it out afresh (its old hash dropped), or the loader, rolled back,
    computes it again. The set holds vLLM block ids, so it never outgrows vLLM's block pool; it is
    usually empty, and then costs nothing a step."""

    def __init__(self, block_size: int, evict: Callable[[set[int]], None] | None = None) -> None:
        self._bs = block_size
        self._evict = evict
        self.blocks: set[int] = set()
        self.tainted: set[str] = set()  # requests with poisoned_at set

    def poison(self, block_ids: Iterable[int]) -> None:
        """``block_ids`` hold wrong K/V: poisoned, and dropped from vLLM's prefix cache (whoever holds
        them keeps them: a request rolled back to compute them again does, a chunk at a time)."""
        new = set(block_ids) - self.blocks
        if new:
            self.blocks |= new
            if self._evict is not None:
                self._evict(new)

    def active(self) -> bool:
        return bool(self.blocks or self.tainted)

    def failed(self, block_ids: Sequence[int], invalid: set[int]) -> int | None:
        """The loads into ``invalid`` failed: poison them, and the blocks after the first of them in a
        request's ``block_ids`` (computed over it). Returns that first position, or None."""
        first = next((i for i, b in enumerate(block_ids) if b in invalid), None)
        if first is not None:
            self.poison(block_ids[first:])
        return first

    def scheduled(self, steps: list[tuple[Tracked, int, int, bool]]) -> None:
        """A step's requests, each as (request, the first of its blocks it writes itself, its tokens
        after the step, whether it was (re)scheduled from waiting: its blocks before that one are
        vLLM's prefix-cache hits). The blocks it completes this step are clean, or poisoned when it is
        tainted; a request taking a poisoned block from the prefix cache is tainted from it."""
        bs = self._bs
        for t, _, _, fresh in steps:
            if fresh:  # its prefix is looked at again below; what it computed before is gone
                t.poisoned_at = None
                self.tainted.discard(t.request.request_id)
        # completions first: a block one request computes again this step is good for another
        # request that takes it from the prefix cache in the same step (vLLM computes both at once)
        for t, own, after, _ in steps:
            done = t.block_ids[own : after // bs]
            if t.poisoned_at is None:
                self.blocks.difference_update(done)
            else:
                self.poison(done)
        for t, own, after, fresh in steps:
            if fresh:
                held = 0
            elif t.relies_at is not None and t.poisoned_at is None:
                # a failed block it holds that vLLM left for the load's request to compute again: if
                # that has not happened by now (the request aborted, preempted, or computing it in
                # a later chunk), what this one computes stands on it
                held, t.relies_at = t.relies_at, None
            else:
                continue
            if not self.blocks:
                continue
            hit = next((held + i for i, b in enumerate(t.block_ids[held:own]) if b in self.blocks), None)
            if hit is not None:
                t.poisoned_at = hit * bs
                self.tainted.add(t.request.request_id)
                self.poison(t.block_ids[own : after // bs])

    def finished(self, t: Tracked) -> None:
        if t.poisoned_at is not None:
            self.tainted.discard(t.request.request_id)
