"""The nvme tier's LMDB environment: opening, locking, format check, durability, map growth.

Durability (``durability=``; LMDB's flags; MDB_WRITEMAP and MDB_MAPASYNC are never used)::

  mode       LMDB flags              each commit            process kill (SIGKILL)  power loss / OS crash
  ---------  ----------------------  ---------------------  ----------------------  ------------------------------
  fast       MDB_NOSYNC              write() to the page    nothing lost,           everything synced by sync() is
             (sync=False)            cache, no fsync;       store intact            kept; if commits came after
                                     sync() fsyncs                                  the last sync(), they are lost
                                                                                    and the store may be damaged
                                                                                    (the disk may reorder writes):
                                                                                    it is wiped on next open (*)
  balanced   MDB_NOMETASYNC          fdatasync of the data  nothing lost,           the last commit(s) may roll
  (default)  (metasync=False)        pages; meta unsynced   store intact            back; integrity kept
  safe       (sync=True,             fdatasync of data,     nothing lost,           nothing acknowledged is lost
             metasync=True)          then of the meta page  store intact

Why a process kill loses nothing in every mode: without MDB_WRITEMAP a commit
writes its copy-on-write pages with write() and switches the meta page last;
all of that sits in the kernel's page cache, which outlives the process. A
kill mid-commit leaves the old meta page pointing at the old, intact tree.
MDB_WRITEMAP is not used: with it a stray write in this process lands in the
database, and with MDB_NOSYNC/MDB_MAPASYNC a power loss can corrupt it.

(*) ``fast``: before the first unsynced commit after a ``sync()``, a marker
naming this boot (``/proc/sys/kernel/random/boot_id``) is written and synced;
``sync()`` removes it. Opening a store whose marker names another boot means
the machine went down with unsynced commits: the store cannot be trusted and
is wiped (it is a cache; ``reset_reason`` says why). A marker of this same
boot is a process kill: kept. Where there is no boot id, the store is kept.

Longer than most modules: opening, locking, format checks, map growth and the durability
modes all guard one LMDB environment and share its state.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvstore import pidlock
from kvstore.errors import ConfigError, StoreFormatError, StoreLocked
from kvstore.tiers.base import TierFull, TierIOError

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT_VERSION = 2  # 2: records entries may be of entry format 2 (nvme_format.py), which builds of 1 drop
READS_VERSIONS = (1, 2)  # a store of version 1 is opened and marked 2 at once: no older build then
# takes it for one it can read (a build of version 1 took every format-2 entry for a damaged one and
# dropped it: it now refuses the store, naming the version)


class Durability(str, Enum):
    """How much a commit survives (the table above)."""

    FAST = "fast"
    BALANCED = "balanced"
    SAFE = "safe"

    def __str__(self) -> str:
        return self.value


DURABILITY: dict[Durability, dict[str, bool]] = {
    Durability.FAST: {"sync": False, "metasync": False},
    Durability.BALANCED: {"sync": True, "metasync": False},
    Durability.SAFE: {"sync": True, "metasync": True},
}
DEFAULT_DURABILITY = Durability.BALANCED
DB_NAMES = (b"blocks", b"records", b"sessions", b"namespaces", b"meta")
LOCK_FILE = "kvstore.lock"
# Room always left free on the filesystem: writes that would eat into it are refused (TierFull),
# and a store is not opened on a filesystem with less than half of it free.
DISK_HEADROOM = 1 << 20
# pages above the ceiling that deletes and rewrites may take (Environment.slack): a delete of 256 keys
# spread over the B-trees copies a leaf per key and db, plus branches and the freelist's own pages
FREEING_SLACK_PAGES = 2048
# LMDB's lock file (reader table) is mapped; a page of it that the filesystem cannot allocate
# is a SIGBUS, not an error. It is allocated up front (1024 readers take ~64 KiB).
LOCK_MDB_BYTES = 128 << 10
_DIRTY = b"dirty_boot"


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


class ResizeGate:
    """Many transactions at once, or one map resize alone (LMDB requires no open txn while resizing)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextmanager
    def txn(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """Begin a transaction's turn (waits while a resize runs); pair with ``leave``."""
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True  # new transactions wait from here on
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class Environment:
    """An open, locked environment: its named dbs, transactions, map growth, sync and close.

    Thread-safe: reads run concurrently; writes take one lock (so a check made
    inside a write transaction holds until its commit); a map resize waits
    for every open transaction (ResizeGate). lmdb errors become TierIOError,
    a map that cannot grow past ``ceiling`` becomes TierFull.
    """

    def __init__(
        self,
        path: Path,
        env: lmdb.Environment,
        dbs: dict[str, Any],
        *,
        durability: Durability,
        created: float,
        reset_reason: str | None,
        lock_fd: int,
        ceiling: int,
    ) -> None:
        self.path, self.env, self.dbs = path, env, dbs
        self.durability, self.created, self.reset_reason = durability, created, reset_reason
        self.ceiling = ceiling
        self.psize = int(env.stat()["psize"])
        # Map room only transactions that free or rewrite entries may grow into (``write(frees=True)``):
        # LMDB copies every page a delete touches, and a store filled to its ceiling could otherwise
        # never delete enough to make room. Counted from the map at open, which LMDB raises to the
        # file's size (a store reopened with a smaller capacity is above its ceiling until trimmed).
        self.slack = FREEING_SLACK_PAGES * self.psize
        self._floor = max(ceiling, int(env.info()["map_size"]))
        self._lock_fd = lock_fd
        self._main = env.open_db()
        self._gate = ResizeGate()
        self._wlock = threading.Lock()
        # a marker left by a process of this boot that went down unsynced (_check_clean keeps the
        # store): the next sync syncs what it left and takes the marker away, as that process's would
        with env.begin(db=dbs["meta"]) as txn:
            self._dirty = txn.get(_DIRTY) is not None
        self._closed = False

    def disk_room(self) -> int:
        """Bytes the B-trees can hold without the filesystem running out: the pages data.mdb already
        has (high-water mark) plus the filesystem's free space beyond DISK_HEADROOM. A disk filled by
        others caps the store at the pages it has (old blocks make way for new ones there)."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return 1 << 62  # cannot tell: the configured capacity alone decides
        allocated = (int(self.env.info()["last_pgno"]) + 1) * self.psize
        return allocated + max(0, st.f_bavail * st.f_frsize - DISK_HEADROOM)

    def used_bytes(self, txn: lmdb.Transaction) -> int:
        """Pages the B-trees of every db hold, plus the two meta pages, in bytes."""
        pages = 2
        for db in (self._main, *self.dbs.values()):
            st = txn.stat(db)
            pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return pages * self.psize

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError(f"nvme store {self.path} is closed")

    def _damaged(self, e: lmdb.Error) -> TierIOError:
        return TierIOError(
            f"nvme store {self.path} is damaged ({e}); move the directory aside (or delete it) to "
            "start empty, or point [nvme] path elsewhere"
        )

    def read(self, fn: Callable[[lmdb.Transaction], T], *, buffers: bool = False) -> T:
        """Run ``fn`` in a read transaction (with ``buffers``, values are views valid inside ``fn`` only)."""
        self._check_open()
        self._gate.enter()  # enter/leave, not ``with gate.txn()``: reads are the hot path, a generator costs
        try:
            with self.env.begin(buffers=buffers) as txn:  # type: ignore[call-overload]
                return fn(txn)
        except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError) as e:  # a damaged page
            raise self._damaged(e) from e
        except lmdb.Error as e:
            raise TierIOError(f"nvme store {self.path}: read failed: {e}; check the disk") from e
        finally:
            self._gate.leave()

    def write(self, fn: Callable[[lmdb.Transaction], T], *, frees: bool = False) -> T:
        """Run ``fn`` in one write transaction; grow the map on MapFullError; TierFull at the ceiling.
        ``frees``: ``fn`` only deletes or rewrites entries in place; its pages may come from ``slack``
        above the ceiling, so that room can always be made (keep such transactions small)."""
        with self._wlock:
            self._check_open()
            if self.durability is Durability.FAST and not self._dirty:
                # unsynced commits follow: say so on disk first (see the module docstring)
                self._commit(
                    lambda txn: txn.put(_DIRTY, (boot_id() or "unknown").encode(), db=self.dbs["meta"])
                )
                self._sync()
                self._dirty = True
            return self._commit(fn, frees)

    def _commit(self, fn: Callable[[lmdb.Transaction], T], frees: bool = False) -> T:
        """One write transaction, retried after growing the map. Caller holds the write lock."""
        while True:
            try:
                with self._gate.txn(), self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                if not self._grow(self._floor + self.slack if frees else self.ceiling):
                    raise TierFull(
                        f"nvme store {self.path} has filled its {self.ceiling} bytes "
                        "(LMDB map full); evict or raise [nvme] capacity"
                    ) from None
            except (lmdb.CorruptedError, lmdb.PageNotFoundError) as e:  # a damaged page, not the disk's room
                raise self._damaged(e) from e
            except lmdb.Error as e:
                if "No space left" in str(e):  # the transaction was aborted: nothing changed
                    raise TierFull(
                        f"nvme store {self.path}: the filesystem is full ({e}); evict, free "
                        "disk space or lower [nvme] capacity"
                    ) from None
                raise TierIOError(
                    f"nvme store {self.path}: write failed: {e}; check the disk (space, permissions)"
                ) from e

    def _grow(self, limit: int) -> bool:
        with self._gate.exclusive():
            current = int(self.env.info()["map_size"])
            new = min(limit, current * 2)
            if new <= current:
                return False
            self.env.set_mapsize(new)
            log.info("nvme store %s: LMDB map grown from %d to %d bytes", self.path, current, new)
            return True

    def _sync(self) -> None:
        try:
            with self._gate.txn():
                self.env.sync(True)
        except lmdb.Error as e:
            raise TierIOError(f"nvme store {self.path}: sync failed: {e}; check the disk") from e

    def sync(self) -> None:
        """Flush every commit so far to disk (fsync), whatever the mode. TierIOError on failure."""
        with self._wlock:
            self._check_open()
            self._sync()
            if self._dirty:
                try:
                    self._commit(lambda txn: txn.delete(_DIRTY, db=self.dbs["meta"]), frees=True)
                except TierFull:
                    # no room even to delete the marker: it stays, which errs on the safe side
                    log.warning(
                        "nvme store %s: full; the unsynced-commits marker stays until room is made", self.path
                    )
                    return
                # the marker's deletion is committed: from here the next write marks anew, even when
                # this sync fails (its commits may not all be on disk, and nothing would say so)
                self._dirty = False
                self._sync()

    def close(self) -> None:
        """Sync, close the environment, release the lock. Idempotent. A failed sync (TierIOError)
        is raised after the rest: the store is closed and its lock released all the same."""
        if self._closed:
            return
        try:
            self.sync()
        finally:
            with self._wlock, self._gate.exclusive():
                self._closed = True
                self.env.close()
                os.close(self._lock_fd)  # releases the flock


def _lock(path: Path) -> int:
    try:
        return pidlock.take(path / LOCK_FILE)
    except pidlock.LockHeld as e:
        raise StoreLocked(
            f"nvme store {path} is in use by another kvstore (pid {e.holder}); "
            "stop it, or point [nvme] path at another directory"
        ) from None


def _open_lmdb(path: Path, durability: Durability, map_size: int, max_dbs: int) -> lmdb.Environment:
    try:
        return lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=max_dbs,
            max_readers=1024,
            subdir=True,
            writemap=False,
            map_async=False,
            readahead=True,
            **DURABILITY[durability],
        )
    except (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.CorruptedError) as e:
        raise StoreFormatError(
            f"{path} holds a data.mdb that is not a kvstore nvme store ({e}); point "
            "[nvme] path at another directory, or delete this one to start empty"
        ) from None
    except lmdb.Error as e:  # ENOSPC, EACCES, EROFS, ...
        raise TierIOError(
            f"nvme store {path} cannot be opened: {e}; point [nvme] path at a writable "
            "directory with free space"
        ) from None


def open_environment(
    path: str | Path, *, durability: Durability | str, map_size: int, ceiling: int
) -> Environment:
    """Lock ``path`` (a directory, created if missing), open or create the store, check its format.

    Raises StoreLocked when another process holds it, StoreFormatError when it
    holds another format version or something that is not a kvstore store,
    ConfigError for an unknown durability mode.
    """
    try:
        durability = Durability(durability)
    except ValueError:
        choices = ", ".join(map(str, Durability))
        raise ConfigError(f"nvme durability {durability!r} is not one of {choices}") from None
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():  # mkdir would say "File exists"
            raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory", str(path))
        if path.is_symlink() and not path.exists():  # here too
            raise FileNotFoundError(
                errno.ENOENT, f"a symbolic link to {os.readlink(path)}, which does not exist", str(path)
            )
        path.mkdir(parents=True, exist_ok=True)
        fd = _lock(path)
    except OSError as e:  # unwritable, not a directory, read-only or full filesystem
        raise TierIOError(
            f"nvme store {path} cannot be opened: {e.strerror or e}; point [nvme] path at a "
            "writable directory with free space"
        ) from None
    try:
        reset_reason = _check_clean(path, map_size, durability)
        _check_disk(path)
        env = _open_lmdb(path, durability, map_size, len(DB_NAMES))
        try:
            dbs, created = _open_dbs(env, path)
        except BaseException:
            env.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return Environment(
        path,
        env,
        dbs,
        durability=durability,
        created=created,
        reset_reason=reset_reason,
        lock_fd=fd,
        ceiling=ceiling,
    )


def _check_disk(path: Path) -> None:
    """TierIOError unless the filesystem has room to run a store: half of DISK_HEADROOM free, and
    LMDB's mapped lock file allocated for real (a full disk must be an error, not a SIGBUS)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < DISK_HEADROOM // 2:
        raise TierIOError(
            f"nvme store {path}: the filesystem has only {free} bytes free (at least "
            f"{DISK_HEADROOM // 2} needed); free disk space or point [nvme] path elsewhere"
        )
    fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(LOCK_MDB_BYTES, os.fstat(fd).st_size))
    except OSError as e:
        raise TierIOError(
            f"nvme store {path}: cannot allocate LMDB's lock file: {e.strerror}; free disk "
            "space or point [nvme] path elsewhere"
        ) from None
    finally:
        os.close(fd)


