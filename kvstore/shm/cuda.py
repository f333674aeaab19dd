"""CUDA IPC for the hbm pool on ``cuda:N`` (cupy, GPU hosts only).

The daemon allocates the arena with one ``cudaMalloc`` of its own (not through
torch's caching allocator, whose blocks may start inside a larger allocation
that an IPC handle would name instead), zeroes it and views it as a torch
tensor through DLPack. ``cudaIpcGetMemHandle`` names it for clients, which
open it with ``cudaIpcOpenMemHandle`` and see the same device memory. The page
generations stay in host shared memory (segment.py), bumped by the daemon's
bookkeeping before a freed page can be written again.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.shm.segment import ShmUnavailable


def cuda_arena(capacity: int, device: torch.device) -> tuple[torch.Tensor, bytes, Any]:
    """(arena as a uint8 tensor on ``device``, its IPC handle, the object that keeps it alive)."""
    try:
        import cupy
    except ImportError:
        raise ConfigError(
            "sharing the hbm pool on a GPU needs cupy (pip install cupy-cuda12x); "
            'install it or set [server] shared_memory = "off"'
        ) from None
    with cupy.cuda.Device(device.index or 0):
        mem = cupy.cuda.Memory(capacity)  # a plain cudaMalloc
        cupy.cuda.runtime.memset(mem.ptr, 0, capacity)
        arr = cupy.ndarray((capacity,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr))
    return torch.from_dlpack(arr), handle, (mem, arr)


class IpcArena:
    """A client's view of the daemon's hbm arena through its IPC handle (read from, never written)."""

    def __init__(self, handle: bytes, capacity: int, device: str) -> None:
        if not torch.cuda.is_available():
            raise ShmUnavailable("the hbm pool is on a GPU and this process sees no CUDA device")
        try:
            import cupy
        except ImportError:
            raise ShmUnavailable("reading the GPU hbm pool needs cupy in the client") from None
        index = torch.device(device).index or 0
        with cupy.cuda.Device(index):
            try:
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(
                    handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
                )
            except Exception as e:  # cupy raises CUDARuntimeError
                raise ShmUnavailable(f"cudaIpcOpenMemHandle failed: {e}") from None
            self._ptr = ptr
            mem = cupy.cuda.UnownedMemory(ptr, capacity, self)
            arr = cupy.ndarray((capacity,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        self._index = index
        self.tensor = torch.from_dlpack(arr)

    def close(self) -> None:
        import cupy

        self.tensor = torch.empty(0, dtype=torch.uint8)
        with cupy.cuda.Device(self._index):
            try:
                cupy.cuda.runtime.ipcCloseMemHandle(self._ptr)
            except Exception:  # noqa: S110 - best effort: the daemon may be gone
                pass
