"""An exclusive lock file that names its holder: what keeps a second daemon off an endpoint or an
LMDB path.

The lock is an ``flock`` on a file created 0600, held for as long as the
returned descriptor stays open (the kernel drops it when the process dies, so
a crash never leaves a stale lock); the holder's pid is written into the file
so that a refused process can say who holds it. The file itself is never
removed: two processes must always lock the same inode.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is the pid it wrote (or "?")."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.path = path
        self.holder = holder


def take(path: Path, *, follow_symlinks: bool = True) -> int:
    """Lock ``path`` (created 0600 if absent) without waiting, and write this process's pid in it.

    Returns the descriptor: closing it releases the lock. Raises LockHeld when
    another process holds it, OSError when the file cannot be opened.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LockHeld(path, holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def live_holder(path: Path, within: float) -> int | None:
    """The pid written in the lock file ``path`` when it was written less than ``within`` seconds ago
    and that process is alive (it took the lock just now: a lock file keeps its last holder's pid
    for ever, and an old one's pid may have been reused since), else None. Takes no lock: a probe
    must never turn away the daemon taking it at that moment."""
    try:
        if time.time() - path.stat().st_mtime > within:
            return None
        pid = int(path.read_text(errors="replace").strip() or "0")
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process: alive
        return pid
    return pid
