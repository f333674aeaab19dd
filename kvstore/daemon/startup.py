"""What the daemon says while it builds its store, and what it answers meanwhile.

Building the store allocates the hbm and ram pools and rebuilds the index
from LMDB: about 45 s for the default config's 6 GiB of pools. The daemon is
bound by then, so ``Startup`` runs the build on a thread while the loop
answers every request ``starting`` (``message``) and logs::

    starting (pid 4242): hbm 2.0 GiB on cpu, ram 4.0 GiB (fp8), nvme data/nvme (int4, map 64.0 GiB)
    reading back 1234567 blocks from data/nvme
    still starting after 10 s: allocating the pools and reading back 1234567 blocks
    store ready after 14.2 s: 1234567 blocks on nvme

The count of blocks to read back is the LMDB ``records`` db's entry count,
read here without a lock before the store opens the environment (the store
owns its format and locking; this only reads one figure of LMDB's own).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.config import Config
from kvstore.units import format_bytes

if TYPE_CHECKING:
    from kvstore.store.engine import Store

log = logging.getLogger("kvstore.daemon.server")

RECORDS_DB = b"records"  # tiers/nvme.py: one entry per block


def stored_blocks(path: Path) -> int | None:
    """Blocks the nvme store at ``path`` holds; 0 for no store yet; None when it cannot be read.

    Opens the environment read-only and without LMDB's lock table, and closes it
    before returning: nothing is written, and no lock the store takes is touched.
    """
    try:
        if path.exists() and not path.is_dir():
            return None  # refused when the store opens, with the reason: "a new store" would mislead
        if not (path / "data.mdb").exists():
            return 0
    except OSError as e:  # EACCES, ENAMETOOLONG: Path.exists says False only for a path that is not there
        log.warning(
            "cannot look into %s: %s; the daemon's user must be able to enter and read it "
            "(fix its permissions or set [nvme] path)",
            path,
            e.strerror or e,
        )
        return None
    try:
        import lmdb

        from kvstore.tiers.lmdb_env import check_whole

        env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8, subdir=True)
        try:
            check_whole(path, env)  # a truncated file: no read, which would be a SIGBUS
            db = env.open_db(RECORDS_DB, create=False)
            with env.begin(db=db) as txn:
                return int(txn.stat(db)["entries"])
        finally:
            env.close()
    except Exception as e:  # a report only: the store's own open says what is wrong, if anything
        log.debug("cannot count the blocks in %s: %s", path, e)
        return None


class Startup:
    """Builds the store on a thread; reports on it. ``begin`` once, then poll ``done`` from the loop."""

    def __init__(self, config: Config, open_store: Callable[[], Store]) -> None:
        self.config = config
        self._open_store = open_store
        self._thread = threading.Thread(target=self._build, name="kvstore-start", daemon=True)
        self._store: Store | None = None
        self._error: BaseException | None = None
        self._began = self._said = time.monotonic()
        self.blocks: int | None = None  # blocks to read back from nvme, when known

    def begin(self) -> None:
        """Log what start-up will do, then start building the store."""
        cfg = self.config
        nvme = (
            f"nvme {cfg.nvme.path} ({cfg.nvme.codec}, map {format_bytes(cfg.nvme.capacity)})"
            if cfg.nvme.enabled
            else "nvme off"
        )
        log.info(
            "starting (pid %d) on %s: allocating hbm %s on %s, ram %s (%s); %s",
            os.getpid(),
            cfg.server.endpoint,
            format_bytes(cfg.hbm.capacity),
            cfg.hbm.resolved_device(),
            format_bytes(cfg.ram.capacity),
            cfg.ram.codec,
            nvme,
        )
        if cfg.nvme.enabled:
            self.blocks = stored_blocks(cfg.nvme.path)
            if self.blocks:
                log.info("reading back %d blocks from %s", self.blocks, cfg.nvme.path)
            elif self.blocks == 0:
                log.info("no blocks to read back from %s (a new store)", cfg.nvme.path)
        self._began = self._said = time.monotonic()
        self._thread.start()

    def _build(self) -> None:
        try:
            self._store = self._open_store()
        except BaseException as e:  # noqa: B036 - handed to the loop by result()
            self._error = e

    def done(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def result(self) -> Store:
        """The store built; raises what building it raised. Call once ``done``."""
        if self._error is not None:
            raise self._error
        assert self._store is not None
        nvme = self._store.stats().tiers.get("nvme")
        log.info(
            "store ready after %.1f s%s",
            self.elapsed(),
            f": {nvme.blocks} blocks on nvme" if nvme is not None else "",
        )
        return self._store

    def elapsed(self) -> float:
        return time.monotonic() - self._began

    def doing(self) -> str:
        if self.blocks:
            return f"allocating the pools and reading back {self.blocks} blocks"
        return "allocating the pools"

    def progress(self, every: float) -> None:
        """Log a "still starting" line when ``every`` seconds passed since the last one."""
        if self.done() or time.monotonic() - self._said < every:
            return
        self._said = time.monotonic()
        log.info("still starting after %.0f s: %s", self.elapsed(), self.doing())

    def message(self) -> str:
        """The ``starting`` error reply's message."""
        return (
            f"the daemon is starting ({self.doing()}, {self.elapsed():.0f} s so far); "
            "retry shortly (KVStoreClient waits for it up to its timeout)"
        )

    def refusal(self, e: BaseException) -> str:
        """One line saying why the store could not be built, naming the setting of the path at fault."""
        if isinstance(e, OSError) and not str(e).startswith("nvme"):
            where = Path(os.fsdecode(e.filename)) if e.filename else self.config.nvme.path
            return f"{e.strerror or e}: {where}; check {self._setting_of(where)}"
        return str(e)

    def _setting_of(self, path: Path) -> str:
        """The setting whose directory holds ``path`` (or is made under it), else what to check."""
        from kvstore.shm.segment import default_dir

        cfg = self.config
        shm = cfg.server.shm_dir or default_dir()
        for directory, key in (
            (cfg.nvme.path, "[nvme] path"),
            (
                shm,
                "[server] shm_dir" if cfg.server.shm_dir else '[server] shm_dir (or shared_memory = "off")',
            ),
        ):
            if path.is_relative_to(directory) or directory.is_relative_to(path):
                return key
        return "that the daemon's user may use it"
