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

from kvstore.shm.segment import ShmUnavailable


def cuda_arena(capacity: int, device: torch.device) -> tuple[torch.Tensor, bytes, Any]:
    """(arena as a uint8 tensor on ``device``, its IPC handle, the object that keeps it alive).
    ShmUnavailable when cupy is missing or fails (built for another CUDA, a driver that refuses):
    the pool is then not shared; nothing is left allocated."""
    try:
        import cupy
    except Exception:  # noqa: BLE001 - not installed, or built for another CUDA
        raise ShmUnavailable(
            "sharing a pool on a GPU needs cupy built for torch's CUDA (pip install -e '.[cuda12]' or "
            "'.[cuda13]'; ./dev setup does it)"
        ) from None
    try:
        with cupy.cuda.Device(device.index or 0):
            mem = cupy.cuda.Memory(capacity)  # a plain cudaMalloc
            cupy.cuda.runtime.memset(mem.ptr, 0, capacity)
            arr = cupy.ndarray((capacity,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr))
    except Exception as e:  # noqa: BLE001 - cupy's CUDARuntimeError, OutOfMemoryError, a CUDA mismatch
        raise ShmUnavailable(f"cupy could not allocate and share {capacity} bytes on {device}: {e}") from None
    return torch.from_dlpack(arr), handle, (mem, arr)


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID, the same in every process whatever devices each one sees."""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str | None, fallback: str) -> str | None:
    """This process's ``cuda:N`` for the GPU with ``uuid`` (None: this process does not see it);
    ``fallback`` (the daemon's own name for it) when the daemon sent no UUID."""
    if not uuid:
        return fallback
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return f"cuda:{i}"
    return None


class IpcArena:
    """A client's view of the daemon's hbm arena through its IPC handle (read from, never written)."""

    def __init__(self, handle: bytes, capacity: int, device: str) -> None:
        if not torch.cuda.is_available():
            raise ShmUnavailable("the hbm pool is on a GPU and this process sees no CUDA device")
        try:
            import cupy
        except Exception:  # noqa: BLE001 - not installed, or built for another CUDA
            raise ShmUnavailable(
                "reading the GPU hbm pool needs cupy (built for torch's CUDA) in the client"
            ) from None
        index = torch.device(device).index or 0
        try:
            with cupy.cuda.Device(index):
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(
                    handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
                )
        except Exception as e:  # noqa: BLE001 - cupy raises CUDARuntimeError (a wrong CUDA: others)
            raise ShmUnavailable(f"cudaIpcOpenMemHandle failed: {e}") from None
        with cupy.cuda.Device(index):
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


# cudaHostRegister's flags and the device attribute that says whether read-only memory can be registered
_PORTABLE, _READ_ONLY = 0x1, 0x8
_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported


def host_register(ptr: int, nbytes: int, *, read_only: bool, device: int | None = None) -> bool:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for every CUDA context (copies to and from a GPU
    then run at full speed); ``read_only`` for memory mapped without write access. True when
    registered: the caller calls ``host_unregister(ptr)`` before the memory is unmapped. False when
    it cannot be (a driver that refuses read-only registration, memory already registered; read-only
    memory without cupy): copies still work, staged by the driver, only slower.

    Through cupy, whose error check resets the CUDA runtime's last error: an error left there (as
    ``torch.cuda.cudart().cudaHostRegister`` leaves it) fails the next kernel torch launches. Without
    cupy, writable memory is registered through torch (a refusal is unlikely there), read-only memory
    is not (whether the device supports it cannot be asked first).

    ``device``: the GPU whose context registers it (default: the calling thread's current one, which
    the daemon sets to its hbm device); a portable registration serves every GPU, but the call makes
    a context on the GPU it runs on (hundreds of MB there) if it has none."""
    if device is None:
        device = torch.cuda.current_device()
    try:
        from cupy.cuda import runtime
    except ImportError:
        if read_only:
            return False
        with torch.cuda.device(device):
            rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE)
        return int(rc) == 0
    # torch's guard, not cupy's Device: that one sets the device it found on leaving, which makes a
    # context there (GPU 0, on a thread that never chose one)
    with torch.cuda.device(device):
        try:
            if read_only and not runtime.deviceGetAttribute(_READ_ONLY_SUPPORTED, device):
                return False
            runtime.hostRegister(ptr, nbytes, _PORTABLE | (_READ_ONLY if read_only else 0))
        except runtime.CUDARuntimeError:
            return False
    return True


def host_unregister(ptr: int) -> None:
    """Undo ``host_register(ptr, ...)`` (best effort: a registration the driver has no record of is
    ignored). Memory unmapped while registered would leave the driver pinning pages that the next
    mapping at the same address does not own."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        torch.cuda.cudart().cudaHostUnregister(ptr)
        return
    try:
        runtime.hostUnregister(ptr)
    except runtime.CUDARuntimeError:
        pass
