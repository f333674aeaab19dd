"""The ``kvstore`` command: run the daemon and operate it.

::

    kvstore serve    [--config FILE] [--endpoint E]
    kvstore stats    [--json]
    kvstore inspect  [--session S | --tokens FILE --model M --layout SPEC] [--json]
    kvstore evict    (--session S | --older-than 2d | --tier T | --model M | --tenant T | --namespace ID | --all)
                     [--dry-run] [--yes] [--json]
    kvstore prefetch --session S [--to ram|hbm] [--chunk N] [--json]
    kvstore demo     [--session S] [--tenant T] [--max-new-tokens N] [--document-tokens N]
    kvstore keygen   [--out DIR] [--name NAME] [--force] [--json]

Every command takes ``--endpoint`` (default: the config's ``[server] endpoint``,
from ``--config``/``$KVSTORE_CONFIG``, overridden by ``$KVSTORE_ENDPOINT``), and
``--config``. Operator commands talk to the daemon through KVStoreClient; over
``tcp://`` with CURVE they take their keys from ``KVSTORE_CURVE_SERVER_KEY`` and
``KVSTORE_CURVE_SECRET_KEY`` (see KVStoreClient). ``prefetch`` asks for the
session ``--chunk`` blocks at a time, drawing a progress bar on stderr when
stderr is a terminal (never with ``--json``), and ends with the time taken, the
blocks and bytes moved, and the rate. ``keygen`` makes a CURVE key
pair (``NAME.key``, ``NAME.key_secret`` mode 0600) and prints the public key.

Exit codes: 0 done; 1 the daemon refused (unknown session, ...) or the
operator declined; 2 usage errors (an argument past the daemon's limits too), bad config, or no
daemon to talk to. Errors
are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import zmq

from kvstore import pidlock
from kvstore.cli import display
from kvstore.cli.parser import (
    START_HINT,
    Unreachable,
    UsageError,
    parse_args,
    read_tokens,
)
from kvstore.config import check_connect_endpoint, ipc_socket_path, load_config, with_overrides
from kvstore.daemon.endpoint import lock_path
from kvstore.errors import ConfigError, DaemonStarting, KVStoreError
from kvstore.wire.errors import LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    from kvstore.client import KVStoreClient

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
STARTING_BIND = 60.0  # seconds a daemon that took its endpoint's lock may take to bind its socket


def resolve_endpoint(args: argparse.Namespace) -> str:
    """--endpoint, else the config's endpoint (--config or $KVSTORE_CONFIG, with $KVSTORE_* overrides).

    Raises ConfigError for an endpoint only a daemon can use (``tcp://*:5555``, where it listens)."""
    if args.endpoint:
        if args.config is not None:  # named, so read: a file that is wrong is said so, not skipped
            load_config(args.config)
        return _not_inproc(check_connect_endpoint(str(args.endpoint)))
    return _not_inproc(check_connect_endpoint(load_config(args.config).server.endpoint))


def check_reachable(endpoint: str) -> None:
    """Fail fast (Unreachable) when an ipc:// socket is plainly absent, instead of waiting for a timeout."""
    path = ipc_socket_path(endpoint)
    if path is None:
        return
    try:
        if path.parent.is_dir() and not os.access(path.parent, os.X_OK):
            raise Unreachable(
                f"cannot reach the daemon at {endpoint}: {path.parent} belongs to another user; "
                "run this command as the daemon's user"
            )
        there = path.exists()
    except OSError as e:  # a name too long for the filesystem, say
        raise Unreachable(f"cannot reach the daemon at {endpoint}: {e.strerror}") from None
    # a daemon that took the endpoint's lock and has not bound its socket yet is starting: the
    # client waits for it (a socket bound within seconds is waited for), then hears "starting"
    lock = lock_path(endpoint, path.parent)
    if not there and (lock is None or pidlock.live_holder(lock, STARTING_BIND) is None):
        raise Unreachable(f"no kvstore daemon is running at {endpoint}; {START_HINT}")


def connect(args: argparse.Namespace, **namespace: Any) -> Any:
    """The KVStoreClient every operator command goes through (imported here: it pulls in torch and zmq)."""
    endpoint = resolve_endpoint(args)
    check_reachable(endpoint)
    from kvstore.client import KVStoreClient

    return KVStoreClient(endpoint, timeout=args.timeout, retries=0, **namespace)


def plain(value: Any) -> Any:
    """Results as JSON-ready data: dataclasses to dicts, bytes to hex."""
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return value


def _emit(args: argparse.Namespace, data: Any, render: Callable[[Any], str], out: IO[str]) -> None:
    """Print ``data`` as JSON or rendered; RemoteProtocolError when the daemon's data cannot be rendered."""
    if args.json:
        out.write(json.dumps(data, indent=2) + "\n")
        return
    try:
        text = render(data)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        # the renderings take missing fields but trust the types of those present: a field of another
        # type is the daemon's fault (another version, or not a kvstore daemon), not a crash of ours
        raise RemoteProtocolError(
            "bad_header",
            f"the daemon's reply has a field this kvstore cannot show ({type(e).__name__}: {e}); "
            "--json prints the reply as it came, and the daemon should be of this kvstore's version",
        ) from None
    out.write(text + "\n")


def _not_inproc(endpoint: str) -> str:
    """``endpoint``, unless it is inproc://: a name within one process, and a daemon run by the CLI
    and every other command of it run each in a process of their own (UsageError)."""
    if endpoint.strip().startswith("inproc://"):
        raise UsageError(
            f"endpoint {endpoint!r} reaches only clients in the daemon's own process, and a command of "
            "the CLI runs in its own: give the daemon an ipc:// or tcp:// endpoint"
        )
    return endpoint


def cmd_serve(args: argparse.Namespace, out: IO[str]) -> int:
    config = load_config(args.config)
    if args.endpoint:
        config = with_overrides(config, "server", endpoint=args.endpoint)
    _not_inproc(config.server.endpoint)
    from kvstore.daemon.process import report_crashes, serve

    report_crashes()
    return serve(config)


def cmd_stats(args: argparse.Namespace, out: IO[str]) -> int:
    with connect(args) as client:
        _emit(args, plain(client.stats()), display.render_stats, out)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace, out: IO[str]) -> int:
    now = time.time()
    if args.tokens is not None:
        tokens = read_tokens(args.tokens)
        with connect(
            args, model=args.model, layout=args.layout, tenant=args.tenant, revision=args.revision
        ) as c:
            _emit(args, plain(c.inspect(token_ids=tokens)), display.render_prefix, out)
    elif args.session is not None:
        with connect(args) as client:
            _emit(
                args,
                plain(client.inspect(session=args.session)),
                lambda d: display.render_session(d, now),
                out,
            )
    else:
        with connect(args) as client:
            _emit(args, plain(client.sessions()), lambda d: display.render_sessions(d, now), out)
    return EXIT_OK


