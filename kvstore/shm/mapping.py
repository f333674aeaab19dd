"""The client's side of the same-host data plane: the daemon's segments mapped, and reads out of them.

``SharedMapping(offer)`` maps what a hello reply offers: the host pools
read-only, the hbm pool on a GPU through CUDA IPC (when this process has CUDA
and cupy). This client's own staging segment (read-write) is named by the
replies that use it, and mapped on first sight (``staging``). ``read_blocks`` copies (raw) or
decodes (frames, checksum checked) located blocks straight into the caller's
destination, then checks each block's page generations: the result ends at
the first block whose pages were freed meanwhile, so a lapsed lease costs a
miss, never a wrong block.

The generation check relies on the daemon bumping a page's counter before the
page can be written again, and on this process's loads of the counters not
passing its loads of the data: x86's memory order (the copy has finished, and
on a GPU its stream is synchronized, before the counters are read). Elsewhere (aarch64
and other weakly ordered machines) a counter could be read before the data it
guards, and Python has no portable fence: the daemon offers shared memory on
x86_64 only (kvstore.shm.plane).

Blocks in this client's staging segment have no generations: the daemon
writes them for this client alone. It frees an idle staging segment's memory
when it removes it, so after copying from staging the client checks that the
segment is still there (it is removed before it is freed): a block read from
a freed segment is a miss too.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.codecs import decode_frame, decode_frames
from kvstore.errors import FrameError
from kvstore.kvbuffers import KVTarget, target_view, write_target
from kvstore.layout import KVLayout
from kvstore.memcopy import Copier, CopyBatch
from kvstore.shm.segment import Segment, ShmUnavailable


def _tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only memory: torch warns that writes are undefined (they fault)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


@dataclass
class _Mapped:
    role: str
    kind: str  # "raw" | "frames"
    arena: torch.Tensor  # uint8, on the pool's device
    gens: np.ndarray | None  # uint64 per page (None: staging)
    segments: list[Any]


_Located = tuple[_Mapped, np.ndarray, np.ndarray, np.ndarray]  # mapping, extents, pages, generations


def _first_moved(located: list[_Located]) -> int | None:
    """The first of ``located`` whose pages' generations are no longer those the daemon located it
    at (its pages were freed, perhaps reused, meanwhile), or None. One comparison for all blocks."""
    rows: list[int] = []
    now: list[np.ndarray] = []
    then: list[np.ndarray] = []
    for j, (m, _, p, g) in enumerate(located):
        if m.gens is not None and len(p):
            rows.append(j)
            now.append(m.gens[p])
            then.append(g)
    if not rows:
        return None
    moved = np.concatenate(now) != np.concatenate(then)
    if not moved.any():
        return None
    return int(np.repeat(rows, [len(g) for g in then])[moved.argmax()])


def _unregister_all(registered: list[int]) -> None:
    """Undo the page locks of ``registered`` (what ``close`` left: none after it)."""
    if registered:
        from kvstore.shm.cuda import host_unregister

        for ptr in registered:
            with contextlib.suppress(Exception):
                host_unregister(ptr)
        registered.clear()


class SharedMapping:
    """A daemon's shared segments, mapped in this process. ShmUnavailable when they cannot be."""

    def __init__(self, offer: dict[str, Any], copier: Copier | None = None) -> None:
        """``copier``: how raw blocks are copied out (default: on the calling thread)."""
        self._copier = copier or Copier(1)
        try:
            self.instance = str(offer["instance"])
            self.per_client = int(offer["per_client"])
            segs = list(offer["segments"])
        except (KeyError, TypeError, ValueError) as e:
            raise ShmUnavailable(f"the daemon's shared-memory offer is malformed: {e}") from None
        self.mapped: list[_Mapped | None] = []
        self._staging: _Mapped | None = None
        self._staging_path = ""
        self._pinned = False
        self._gpu = 0  # the GPU whose context page-locks the mappings (the first copy's)
        self._registered: list[int] = []  # host addresses page-locked here (unregistered before unmapping)
        # a mapping dropped without close() (its client never closed) unmaps its segments as they are
        # collected: their page locks go first, or the driver keeps those pages locked for good and the
        # next mapping at the same address cannot be locked
        weakref.finalize(self, _unregister_all, self._registered)
        self.moved = 0  # blocks not served because their pages changed while they were read
        self.torn = 0  # frames that failed their checks while being read (and were not served)
        try:
            for s in segs:
                self.mapped.append(self._map(s))
        except (KeyError, TypeError, ValueError) as e:
            self.close()
            raise ShmUnavailable(f"the daemon's shared-memory offer is malformed: {e}") from None
        except BaseException:
            self.close()
            raise

    def _map(self, s: dict[str, Any]) -> _Mapped | None:
        role, kind = str(s["role"]), str(s["kind"])
        num_pages = int(s["num_pages"])
        if str(s["device"]).startswith("cuda"):
            try:
                from kvstore.shm.cuda import IpcArena, local_device

                if not torch.cuda.is_available():
                    raise ShmUnavailable("the hbm pool is on a GPU and this process sees no CUDA device")
                device = local_device(s.get("uuid"), str(s["device"]))
                if device is None:
                    raise ShmUnavailable("the hbm pool is on a GPU this process does not see")
                ipc = IpcArena(bytes(s["ipc"]), int(s["capacity"]), device)
            except ShmUnavailable:
                return None  # this client reads that pool's blocks through staging
            try:  # the arena is not in self.mapped yet: closed here if its generations fail
                gseg = Segment.open(s["gens_path"], int(s["gens_size"]), writable=False)
                try:
                    gens = gseg.array(int(s["gens_offset"]), 8 * num_pages).view(np.uint64)
                except BaseException:
                    gseg.close()
                    raise
            except BaseException:
                ipc.close()
                raise
            return _Mapped(role, kind, ipc.tensor, gens, [ipc, gseg])
        seg = Segment.open(s["path"], int(s["size"]), writable=False)
        arena = _tensor(seg.array(0, int(s["capacity"])))
        gens = seg.array(int(s["gens_offset"]), 8 * num_pages).view(np.uint64)
        return _Mapped(role, kind, arena, gens, [seg])

    @property
    def tiers(self) -> list[str]:
        """The pools this process reads in place (the others' blocks come through staging)."""
        return [m.role for m in self.mapped if m is not None]

    def staging(self, path: str, size: int) -> _Mapped:
        """This client's staging segment ``path`` (mapped read-write on first sight; the one before
        it, if any, let go: the daemon removed it)."""
        if self._staging is None or path != self._staging_path:
            seg = Segment.open(path, size, writable=True)
            if self._staging is not None:
                self._release(self._staging)
            self._staging = _Mapped("staging", "raw", torch.from_numpy(seg.array()), None, [seg])
            self._staging_path = path
            if self._pinned:
                self._register(self._staging.arena, read_only=False)
        return self._staging

    def staging_view(self, path: str, size: int, offset: int, nbytes: int) -> torch.Tensor:
        arena = self.staging(path, size).arena
        if not 0 <= offset <= offset + nbytes <= arena.numel():
            raise ShmUnavailable(f"staging range {offset}+{nbytes} is outside the staging segment")
        return arena[offset : offset + nbytes]

    def _pin_for(self, device: torch.device) -> None:
        """Page-lock the host mappings once, so copies to a GPU run at full speed (CUDA hosts; where the
        driver refuses, as for read-only memory on some drivers, copies run unpinned, slower)."""
        if self._pinned or device.type != "cuda":
            return
        self._pinned = True
        self._gpu = torch.cuda.current_device() if device.index is None else device.index
        for m in self.mapped:
            if m is not None and m.arena.device.type == "cpu":
                self._register(m.arena, read_only=True)
        if self._staging is not None:
            self._register(self._staging.arena, read_only=False)

    def _register(self, arena: torch.Tensor, *, read_only: bool) -> None:
        """Page-lock ``arena`` through the GPU the first copy went to (it is asked whether read-only
        memory can be, and no context is made on another)."""
        from kvstore.shm.cuda import host_register

        if arena.numel() and host_register(
            arena.data_ptr(), arena.numel(), read_only=read_only, device=self._gpu
        ):
            self._registered.append(arena.data_ptr())

    def _release(self, m: _Mapped) -> None:
        """Unmap ``m``'s segments, unregistering its memory first if it was page-locked here."""
        ptr = m.arena.data_ptr() if m.arena.device.type == "cpu" and m.arena.numel() else None
        if ptr is not None and ptr in self._registered:
            from kvstore.shm.cuda import host_unregister

            self._registered.remove(ptr)
            host_unregister(ptr)
        for seg in m.segments:
            seg.close()

    # -- reads ----------------------------------------------------------------------------
    def _bytes(self, m: _Mapped, extents: np.ndarray) -> torch.Tensor:
        """The block's bytes: a view when they are one run, else gathered (a copy)."""
        size = m.arena.numel()
        for off, length in extents:
            if not 0 <= off <= off + length <= size:
                raise ShmUnavailable(f"a located extent {off}+{length} is outside the {m.role} segment")
        if len(extents) == 1:
            off, length = int(extents[0][0]), int(extents[0][1])
            return m.arena[off : off + length]
        return torch.cat([m.arena[int(o) : int(o) + int(n)] for o, n in extents])

    def read_blocks(
        self,
        blocks: list[list[Any]],
        layout: KVLayout,
        target: KVTarget,
        t0: int,
        staging: list[Any] | None = None,
    ) -> int:
        """Copy or decode located ``blocks`` into ``target`` from token ``t0``; returns how many leading
        blocks are good (unchanged generations, sound frames). Blocks past that may have been written
        into ``target`` and must be ignored. ``staging``: ``[path, size]`` of this client's staging
        segment, where blocks of segment -1 are.

        Raw blocks laid out at a constant stride in one segment (the usual case: fixed-size blocks
        take the same runs of pages) are copied as one strided copy per run, not one per block."""
        T, nb = layout.block_tokens, layout.block_nbytes
        device = target.device
        self._pin_for(device)
        located = self._parse(blocks, staging)
        good = len(located)
        scatters = self._copier.batch()  # a paged target's scatters, shared out over the copier's threads
        batched = device.type != "cpu"  # runs of frames decoded at once on the device
        j = 0
        while j < len(located):
            m, extents, _, _ = located[j]
            if m.kind == "frames" and batched:
                k = j + 1
                while k < len(located) and located[k][0].kind == "frames":
                    k += 1
                try:
                    frames = [self._bytes(mk, ek).numpy().data for mk, ek, _, _ in located[j:k]]
                    run, ok = decode_frames(frames, layout=layout, device=device)
                except FrameError:
                    ok = 0
                except torch.OutOfMemoryError:  # no room on the device for the run decoded at once:
                    batched = False  # one frame at a time, each straight into its place
                    continue
                if ok:
                    self._write_run(target, t0 + j * T, run[:ok], scatters)
                if ok < k - j:  # torn by a reuse (the generations will say) or damaged: not served
                    self.torn += 1
                    good = j + ok
                    break
                j = k
                continue
            try:
                if m.kind == "frames" or len(extents) != 1:  # one at a time: decoded, or gathered
                    data = self._bytes(m, extents)
                    slot = target_view(target, t0 + j * T, T)
                    if m.kind == "frames":
                        frame = data if data.device.type == "cpu" else data.cpu()
                        block = decode_frame(frame.numpy().data, layout=layout, device=device, out=slot)
                    else:
                        if data.numel() != nb:
                            raise ShmUnavailable(f"raw block {j} is {data.numel()} bytes, not {nb}")
                        block = data.view(layout.torch_dtype).view(layout.shape(T))
                        if slot is not None:
                            self._copier.copy(slot, block, non_blocking=True)
                    if slot is None:
                        write_target(target, t0 + j * T, block)
                    j += 1
                    continue
            except FrameError:  # torn by a reuse (the generations will say) or damaged: not served
                self.torn += 1
                good = j
                break
            except torch.OutOfMemoryError:  # no room on the device even for one frame: the result ends here
                good = j
                break
            k, stride = self._run(located, j, nb)
            if stride != nb and m.arena.device != device:
                k = j + 1  # across PCIe each block goes as it is (a gapped run would be gathered first)
            src = torch.as_strided(m.arena, (k - j, nb), (stride, 1), int(extents[0][0]))
            src = src.view(layout.torch_dtype).view(k - j, *layout.shape(T))
            self._write_run(target, t0 + j * T, src, scatters)
            j = k
        scatters.finish()
        # every copy has finished (on either side of PCIe) before the generations are read: they ran
        # on this thread's current streams, which are waited for (not the whole device: an engine's
        # forward pass on its own stream goes on)
        for dev in {m.arena.device for m, _, _, _ in located} | {device}:
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
        moved = _first_moved(located[:good])  # after every copy has finished
        if moved is None:
            moved = self._first_freed(located[:good])
        if moved is not None:
            self.moved += 1
            return moved
        return good

    def _first_freed(self, located: list[_Located]) -> int | None:
        """The first of ``located`` read from this client's staging segment if the daemon removed it
        meanwhile (it frees its memory after removing it: the copy may have read zeros), or None."""
        for j, (m, _, _, _) in enumerate(located):
            if m is self._staging:
                return None if os.path.exists(self._staging_path) else j
        return None

    def _write_run(self, target: KVTarget, t0: int, src: torch.Tensor, scatters: CopyBatch) -> None:
        """Consecutive blocks ``src`` ``[n, L, 2, T, H, D]`` into ``target`` from token ``t0``."""
        n, T = src.shape[0], src.shape[3]
        if isinstance(target, torch.Tensor):
            dst = target[:, :, t0 : t0 + n * T].unflatten(2, (n, T)).permute(2, 0, 1, 3, 4, 5)
            self._copier.copy(dst, src, non_blocking=True)
        else:
            target.write_blocks(t0, src, scatters)

    def _parse(self, blocks: list[list[Any]], staging: list[Any] | None) -> list[_Located]:
        """(mapping, extents, pages, generations) of each located block; ShmUnavailable if one is
        malformed. The bounds are checked for all blocks at once (a prefix has tens of blocks)."""
        located: list[_Located] = []
        for j, blk in enumerate(blocks):
            try:
                seg, ext, pages, gens = int(blk[0]), blk[1], blk[2], blk[3]
                m = self.staging(str(staging[0]), int(staging[1])) if seg == -1 and staging else None
                if m is None and 0 <= seg < len(self.mapped):
                    m = self.mapped[seg]
                extents = np.frombuffer(ext, dtype="<i8").reshape(-1, 2)
                p = np.frombuffer(pages, dtype="<i8")
                g = np.frombuffer(gens, dtype="<u8")
            except (TypeError, ValueError, IndexError) as e:
                raise ShmUnavailable(f"located block {j} is malformed: {e}") from None
            if m is None:
                raise ShmUnavailable(f"block {j} is located in segment {seg}, which is not mapped")
            if len(extents) == 0:
                raise ShmUnavailable(f"block {j} has no extents")
            if m.gens is not None and len(p) != len(g):
                raise ShmUnavailable(f"block {j} names {len(p)} pages and {len(g)} generations")
            located.append((m, extents, p, g))
        if not located:
            return located
        ext = np.concatenate([e for _, e, _, _ in located])
        rows = np.repeat(np.arange(len(located)), [len(e) for _, e, _, _ in located])
        size = np.array([m.arena.numel() for m, _, _, _ in located])[rows]
        bad = (ext[:, 0] < 0) | (ext[:, 1] < 0) | (ext[:, 0] + ext[:, 1] > size)
        if bad.any():
            j = int(rows[bad.argmax()])
            raise ShmUnavailable(f"block {j}'s extents are outside the {located[j][0].role} segment")
        paged = [
            (j, p, len(m.gens)) for j, (m, _, p, _) in enumerate(located) if m.gens is not None and len(p)
        ]
        if paged:
            pages = np.concatenate([p for _, p, _ in paged])
            lengths = [len(p) for _, p, _ in paged]
            rows = np.repeat([j for j, _, _ in paged], lengths)
            bad = (pages < 0) | (pages >= np.repeat([n for _, _, n in paged], lengths))
            if bad.any():
                j = int(rows[bad.argmax()])
                raise ShmUnavailable(f"block {j} names pages outside the {located[j][0].role} pool")
        return located

    @staticmethod
    def _run(located: list[_Located], j: int, nb: int) -> tuple[int, int]:
        """The raw blocks ``j .. k-1`` that one strided copy reads: in one segment, each one run of
        ``nb`` bytes, at a constant stride. Returns (k, stride). ShmUnavailable for a raw block that is
        not ``nb`` bytes in one run (a pool's blocks always are)."""
        m, ext = located[j][0], located[j][1]
        if len(ext) != 1 or int(ext[0][1]) != nb:
            raise ShmUnavailable(f"raw block {j} is not {nb} bytes in one run")
        k, stride = j + 1, nb
        while k < len(located):
            mk, ek = located[k][0], located[k][1]
            if mk is not m or mk.kind != "raw" or len(ek) != 1 or int(ek[0][1]) != nb:
                break
            step = int(ek[0][0]) - int(located[k - 1][1][0][0])
            if k == j + 1:
                if step < nb:
                    break
                stride = step
            elif step != stride:
                break
            k += 1
        return k, stride

    def close(self) -> None:
        for m in [*self.mapped, self._staging]:
            if m is not None:
                self._release(m)
        self.mapped = []
        self._staging = None
