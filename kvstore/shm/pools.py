"""The tiers' pools in shared memory, for the same-host data plane (kvstore.shm.plane).

::

    memory("hbm", "raw")    PagePool memory: a host arena in a segment, its page generations after it
                            (an arena on a GPU: exported by CUDA IPC, its generations in a segment)
    segments()              how a client maps and reads each pool (a hello's offer)
    retire(); close()       every page's generation moves, then the segments go

A client maps the segments read-only and checks a page's generation after copying out of it: the
daemon bumps it before the page can be written again (tiers.pool), so a copy that raced a reuse is a
miss, never a wrong block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.shm.segment import ALIGN, Segment, ShmUnavailable
from kvstore.tiers.pool import PoolMemory

log = logging.getLogger("kvstore.shm")


@dataclass
class SharedPool:
    role: str
    segment: Segment | None  # None: the arena is on a GPU (see cuda_export)
    capacity: int
    num_pages: int
    gens_offset: int
    gens_segment: Segment
    device: torch.device
    kind: str  # "raw" blocks or codec "frames"
    page_bytes: int = 0
    ipc: bytes | None = None
    keep: Any = None  # what keeps a GPU arena alive

    def generations(self) -> np.ndarray:
        return self.gens_segment.array(self.gens_offset, 8 * self.num_pages).view(np.uint64)


class SharedPools:
    """The pools made in ``directory`` (a private one: kvstore.shm.segment.private_dir)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._pools: list[SharedPool] = []

    def memory(self, role: str, kind: str) -> PoolMemory:
        """PagePool memory in segments for the pool ``role`` ("hbm", "ram") holding ``kind`` ("raw"
        blocks or codec "frames"): the arena (host pools) and the page generations. A GPU arena that
        cannot be exported (no working cupy) is left to the pool (None): not shared."""

        def allocate(
            capacity: int, page_bytes: int, num_pages: int, device: torch.device
        ) -> tuple[torch.Tensor, np.ndarray] | None:
            gens_offset = -(-capacity // ALIGN) * ALIGN
            if device.type == "cpu":
                seg = Segment.create(self._directory, role, gens_offset + 8 * num_pages)
                arena = torch.from_numpy(seg.array(0, capacity))
                pool = SharedPool(role, seg, capacity, num_pages, gens_offset, seg, device, kind, page_bytes)
            else:
                from kvstore.shm.cuda import cuda_arena

                try:
                    arena, handle, keep = cuda_arena(capacity, device)
                except ShmUnavailable as e:  # no cupy that works: the pool is the daemon's own
                    log.warning(
                        "the %s pool on %s is not shared: %s; same-host clients read it through staging",
                        role,
                        device,
                        e,
                    )
                    return None
                gens_seg = Segment.create(self._directory, role + "gens", 8 * num_pages)
                pool = SharedPool(
                    role,
                    None,
                    capacity,
                    num_pages,
                    0,
                    gens_seg,
                    device,
                    kind,
                    page_bytes,
                    ipc=handle,
                    keep=keep,
                )
            self._pools.append(pool)
            return arena, pool.generations()

        return allocate

    def segments(self) -> list[dict[str, Any]]:
        """Each pool as a client maps it. A GPU pool is named by its device's UUID too: ``cuda:N`` is
        another GPU in a process that sees another set of devices (CUDA_VISIBLE_DEVICES)."""
        from kvstore.shm.cuda import device_uuid

        return [
            {
                "role": p.role,
                "kind": p.kind,
                "path": None if p.segment is None else str(p.segment.path),
                "size": 0 if p.segment is None else p.segment.size,
                "capacity": p.capacity,
                "page_bytes": p.page_bytes,
                "num_pages": p.num_pages,
                "gens_path": str(p.gens_segment.path),
                "gens_size": p.gens_segment.size,
                "gens_offset": p.gens_offset,
                "device": str(p.device),
                "uuid": None if p.ipc is None else device_uuid(p.device),
                "ipc": p.ipc,
            }
            for p in self._pools
        ]

    def shares(self, role: str) -> bool:
        """Whether the pool ``role`` ("hbm", "ram") lives in shared memory."""
        return any(p.role == role for p in self._pools)

    def index(self, role: str) -> int:
        """The index of pool ``role`` in ``segments()``."""
        return next(i for i, p in enumerate(self._pools) if p.role == role)

    def paths(self) -> list[str]:
        return [str(p.segment.path) for p in self._pools if p.segment is not None]

    def retire(self) -> None:
        """Move every page's generation: a client still copying out of a pool reads its blocks as
        missing (the daemon is stopping)."""
        for p in self._pools:
            p.generations()[:] += 1

    def close(self, *, free: bool = True) -> None:
        """Remove the segments; with ``free``, give their memory back now (see SharedPlane.close)."""
        for p in self._pools:
            if p.segment is not None:
                p.segment.close(free=free)
            if p.gens_segment is not p.segment:
                p.gens_segment.close(free=free)