def _ask(prompt: str) -> bool:
    sys.stderr.write(prompt)
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _no_session(client: KVStoreClient, name: str) -> bool:
    """Whether the daemon knows no session ``name`` (False when it cannot say)."""
    try:
        client.inspect(session=name)
    except KVStoreError as e:
        return e.code == "not_found"
    return False


def cmd_evict(args: argparse.Namespace, out: IO[str]) -> int:
    flt = {
        "session": args.session,
        "older_than": args.older_than,
        "tier": args.tier,
        "model": args.model,
        "tenant": args.tenant,
        "namespace": args.namespace,
        "all": args.all,
    }
    interactive = sys.stdin is not None and sys.stdin.isatty()  # (None: started with stdin closed)
    if args.all and not (args.yes or args.dry_run or interactive):
        raise UsageError(
            "evict --all drops every block and stdin is not a terminal to ask; add --yes to confirm"
        )
    with connect(args) as client:
        # asked before the evict, which may take the session's record with its blocks
        unknown = args.session is not None and _no_session(client, args.session)
        result: dict[str, Any] | None = None
        if not (args.yes or args.dry_run) and interactive:
            preview = plain(client.evict(**flt, dry_run=True))
            if not preview["blocks"]:  # nothing to ask, and nothing evicted: said as it is, not as a preview
                result = {**preview, "dry_run": False}  # (blocks stored meanwhile are not evicted unasked)
            elif not _ask(f"{display.render_evict(preview)}.\nProceed? [y/N] "):
                sys.stderr.write("nothing evicted\n")
                return EXIT_FAILED
        if result is None:
            result = plain(client.evict(**flt, dry_run=args.dry_run))
        _emit(args, result, display.render_evict, out)
        if unknown and not result["blocks"] and not result.get("not_done"):  # a typo, most likely
            sys.stderr.write(f"no session {args.session!r} here (kvstore inspect lists them)\n")
            return EXIT_FAILED  # as inspect and prefetch of it: scripts see it
    return EXIT_FAILED if result.get("not_done") else EXIT_OK  # a part left to do: scripts see it