def _open_dbs(env: lmdb.Environment, path: Path) -> tuple[dict[str, Any], float]:
    try:
        with env.begin(write=True) as txn:
            names = {bytes(k) for k, _ in txn.cursor()}
            fresh = not names
            if not fresh and b"meta" not in names:
                raise StoreFormatError(
                    f"{path} holds an LMDB database that is not a kvstore nvme store; "
                    "point [nvme] path at an empty directory"
                )
            dbs = {n.decode(): env.open_db(n, txn=txn) for n in DB_NAMES}
            meta = dbs["meta"]
            if fresh:
                txn.put(b"format_version", str(FORMAT_VERSION).encode(), db=meta)
                txn.put(b"created", repr(time.time()).encode(), db=meta)
            found = txn.get(b"format_version", db=meta)
            if found not in {str(v).encode() for v in READS_VERSIONS}:
                shown = found.decode(errors="replace") if found is not None else "none"
                raise StoreFormatError(
                    f"{path} holds a kvstore nvme store of format version {shown}; "
                    f"this build reads versions {', '.join(map(str, READS_VERSIONS))}. Point [nvme] "
                    "path at another directory, or delete this one to start empty"
                )
            if found != str(FORMAT_VERSION).encode():  # an older store: readable, and marked as ours
                txn.put(b"format_version", str(FORMAT_VERSION).encode(), db=meta)
            created = _created(txn.get(b"created", default=b"0", db=meta), path)
    except lmdb.IncompatibleError as e:
        raise StoreFormatError(f"{path} holds an LMDB database that is not a kvstore nvme store: {e}") from e
    except (lmdb.CorruptedError, lmdb.PageNotFoundError) as e:  # a damaged page, not a full disk
        raise StoreFormatError(
            f"nvme store {path} is damaged ({e}); move the directory aside (or delete it) to start "
            "empty, or point [nvme] path elsewhere"
        ) from None
    except lmdb.Error as e:  # e.g. no space left to write the first transaction
        raise TierIOError(
            f"nvme store {path} cannot be opened: {e}; point [nvme] path at a writable "
            "directory with free space"
        ) from None
    try:
        env.sync(True)
    except lmdb.Error as e:
        raise TierIOError(f"nvme store {path} cannot be synced: {e}; check the disk") from None
    return dbs, created


