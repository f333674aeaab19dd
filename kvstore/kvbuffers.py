"""An inference engine's own KV buffers, as a destination of ``get_into`` and a source of ``put_from``.

A plain tensor ``[L, 2, T, H, D]`` (any device) is one; ``PagedKV`` is the
other: per layer a K and a V buffer of token slots ``[slots, H, D]`` and, for
the sequence at hand, the slot of each of its tokens. The engines' layouts
map onto it without copying::

    vLLM    kv_caches[l]: [2, num_blocks, block_size, H, D], block ids of the request
            -> K = kv_caches[l][0] as [num_blocks*block_size, H, D], slot of token p =
               block_ids[p // block_size] * block_size + p % block_size
    SGLang  k_buffer[l], v_buffer[l]: [size, H, D], the request's token indices (out_cache_loc)
            -> slots = the indices

Writes scatter a block's ``[T, H, D]`` per layer into the slots with one
``index_copy_`` per layer (K and V together when they share a tensor, as in
vLLM); reads gather with ``index_select``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.errors import LayoutError
from kvstore.layout import KVLayout


class PagedKV:
    """Per-layer K and V slot buffers (``[slots, H, D]`` each) and the slots of one sequence's tokens.

    ``kv``: per layer a ``[2, slots, H, D]`` tensor whose [0] and [1] are K and V, when the engine
    keeps them together (one scatter per layer instead of two).
    """

    def __init__(
        self,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        slots: torch.Tensor | Sequence[int],
        *,
        kv: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if len(k) != len(v) or not k:
            raise LayoutError(
                f"PagedKV needs as many K as V buffers (at least one), got {len(k)} and {len(v)}"
            )
        first = k[0]
        for name, bufs in (("k", k), ("v", v)):
            for i, b in enumerate(bufs):
                if (
                    b.dim() != 3
                    or b.shape[1:] != first.shape[1:]
                    or b.dtype != first.dtype
                    or b.device != first.device
                ):
                    raise LayoutError(
                        f"PagedKV {name}[{i}] is {tuple(b.shape)} {b.dtype} on {b.device}; every buffer must be "
                        f"[slots, {first.shape[1]}, {first.shape[2]}] {first.dtype} on {first.device}"
                    )
        self.k, self.v = list(k), list(v)
        self.kv = None if kv is None else list(kv)
        idx = torch.as_tensor(slots, dtype=torch.int64)
        if idx.dim() != 1:
            raise LayoutError(f"slots must be one index per token, got shape {tuple(idx.shape)}")
        size = min(b.shape[0] for b in (*self.k, *self.v))
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= size):
            raise LayoutError(f"slots must lie in 0..{size - 1}, got {int(idx.min())}..{int(idx.max())}")
        self.slots = idx.to(first.device)
        # vLLM's layout also as whole pages: (page size, page ids, per layer [2, pages, page*H*D]),
        # so that page-aligned runs move a page per row instead of a token per row
        self._pages: tuple[int, torch.Tensor, list[torch.Tensor]] | None = None

    @classmethod
    def vllm(
        cls, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, num_tokens: int
    ) -> PagedKV:
        """vLLM's per-layer caches ``[2, num_blocks, block_size, H, D]`` and a request's block ids,
        for its first ``num_tokens`` tokens."""
        c0 = kv_caches[0]
        if c0.dim() != 5 or c0.shape[0] != 2:
            raise LayoutError(f"a vLLM KV cache is [2, num_blocks, block_size, H, D], got {tuple(c0.shape)}")
        nb, bs = c0.shape[1], c0.shape[2]
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if num_tokens > len(ids) * bs:
            raise LayoutError(f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks, {len(ids)} given")
        p = torch.arange(num_tokens, dtype=torch.int64)
        slots = ids[p // bs] * bs + p % bs
        flat = [c.view(2, nb * bs, *c.shape[3:]) for c in kv_caches]
        paged = cls([f[0] for f in flat], [f[1] for f in flat], slots, kv=flat)
        if all(c.is_contiguous() for c in kv_caches):
            rows = [c.view(2, nb, -1) for c in kv_caches]
            paged._pages = (bs, ids[: -(-num_tokens // bs)].to(c0.device), rows)
        return paged

    @classmethod
    def sglang(
        cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], indices: torch.Tensor
    ) -> PagedKV:
        """SGLang's per-layer ``k_buffer``/``v_buffer`` (``[size, H, D]``) and a request's token indices."""
        return cls(k_buffers, v_buffers, indices)

    # -- shape ----------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return len(self.slots)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def check(self, layout: KVLayout) -> None:
        """LayoutError unless the buffers hold ``layout``'s layers, heads, head_dim and dtype."""
        b = self.k[0]
        if (
            len(self.k) != layout.num_layers
            or tuple(b.shape[1:]) != (layout.num_kv_heads, layout.head_dim)
            or b.dtype != layout.torch_dtype
        ):
            raise LayoutError(
                f"PagedKV has {len(self.k)} layers of [slots, {b.shape[1]}, {b.shape[2]}] {b.dtype}; the "
                f"namespace is {layout.num_layers} layers of [slots, {layout.num_kv_heads}, "
                f"{layout.head_dim}] {layout.dtype}"
            )

    # -- data -----------------------------------------------------------------------------
    def write(self, t0: int, src: torch.Tensor) -> None:
        """Scatter ``src`` (``[L, 2, n, H, D]``, any device) into the slots of tokens ``t0 .. t0+n-1``."""
        n = src.shape[2]
        src = src.to(self.device, non_blocking=True)
        if self._pages is not None and t0 % self._pages[0] == 0 and n % self._pages[0] == 0:
            bs, ids, rows = self._pages
            pids = ids[t0 // bs : (t0 + n) // bs]
            for layer, r in enumerate(rows):
                r.index_copy_(1, pids, src[layer].reshape(2, n // bs, -1))
            return
        idx = self.slots[t0 : t0 + n]
        for layer in range(len(self.k)):
            if self.kv is not None:
                self.kv[layer].index_copy_(1, idx, src[layer])
            else:
                self.k[layer].index_copy_(0, idx, src[layer, 0])
                self.v[layer].index_copy_(0, idx, src[layer, 1])

    def read(self, t0: int, out: torch.Tensor) -> torch.Tensor:
        """Gather tokens ``t0 .. t0+n-1`` into ``out`` (``[L, 2, n, H, D]``; a CPU ``out`` is filled
        from a gathered copy on the buffers' device). Returns ``out``."""
        n = out.shape[2]
        if self._pages is not None and t0 % self._pages[0] == 0 and n % self._pages[0] == 0:
            bs, ids, rows = self._pages
            pids = ids[t0 // bs : (t0 + n) // bs]
            for layer, r in enumerate(rows):
                out[layer].copy_(r.index_select(1, pids).view(2, n, *out.shape[3:]))
            return out
        idx = self.slots[t0 : t0 + n]
        same = out.device == self.device
        for layer in range(len(self.k)):
            for j, buf in ((0, self.k[layer]), (1, self.v[layer])):
                if same and out[layer, j].is_contiguous():
                    torch.index_select(buf, 0, idx, out=out[layer, j])
                else:
                    out[layer, j].copy_(buf.index_select(0, idx))
        return out


KVTarget = torch.Tensor | PagedKV


def target_tokens(target: KVTarget) -> int:
    return target.shape[2] if isinstance(target, torch.Tensor) else target.tokens


def check_target(target: KVTarget, layout: KVLayout, what: str) -> None:
    if isinstance(target, PagedKV):
        target.check(layout)
        return
    if not isinstance(target, torch.Tensor):
        raise LayoutError(
            f"{what} must be a tensor [L, 2, T, H, D] or a PagedKV, got {type(target).__name__}"
        )
    layout.check_tensor(target, what=what)


def write_target(target: KVTarget, t0: int, src: torch.Tensor) -> None:
    """Put ``src`` ``[L, 2, n, H, D]`` at tokens ``t0 ..`` of ``target``."""
    if isinstance(target, PagedKV):
        target.write(t0, src)
    else:
        target[:, :, t0 : t0 + src.shape[2]].copy_(src, non_blocking=True)


def target_view(target: KVTarget, t0: int, n: int) -> torch.Tensor | None:
    """A view of tokens ``t0 .. t0+n-1`` to write into directly, or None (a paged target)."""
    return None if isinstance(target, PagedKV) else target[:, :, t0 : t0 + n]


def empty_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised tensor; on the CPU its memory comes from numpy, which asks the kernel for
    huge pages for large arrays (madvise): filling a 94 MB get result then takes a third of the
    time it takes in torch.empty's memory, faulted in 4 KiB at a time."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)