def cmd_prefetch(args: argparse.Namespace, out: IO[str], err: IO[str] | None = None) -> int:
    """Prefetch ``--chunk`` blocks per request until the session's chain is done (or broke at a
    failed block); the summary adds the wall time and the rate to the summed PrefetchResults."""
    err = err or sys.stderr
    bar = not args.json and err.isatty()  # a bar in a pipe or a log is noise
    total = dict.fromkeys(("moved", "present", "failed", "bytes_moved"), 0)
    blocks = requests = start = 0
    with connect(args) as client:
        started = time.monotonic()  # the requests', not the imports' and the connection's
        try:
            while True:
                r = client.prefetch(args.session, to=args.to, start_block=start, max_blocks=args.chunk)
                requests += 1
                blocks = r.blocks
                for k in total:
                    total[k] += getattr(r, k)
                if bar:
                    err.write(
                        "\r" + display.render_progress(r.blocks - r.remaining, r.blocks, total["bytes_moved"])
                    )
                    err.flush()
                if r.remaining <= 0:
                    break
                start += args.chunk
        finally:
            if bar:
                err.write("\r\x1b[K")  # the summary replaces the bar
                err.flush()
    seconds = time.monotonic() - started
    _emit(
        args,
        {
            "session": args.session,
            "to": args.to,
            **total,
            "blocks": blocks,
            "requests": requests,
            "seconds": round(seconds, 6),
        },
        display.render_prefetch,
        out,
    )
    return EXIT_FAILED if total["failed"] else EXIT_OK  # blocks that could not be read: scripts see it


def cmd_keygen(args: argparse.Namespace, out: IO[str]) -> int:
    from kvstore.daemon.auth import write_keypair

    try:
        files = write_keypair(Path(args.out), args.name, force=args.force)
    except OSError as e:
        raise UsageError(f"cannot write a key pair into {args.out}: {e.strerror}") from None
    if args.json:
        out.write(
            json.dumps(
                {
                    "public_key": files.public_key,
                    "public_file": str(files.public_file),
                    "secret_file": str(files.secret_file),
                },
                indent=2,
            )
            + "\n"
        )
    else:
        out.write(files.public_key + "\n")  # stdout is the key alone: PUB=$(kvstore keygen ...)
        sys.stderr.write(f"wrote {files.public_file} (public) and {files.secret_file} (secret, mode 0600)\n")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, out: IO[str]) -> int:
    endpoint = resolve_endpoint(args)
    check_reachable(endpoint)
    from kvstore.cli.demo import run_demo

    run_demo(
        endpoint,
        out,
        session=args.session,
        tenant=args.tenant,
        max_new_tokens=args.max_new_tokens,
        document_tokens=args.document_tokens,
        timeout=args.timeout,
    )
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace, IO[str]], int]] = {
    "serve": cmd_serve,
    "stats": cmd_stats,
    "inspect": cmd_inspect,
    "evict": cmd_evict,
    "prefetch": cmd_prefetch,
    "keygen": cmd_keygen,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script; returns the exit code."""
    args = parse_args(argv)
    err = sys.stderr if sys.stderr is not None else open(os.devnull, "w")  # noqa: SIM115 - (fd 2 closed)
    if sys.stdout is None:  # started with fd 1 closed (`kvstore stats >&-`): nowhere to answer
        err.write("kvstore: standard output is closed; nothing can be printed\n")
        return EXIT_FAILED
    try:
        return COMMANDS[args.command](args, sys.stdout)
    except (UsageError, ConfigError) as e:
        err.write(f"kvstore: {e}\n")
        return EXIT_USAGE
    except DaemonStarting as e:  # running, not ready yet within --timeout: no hint to start one
        err.write(f"kvstore: {e} (a command's: --timeout DURATION)\n")
        return EXIT_USAGE
    except TimeoutError as e:  # RequestTimeout: a socket file (stale, or a hung daemon) but no answer
        said = str(getattr(e, "message", e))
        hint = "" if "kvstore serve" in said else f" If it is not, {START_HINT}"  # said once
        err.write(f"kvstore: {said}{hint}\n")
        return EXIT_USAGE
    except LocalProtocolError as e:  # an argument the client will not send (past the daemon's limits)
        err.write(f"kvstore: {e}\n")
        return EXIT_USAGE if e.code in ("too_many_tokens", "invalid_argument") else EXIT_FAILED
    except KVStoreError as e:
        err.write(f"kvstore: {e}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        err.write("kvstore: interrupted\n")
        return 130
    except BrokenPipeError:  # `kvstore inspect | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep the interpreter's final flush quiet
        return EXIT_OK
    except OSError as e:  # the output cannot be written (a full disk), a file cannot be made
        err.write(f"kvstore: {e.strerror or e}{f': {e.filename}' if e.filename else ''}\n")
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter's final flush would fail again
        return EXIT_FAILED
    except zmq.ZMQError as e:  # an endpoint ZeroMQ refuses, past the config's checks
        err.write(f"kvstore: ZeroMQ cannot use the endpoint: {e}\n")
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
