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
operator declined; 2 usage errors, bad config, or no daemon to talk to. Errors
are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import IO, Any

from kvstore.cli import display
from kvstore.config import check_endpoint, ipc_socket_path, load_config, parse_duration, with_overrides
from kvstore.errors import ConfigError, KVStoreError
from kvstore.tiers.base import TierName

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
TIERS = tuple(t.value for t in TierName)
PREFETCH_CHUNK = 16  # blocks per prefetch request: small enough for a smooth bar, big enough to stay cheap
START_HINT = "start it with `kvstore serve` (or `./dev serve` in a checkout)"


class UsageError(KVStoreError):
    """The command cannot run as given (unreadable input, a missing --yes); exit 2."""

    code = "usage"


class Unreachable(UsageError):
    """No daemon answers at the endpoint; the message says how to start one."""

    code = "unreachable"


# ---------------------------------------------------------------- argument types


def _duration_arg(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive")
    return seconds


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


def _endpoint_arg(text: str) -> str:
    try:
        return check_endpoint(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_LAYOUT_ALIASES = {"L": "num_layers", "H": "num_kv_heads", "D": "head_dim", "T": "block_tokens"}


def parse_layout(text: str) -> Any:
    """``"L=30,H=3,D=64,dtype=bfloat16,T=64"`` (or the long field names) -> KVLayout; argparse-friendly errors."""
    from kvstore.layout import KVLayout

    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"layout part {part!r} is not key=value; write e.g. L=30,H=3,D=64,dtype=bfloat16,T=64"
            )
        name = _LAYOUT_ALIASES.get(name.strip(), name.strip())
        fields[name] = value.strip() if name == "dtype" else _int_field(name, value)
    try:
        return KVLayout.from_dict(fields)
    except KVStoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_field(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {name} must be an integer, got {value!r}") from None


def read_tokens(path: str, stdin: IO[str] | None = None) -> list[int]:
    """Token ids from a file (``-`` = stdin): a JSON list, or integers separated by spaces, commas or newlines."""
    try:
        text = (stdin or sys.stdin).read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read tokens from {path}: {e.strerror}") from None
    try:
        data = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [int(t) for t in text.replace(",", " ").split()]
        )
    except ValueError as e:
        raise UsageError(
            f"{path} must hold token ids: a JSON list or integers separated by spaces ({e})"
        ) from None
    if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in data):
        raise UsageError(f"{path} must hold a flat list of integer token ids")
    return data


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument(
        "--endpoint",
        type=_endpoint_arg,
        help="daemon endpoint (default: the config's [server] endpoint, or $KVSTORE_ENDPOINT)",
    )
    common.add_argument(
        "--config", metavar="FILE", help="TOML config (default: $KVSTORE_CONFIG, else built-in)"
    )
    ops = argparse.ArgumentParser(add_help=False, allow_abbrev=False, parents=[common])
    ops.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    ops.add_argument(
        "--timeout",
        type=_duration_arg,
        default=5.0,
        metavar="DURATION",
        help="how long to wait for the daemon (default 5s)",
    )

    parser = argparse.ArgumentParser(
        prog="kvstore",
        allow_abbrev=False,
        description="Tiered KV-cache store for LLM inference: run and operate the daemon.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "serve",
        parents=[common],
        allow_abbrev=False,
        help="run the daemon until SIGTERM/SIGINT",
        description="Run the daemon in the foreground; SIGTERM or Ctrl-C flushes to disk and stops it.",
    )
    p.set_defaults(parser=p)
    p = sub.add_parser("stats", parents=[ops], allow_abbrev=False, help="per-tier usage, hits and counters")
    p.set_defaults(parser=p)

    p = sub.add_parser(
        "inspect",
        parents=[ops],
        allow_abbrev=False,
        help="list sessions, one session, or a prefix",
        description="Without options: every session. --session: where that session's blocks live. "
        "--tokens: how much of a token sequence is stored (needs --model and --layout).",
    )
    p.add_argument("--session", help="show this session's blocks")
    p.add_argument(
        "--tokens", metavar="FILE", help="token ids (JSON list or whitespace separated; - = stdin)"
    )
    p.add_argument("--model", help="model id of --tokens")
    p.add_argument(
        "--layout",
        type=parse_layout,
        metavar="SPEC",
        help="layout of --tokens, e.g. L=30,H=3,D=64,dtype=bfloat16,T=64",
    )
    p.add_argument("--tenant", default="default", help="tenant of --tokens (default: default)")
    p.add_argument("--revision", default="", help="model revision of --tokens")
    p.set_defaults(parser=p)

    p = sub.add_parser(
        "evict",
        parents=[ops],
        allow_abbrev=False,
        help="drop (or move down) blocks",
        description="Evict the blocks every given filter selects (filters combine with AND). "
        "With --tier the blocks in that tier move down one tier instead of going away.",
    )
    p.add_argument("--session", help="blocks of this session (and no other)")
    p.add_argument(
        "--older-than", type=_duration_arg, metavar="DURATION", help="blocks unused this long, e.g. 2d"
    )
    p.add_argument("--tier", choices=TIERS, help="blocks held in this tier move down one tier")
    p.add_argument("--model", help="blocks of this model id")
    p.add_argument("--tenant", help="blocks of this tenant")
    p.add_argument("--namespace", metavar="ID", help="blocks of this namespace id (see inspect)")
    p.add_argument("--all", action="store_true", help="every block (asks first; --yes to skip)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be evicted")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(parser=p)

    p = sub.add_parser(
        "prefetch",
        parents=[ops],
        allow_abbrev=False,
        help="bring a session's blocks up a tier",
        description="Warm a session up (e.g. from nvme after a restart) before its user comes "
        "back: its blocks are copied up into --to, a chunk at a time, with a progress "
        "bar on a terminal; then the time taken, what moved and the rate.",
    )
    p.add_argument("--session", required=True, help="the session to warm up")
    p.add_argument(
        "--to",
        choices=(TierName.RAM.value, TierName.HBM.value),
        default=TierName.RAM.value,
        help="target tier (default ram)",
    )
    p.add_argument(
        "--chunk",
        type=_positive_int,
        default=PREFETCH_CHUNK,
        metavar="N",
        help=f"blocks per request (default {PREFETCH_CHUNK})",
    )
    p.set_defaults(parser=p)

    p = sub.add_parser(
        "keygen",
        allow_abbrev=False,
        help="make a CURVE key pair for tcp daemons and clients",
        description="Write NAME.key (public) and NAME.key_secret (secret, mode 0600) into DIR and "
        "print the public key. A daemon uses its secret file as [server] "
        "curve_secret_key; a client's public key goes into the daemon's "
        "curve_allowed_keys as '<public key> <tenant>'.",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=".",
        help="directory for the pair (created 0700 if missing; default: the current directory)",
    )
    p.add_argument("--name", default="kvstore", help="file name of the pair (default kvstore)")
    p.add_argument("--force", action="store_true", help="replace an existing pair of that name")
    p.add_argument("--json", action="store_true", help="print the key and both paths as JSON")
    p.set_defaults(parser=p)

    p = sub.add_parser(
        "demo",
        parents=[common],
        allow_abbrev=False,
        help="chat with SmolLM2 through the daemon",
        description="A multi-turn conversation with SmolLM2-135M-Instruct through a running daemon, "
        "printing per turn the tokens reused, the time to first token with and without "
        "kvstore, and the tier each reused block came from.",
    )
    p.add_argument("--session", default="demo", help="session tag of the conversation (default: demo)")
    p.add_argument("--tenant", default="default", help="tenant of the conversation (default: default)")
    p.add_argument(
        "--max-new-tokens", type=int, default=48, metavar="N", help="answer length cap (default 48)"
    )
    p.add_argument(
        "--document-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="tokens of the document handed over in turn 1 (default 1024)",
    )
    p.add_argument(
        "--timeout",
        type=_duration_arg,
        default=30.0,
        metavar="DURATION",
        help="how long to wait for the daemon per call (default 30s)",
    )
    p.set_defaults(parser=p)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check; usage errors exit 2 with a message naming the flag."""
    args, extra = build_parser().parse_known_args(argv)
    parser = args.parser  # the subcommand's, so messages show its usage
    if extra:
        known = [o for a in parser._actions for o in a.option_strings]
        close = difflib.get_close_matches(extra[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if args.command == "inspect":
        if args.tokens is not None and (args.model is None or args.layout is None):
            parser.error(
                "inspect --tokens needs --model and --layout (the namespace the tokens were stored under)"
            )
        if args.tokens is None and (args.model or args.layout):
            parser.error("inspect: --model and --layout only go with --tokens")
        if args.tokens is not None and args.session is not None:
            parser.error("inspect: give --session or --tokens, not both")
    if args.command == "evict":
        given = [
            f
            for f in ("session", "older_than", "tier", "model", "tenant", "namespace")
            if getattr(args, f) is not None
        ]
        if not given and not args.all:
            parser.error(
                "evict needs a filter: --session, --older-than, --tier, --model, --tenant, "
                "--namespace or --all"
            )
        if given and args.all:
            parser.error(f"evict --all selects everything; drop --{given[0].replace('_', '-')} or --all")
    return args


# ---------------------------------------------------------------- commands


def resolve_endpoint(args: argparse.Namespace) -> str:
    """--endpoint, else the config's endpoint (--config or $KVSTORE_CONFIG, with $KVSTORE_* overrides)."""
    if args.endpoint:
        return str(args.endpoint)
    return load_config(args.config).server.endpoint


