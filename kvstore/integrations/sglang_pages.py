"""SGLang's host pool as kvstore sees it: per-layer K and V pages, whatever the pool's layout, and the
pages a transfer names as a PagedKV destination or source."""

from __future__ import annotations

from typing import Any

import torch

from kvstore.errors import LayoutError
from kvstore.kvbuffers import PagedKV
from kvstore.layout import KVLayout, dtype_name

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostPages:
    """SGLang's host pool (MHATokenToKVPoolHost) as per-layer K and V pages ``[pages, page_size, H, D]``:
    views of its ``kv_buffer``, whatever its layout, for kvstore.kvbuffers.PagedKV."""

    def __init__(self, pool: Any) -> None:
        layout = getattr(pool, "layout", None)
        if layout not in LAYOUTS:
            raise ValueError(
                f"kvstore: the host pool layout {layout!r} is not supported; use --hicache-mem-layout "
                f"one of {', '.join(LAYOUTS)}"
            )
        kv = pool.kv_buffer
        if not isinstance(kv, torch.Tensor) or not hasattr(pool, "head_num"):
            raise ValueError(f"kvstore: {type(pool).__name__} is not an MHA host pool (MLA is not supported)")
        ps, n_layers = int(pool.page_size), int(pool.layer_num)
        pages = int(pool.size) // ps
        H, D = int(pool.head_num), int(pool.head_dim)
        if getattr(pool, "v_head_dim", D) != D:
            raise ValueError("kvstore: K and V head dims differ; kvstore blocks need one head_dim")
        per_layer: list[torch.Tensor] = []  # [2, pages, ps, H, D] per layer
        for layer in range(n_layers):
            if layout == "layer_first":  # [2, L, size, H, D]
                x = kv[:, layer, : pages * ps].unflatten(1, (pages, ps))
            elif layout == "page_first":  # [2, size, L, H, D]
                x = kv[:, : pages * ps, layer].unflatten(1, (pages, ps))
            else:  # page_first_direct: [2, pages, L, ps, H, D]
                x = kv[:, :pages, layer]
            per_layer.append(x)
        self.kv = per_layer
        self.k = [x[0] for x in per_layer]
        self.v = [x[1] for x in per_layer]
        self.page_size = ps
        if kv.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
            raise LayoutError(
                f"SGLang keeps this KV cache in {kv.dtype} (--kv-cache-dtype fp8): kvstore keeps K/V in "
                "the model's dtype, and an fp8 KV cache is not supported; run SGLang with "
                "--kv-cache-dtype auto"
            )
        self.layout = KVLayout(
            num_layers=n_layers,
            num_kv_heads=H,
            head_dim=D,
            dtype=dtype_name(kv.dtype),
            block_tokens=ps,
        )

    def paged(self, host_indices: torch.Tensor, n: int) -> PagedKV:
        """The pages holding ``host_indices`` (``n`` pages of ``page_size`` consecutive slots, as
        SGLang's host allocator hands them out). Raises LayoutError otherwise."""
        ps = self.page_size
        idx = torch.as_tensor(host_indices, dtype=torch.int64).view(-1)
        if idx.numel() != n * ps:
            raise LayoutError(f"{n} pages need {n * ps} host indices, got {idx.numel()}")
        rows = idx.view(n, ps)
        first = rows[:, 0]
        if bool((first % ps).any()) or not torch.equal(rows - first[:, None], _offsets(ps).expand(n, ps)):
            raise LayoutError("host indices are not whole pages (page_size consecutive, aligned slots)")
        return PagedKV.blocks(self.k, self.v, first // ps, n * ps, kv=self.kv)


def _offsets(ps: int) -> torch.Tensor:
    return torch.arange(ps, dtype=torch.int64)[None, :]