def check_whole(path: Path, env: lmdb.Environment) -> None:
    """StoreFormatError when ``path``'s data.mdb is shorter than the pages its meta page says the
    store has (a copy or restore cut short, a filesystem that lost the file's tail): LMDB maps them
    anyway, and the first read of a missing one kills the process with SIGBUS instead of raising.
    Reads the meta page only; call it before any transaction."""
    have = (path / "data.mdb").stat().st_size
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if have < need:
        raise StoreFormatError(
            f"nvme store {path}: data.mdb is truncated ({have} of its {need} bytes); it cannot be "
            "read. Move the directory aside (or delete it) to start empty, or point [nvme] path "
            "elsewhere"
        )


def _check_clean(path: Path, map_size: int, durability: Durability) -> str | None:
    """Wipe a ``fast`` store that went down with the machine while it had unsynced commits. A
    truncated data.mdb (``check_whole``) or one whose pages LMDB finds damaged: a ``fast`` store is
    wiped too (unsynced pages lost with the machine: its marker cannot be read to say so; reading a
    truncated file's would be a SIGBUS); another is refused with StoreFormatError."""
    if not (path / "data.mdb").exists():
        return None
    try:
        env = lmdb.open(str(path), map_size=map_size, max_dbs=len(DB_NAMES), readonly=True, lock=False)
    except lmdb.Error:
        return None  # _open_lmdb reports what is wrong with it
    try:
        try:
            check_whole(path, env)
        except StoreFormatError as e:
            if durability is not Durability.FAST:
                raise
            return _wipe(path, f"{e}; with durability 'fast' it is taken for unsynced pages lost, and wiped")
        with env.begin() as txn:
            if txn.get(b"meta") is None:
                return None
            marker = txn.get(_DIRTY, db=env.open_db(b"meta", txn=txn, create=False))
    except (lmdb.CorruptedError, lmdb.PageNotFoundError) as e:
        if durability is not Durability.FAST:
            return None  # _open_dbs refuses it, saying what is wrong with it
        # the newest meta page reached the disk, a page it names did not: the marker's own read fails
        return _wipe(
            path,
            f"nvme store {path} is damaged ({e}); with durability 'fast' it is taken for unsynced "
            "pages lost with the machine, and wiped",
        )
    except lmdb.Error:
        return None  # _open_dbs reports what is wrong with it
    finally:
        env.close()
    now = boot_id()
    if marker is None or now is None or marker.decode(errors="replace") == now:
        return None
    return _wipe(
        path,
        f"nvme store {path} had unsynced commits (durability 'fast') when the machine went down "
        f"(boot {marker.decode(errors='replace')}); it may be damaged and was wiped",
    )


def _wipe(path: Path, reason: str) -> str:
    """Delete the store at ``path`` (its lock held, its environment closed); returns ``reason``, logged."""
    log.warning(reason)
    for name in ("data.mdb", "lock.mdb"):
        (path / name).unlink(missing_ok=True)
    return reason


def _created(raw: bytes, path: Path) -> float:
    """The store's creation time as ``meta`` holds it; 0 (unknown) for a damaged value, which only
    ``stats`` shows: it must not keep the store from opening."""
    try:
        t = float(raw)
    except ValueError:
        t = math.nan
    if not math.isfinite(t) or t < 0:
        log.warning("nvme store %s: its creation time %r is damaged; shown as unknown", path, raw[:40])
        return 0.0
    return t