def check_reachable(endpoint: str) -> None:
    """Fail fast (Unreachable) when an ipc:// socket is plainly absent, instead of waiting for a timeout."""
    path = ipc_socket_path(endpoint)
    if path is None:
        return
    if path.parent.is_dir() and not os.access(path.parent, os.X_OK):
        raise Unreachable(
            f"cannot reach the daemon at {endpoint}: {path.parent} belongs to another user; "
            "run this command as the daemon's user"
        )
    if not path.exists():
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
    out.write((json.dumps(data, indent=2) if args.json else render(data)) + "\n")


def cmd_serve(args: argparse.Namespace, out: IO[str]) -> int:
    config = load_config(args.config)
    if args.endpoint:
        config = with_overrides(config, "server", endpoint=args.endpoint)
    from kvstore.daemon.server import serve

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
    interactive = sys.stdin.isatty()
    if args.all and not (args.yes or args.dry_run or interactive):
        raise UsageError(
            "evict --all drops every block and stdin is not a terminal to ask; add --yes to confirm"
        )
    with connect(args) as client:
        if not (args.yes or args.dry_run) and interactive:
            preview = plain(client.evict(**flt, dry_run=True))
            if not preview["blocks"]:
                _emit(args, preview, display.render_evict, out)
                return EXIT_OK
            if not _ask(f"{display.render_evict(preview)}.\nProceed? [y/N] "):
                sys.stderr.write("nothing evicted\n")
                return EXIT_FAILED
        _emit(args, plain(client.evict(**flt, dry_run=args.dry_run)), display.render_evict, out)
    return EXIT_OK


