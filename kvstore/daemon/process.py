"""The daemon process: ``python -m kvstore.daemon --config FILE`` and ``kvstore serve``.

::

    main(argv)       the config file (or $KVSTORE_CONFIG, or the defaults) -> serve
    serve(config)    logging; torch's threads shared out over the workers; the endpoint locked
                     (a second daemon is refused here) -> Server.run(open_store) until
                     SIGTERM/SIGINT -> store flushed and closed, shared segments removed,
                     the endpoint's lock released
    open_store()     the shared-memory plane (open_plane), then the store over its pools;
                     the store in private memory where shared memory cannot be had
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

import zmq

from kvstore.config import Config, check_pools, load_config, runtime_dir
from kvstore.daemon.auth import ServerAuth
from kvstore.daemon.endpoint import claim
from kvstore.daemon.heap import keep_scratch
from kvstore.daemon.server import EXIT_CONFIG, EXIT_REFUSED, Server
from kvstore.errors import ConfigError, KVStoreError

if TYPE_CHECKING:
    from kvstore.shm.plane import SharedPlane
    from kvstore.store.engine import Store

log = logging.getLogger("kvstore.daemon.server")


def _setup_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kvstore").setLevel(level.upper())


def report_crashes() -> None:
    """A fatal signal in native code (a SIGBUS from a damaged LMDB page, which LMDB cannot check)
    leaves its cause and every thread's stack in the log, not a log that just stops. For the
    daemon's own process (its entry points call it); nothing where stderr is closed or no file."""
    with contextlib.suppress(AttributeError, RuntimeError, ValueError, OSError):
        faulthandler.enable(sys.stderr, all_threads=True)


def serve(config: Config) -> int:
    """Run the daemon until SIGTERM/SIGINT. Returns 0 after a clean stop, 1 when it refuses to start.

    The endpoint is locked before anything slow happens (a second daemon is refused within a
    second, naming this one's pid), bound next, and the store built while requests are answered
    ``starting``; the lock is released last, after the socket file is gone.
    """
    _setup_logging(config.server.log_level)
    _share_cores(config.server.workers)
    keep_scratch()  # codec temporaries reused from the heap, not mapped afresh per block (heap.py)
    try:  # what the config alone says is wrong: before anything is claimed or allocated
        check_pools(config)
        if config.cluster.enabled:
            from kvstore.store.cluster_admin import cluster_nodes

            cluster_nodes(config)
    except ConfigError as e:
        log.error("refusing to start: %s", e)
        return EXIT_CONFIG
    ctx = zmq.Context()
    cfg = config.server
    try:
        auth = ServerAuth.from_config(cfg.endpoint, cfg.curve_secret_key, cfg.curve_allowed_keys)
        held = claim(
            ctx,
            cfg.endpoint,
            insecure_tcp_ok=cfg.allow_insecure_tcp,
            curve=auth is not None,
            run_dir=runtime_dir(),
        )
    except KVStoreError as e:
        log.error("refusing to start: %s", e)
        ctx.destroy(linger=0)
        return EXIT_REFUSED
    except OSError as e:  # e.g. the socket's directory cannot be made: one line, no traceback
        log.error(
            "refusing to start: %s: %s; check [server] endpoint",
            e.strerror or e,
            e.filename or cfg.endpoint,
        )
        ctx.destroy(linger=0)
        return EXIT_REFUSED

    server = Server(config, None, ctx, auth=auth)
    # a commit's copy out of staging (and a pool's other host copies) on every core: one core cannot
    # saturate the memory bus (kvstore.memcopy), and the client that waits for it leaves its core idle
    from kvstore.memcopy import Copier

    copier = Copier(os.cpu_count() or 1)

    def open_store() -> Store:
        from kvstore.shm.segment import NoRoom
        from kvstore.store.engine import Store

        use_gpu(config)
        plane = open_plane(config)
        try:
            store = Store.from_config(
                config, memory=None if plane is None else plane.pools.memory, copier=copier
            )
        except NoRoom as e:
            assert plane is not None
            plane.close()
            log.warning("shared memory off: %s; clients use the socket", e)
            plane = None
            store = Store.from_config(config, copier=copier)
        except BaseException:
            if plane is not None:
                plane.close()
            raise
        server.plane = plane
        return store

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: server.stop(signal.Signals(signum).name))
    try:
        try:
            code = server.run(open_store)
        except (zmq.ZMQError, KVStoreError) as e:
            why = str(e)
            if isinstance(e, zmq.ZMQError) and e.errno in (errno.ENODEV, errno.EADDRNOTAVAIL):
                why = "its host is not an address of this machine (or does not resolve); check [server] endpoint"
            log.error("refusing to start: cannot serve %s: %s", config.server.endpoint, why)
            code = EXIT_REFUSED
            server.stop("start failed")
    finally:
        closed = server.store is not None
        try:
            if server.store is not None:
                server.store.close()  # flushes the write-through queue and closes LMDB
        except Exception as e:  # e.g. the final sync failed: the rest of the clean-up still runs
            log.error("closing the store failed: %s; blocks written since the last flush may be lost", e)
            closed, code = False, EXIT_REFUSED
        finally:
            if server.plane is not None:  # moves every page's generation, removes the shared segments
                server.plane.close(free=closed or server.store is None)  # and frees them, unless read
            copier.close()
        ctx.destroy(linger=1000)
        if held is not None:
            held.release()
    log.info(
        "stopped (%s); %d requests served%s",
        server._stop_reason or "loop ended",
        server.requests,
        ", store flushed and closed" if closed else "",
    )
    return code


