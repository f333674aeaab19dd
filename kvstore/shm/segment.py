"""Shared-memory segments: files in a directory only the daemon's user may enter, mapped by both sides.

::

    /dev/shm/kvstore-<uid>/                       0700, owned by the daemon's user
        kvs-<pid>-<24 random hex>-hbm             0600; arena of the hbm pool, then its page generations
        kvs-<pid>-<24 random hex>-ram             0600; arena of the ram pool, then its page generations
        kvs-<pid>-<24 random hex>-staging         0600; staging for puts (clients write) and nvme reads

The daemon creates each segment with ``O_EXCL``, reserves its memory with
``posix_fallocate`` (a /dev/shm too small for the configured capacity is
refused at start, not met by SIGBUS under load) and holds an exclusive
``flock`` on it for its lifetime. The kernel drops the lock when the daemon
dies, so the next daemon's ``sweep`` removes exactly the segments whose owner
is gone (a pid alone could have been reused). A clean stop unlinks its own.
Either way the memory is freed once the file is removed: a client that still
maps it (idle since) would otherwise hold it, and the next daemon may need it.

A client opens a segment by the path the hello reply names, refusing one that
is not a regular file owned by its own user with mode 0600, and maps pool
segments read-only (a write faults in the client; the daemon is unaffected).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time
from pathlib import Path

import numpy as np

from kvstore.errors import ConfigError, KVStoreError

log = logging.getLogger("kvstore.shm")

_NAME = re.compile(r"kvs-\d+-[0-9a-f]{24}-[a-z]+")
_NEW = re.compile(r"\.kvs-\d+-[0-9a-f]{24}-[a-z]+\.new")  # one being made (Segment.create)
NEW_GRACE = 60.0  # seconds: an unlocked segment being made, younger than this, may be about to be locked
ALIGN = 4096  # segments and staging ranges start on a page: client copies stay aligned
_MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14


class NoRoom(ConfigError):
    """The shared-memory filesystem cannot hold a segment of the size asked for."""


class ShmUnavailable(KVStoreError):
    """Shared memory cannot be used here (another host, another user, a segment gone): use the socket."""

    code = "shm_unavailable"


def default_dir() -> Path:
    """``/dev/shm/kvstore-<uid>`` (a tmpfs: the segments are memory, never written to disk)."""
    return Path("/dev/shm") / f"kvstore-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """Create ``path`` 0700 if needed; refuse one another user owns or others may enter."""
    try:
        path.mkdir(mode=0o700, parents=False, exist_ok=True)
    except FileNotFoundError:
        raise ConfigError(
            f"shared memory directory {path.parent} does not exist; set [server] shm_dir"
        ) from None
    st = os.lstat(path)
    if not _private(st):
        raise ConfigError(
            f"{path} must be a directory owned by uid {os.geteuid()} with mode 0700 "
            f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it or set [server] shm_dir"
        )
    return path


def _private(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def sweep_leftovers(path: Path) -> int:
    """``sweep`` of ``path`` if it is a directory this user keeps private, else 0 (nothing made): a
    daemon started without shared memory still removes the segments one that had it left at a crash."""
    try:
        if not _private(os.lstat(path)):
            return 0
        return sweep(path)
    except OSError:
        return 0


def sweep(path: Path) -> int:
    """Remove the segments in ``path`` whose daemon is gone (no lock held on them), and segments a
    daemon died creating (unnamed yet, unlocked, and older than a minute). Returns how many."""
    removed = 0
    for entry in os.scandir(path):
        if not _NAME.fullmatch(entry.name):
            try:  # one being made is locked an instant after it is made: a young one is left alone
                if (
                    not _NEW.fullmatch(entry.name)
                    or time.time() - entry.stat(follow_symlinks=False).st_mtime < NEW_GRACE
                ):
                    continue
            except OSError:
                continue
        try:
            fd = os.open(entry.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live daemon holds it
            continue
        try:
            os.unlink(entry.path)
            removed += 1
            _give_back(fd)  # clients that still map it (idle since the crash) hold none of its memory
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _give_back(fd: int) -> None:
    """Free the memory of the (removed) segment open as ``fd``: every mapping of it reads zeros from
    then on (a pool's page generations too, which are never 0: its blocks read as moved)."""
    size = os.fstat(fd).st_size
    if size:
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            m.madvise(mmap.MADV_REMOVE)


class Segment:
    """One mapped segment. ``array(offset, n)`` is a numpy uint8 view (read-only unless ``writable``)."""

    def __init__(self, path: Path, fd: int, size: int, writable: bool, owner: bool) -> None:
        self.path = path
        self.size = size
        self.writable = writable
        self.owner = owner
        self._fd = fd
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        # huge pages where the filesystem gives them on advice (tmpfs mounted huge=advise): 2 MiB
        # pages spare a copy of a pool's blocks most of its TLB misses (copies out of a 94 MB
        # segment: 15.1 GB/s against 11.8 in 4 KiB pages). Elsewhere the advice changes nothing.
        # The owner's mapping alone asks: it makes every page (_populate), and a client's mapping
        # maps those as they are, huge ones whole; a client's fault on a freed segment (close's
        # ``free``) would make a 2 MiB page under the advice, not 4 KiB
        if owner:
            with contextlib.suppress(OSError, AttributeError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        if not owner:  # only the daemon keeps a descriptor: it holds the lock that says it is alive
            os.close(fd)
            self._fd = -1

    @classmethod
    def create(cls, directory: Path, role: str, size: int) -> Segment:
        """A new segment of ``size`` bytes (rounded up to 4 KiB), memory reserved, locked by this process."""
        size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        name = f"kvs-{os.getpid()}-{secrets.token_hex(12)}-{role}"
        # made under a name another daemon's sweep leaves alone, and named once locked: a sweep
        # between the open and the lock would take an unlocked segment for a dead daemon's
        path = directory / f".{name}.new"
        no_room = NoRoom(
            f"a {size}-byte {role} segment cannot be allocated in {directory} (no room); lower "
            'the tier\'s capacity, enlarge /dev/shm, or set [server] shared_memory = "off"'
        )
        fs = os.statvfs(directory)
        # refused before a page is made (populating would fill the filesystem first); a tmpfs of no
        # size limit counts no blocks
        if fs.f_blocks and size > fs.f_bavail * fs.f_frsize:
            raise no_room
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        seg: Segment | None = None
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):  # past the filesystem's largest file
                    raise no_room from None
                raise
            os.rename(path, directory / name)
            path = directory / name
            # the pages are made through the mapping first, so that they are huge where the advice
            # asks for it (made by posix_fallocate they never are); then the whole size is reserved
            seg = cls(path, fd, size, writable=True, owner=True)
            seg._populate()
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):  # taken meanwhile by others
                    raise no_room from None
                raise
            return seg
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            if seg is not None:
                seg.close(unlink=False, free=True)
            else:
                os.close(fd)
            raise

    @classmethod
    def open(cls, path: str | Path, size: int, *, writable: bool) -> Segment:
        """Map an existing segment the daemon named. ShmUnavailable when it cannot or must not be used."""
        p = Path(path)
        if not _NAME.fullmatch(p.name):
            raise ShmUnavailable(f"{p} is not a kvstore segment name")
        try:
            fd = os.open(p, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ShmUnavailable(f"cannot open {p}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.geteuid()
                or st.st_mode & 0o077
                or st.st_size < size
            ):
                raise ShmUnavailable(
                    f"{p} is not a private segment of this user of {size} bytes "
                    f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}, {st.st_size} bytes)"
                )
            return cls(p, fd, size, writable=writable, owner=False)
        except OSError as e:  # the mapping itself (no address space left, vm.max_map_count)
            os.close(fd)
            raise ShmUnavailable(f"cannot map {p}: {e.strerror or e}") from None
        except BaseException:
            os.close(fd)
            raise

    def _populate(self) -> None:
        """Make and map every page now, so that the first writes into the pool do not fault page by
        page. Called through ctypes, which lets go of the GIL: populating a pool of gigabytes takes
        a while, and the daemon's loop answers clients meanwhile. Kernels before 5.14 lack the
        advice: then the pages map on use. A filesystem without room for them all fails the advice
        (an error, not a SIGBUS): posix_fallocate, after it, says so."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise(self._array.ctypes.data, self.size, _MADV_POPULATE_WRITE)

    def array(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        end = self.size if nbytes is None else offset + nbytes
        if not 0 <= offset <= end <= self.size:
            raise ValueError(
                f"bytes {offset}..{end} are outside the {self.size}-byte segment {self.path.name}"
            )
        return self._array[offset:end]

    def close(self, unlink: bool | None = None, *, free: bool = False) -> None:
        """Unmap (once nothing views the memory any more) and, for the owner, remove the file.

        ``free`` (a writable mapping): give the memory back now, after the file is removed, whoever
        still maps it: every other mapping reads zeros from then on. A read there makes a page of
        the file again (4 KiB: clients' mappings ask for no huge pages), and on a filesystem that is
        full then it faults (SIGBUS): only a client that goes on copying from staging it no longer
        holds (paused past its lease and the segment's idle minute) reads there. A reader that sees
        the file still there after its copy read what was written (it is removed before it is freed)."""
        if unlink if unlink is not None else self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if free and self._map is not None:
            try:
                self._map.madvise(mmap.MADV_REMOVE)
            except OSError as e:  # a filesystem that cannot punch holes: freed when the last map goes
                log.debug("the memory of %s is not freed until it is unmapped: %s", self.path.name, e)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        m, self._map = self._map, None
        if m is not None:
            self._array = np.empty(0, dtype=np.uint8)
            try:
                m.close()
            except BufferError:  # tensors still view it: unmapped when the last one goes
                pass