def cmd_prefetch(args: argparse.Namespace, out: IO[str], err: IO[str] | None = None) -> int:
    """Prefetch ``--chunk`` blocks per request until the session's chain is done (or broke at a
    failed block); the summary adds the wall time and the rate to the summed PrefetchResults."""
    err = err or sys.stderr
    bar = not args.json and err.isatty()  # a bar in a pipe or a log is noise
    total = dict.fromkeys(("moved", "present", "failed", "bytes_moved"), 0)
    blocks = requests = start = 0
    started = time.monotonic()
    with connect(args) as client:
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
    return EXIT_OK


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
    err = sys.stderr
    try:
        return COMMANDS[args.command](args, sys.stdout)
    except (UsageError, ConfigError) as e:
        err.write(f"kvstore: {e}\n")
        return EXIT_USAGE
    except TimeoutError as e:  # RequestTimeout: a socket file (stale, or a hung daemon) but no answer
        err.write(f"kvstore: {getattr(e, 'message', e)} If it is not, {START_HINT}\n")
        return EXIT_USAGE
    except KVStoreError as e:
        err.write(f"kvstore: {e}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        err.write("kvstore: interrupted\n")
        return 130
    except BrokenPipeError:  # `kvstore inspect | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep the interpreter's final flush quiet
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