def use_gpu(config: Config) -> None:
    """Make the hbm pool's GPU this thread's current one (the thread that builds the pools): CUDA
    contexts, pinned host memory and its registration then go to that GPU, not to GPU 0, which on a
    host of several GPUs another process serves from."""
    import torch

    from kvstore.tiers.pool import resolve_device

    device = resolve_device(config.hbm.resolved_device())  # ConfigError for a GPU this host lacks
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _share_cores(workers: int) -> None:
    """Give each worker thread its share of the cores for torch's own threads: ``workers`` threads
    each running a multi-threaded copy or codec on the same cores stall one another."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers)))


def open_plane(config: Config) -> SharedPlane | None:
    """The shared-memory data plane for an ``ipc://`` endpoint with ``shared_memory = "auto"``; None
    otherwise (tcp clients are on other hosts, or confined by CURVE: they use the socket). "auto"
    degrades to the socket, with a warning, where shared memory cannot be had (no /dev/shm, or one
    too small for the pools: a container's 64 MiB default); a ``shm_dir`` the operator set must work."""
    from kvstore.shm.segment import default_dir, sweep_leftovers

    cfg = config.server
    if cfg.shared_memory == "off" or not cfg.endpoint.startswith("ipc://"):
        gone = sweep_leftovers(cfg.shm_dir or default_dir())  # pools a crashed daemon left: GBs of RAM
        if gone:
            log.info("removed %d shared-memory segment(s) left by a daemon that is gone", gone)
        return None
    from kvstore.shm.plane import SharedPlane

    try:
        plane = SharedPlane(
            cfg.shm_dir or default_dir(),
            staging_bytes=cfg.shm_staging,
            per_client=min(cfg.shm_staging_per_client, cfg.shm_staging),
            lease=config.policy.pin_lease,
        )
    except KVStoreError as e:
        if cfg.shm_dir is not None:  # a directory the operator named must be usable
            raise
        log.warning("shared memory off: %s; clients use the socket", e)
        return None
    log.info(
        "shared memory: segments in %s, staging %d bytes (%d per client)",
        plane.directory,
        plane.staging_bytes,
        plane.per_client,
    )
    return plane


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.daemon", description="Run the kvstore daemon.")
    parser.add_argument("--config", help="TOML file (default: $KVSTORE_CONFIG, else built-in defaults)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except KVStoreError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return EXIT_CONFIG
    report_crashes()
    return serve(config)
