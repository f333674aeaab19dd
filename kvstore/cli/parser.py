"""The ``kvstore`` command line: its parser, argument types and usage errors (no I/O but reading a
tokens file). ``commands.py`` runs what it parses."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from kvstore.config import check_connect_endpoint, check_endpoint, parse_duration
from kvstore.errors import ConfigError, KVStoreError
from kvstore.tiers.base import TierName

TIERS = tuple(t.value for t in TierName)
PREFETCH_CHUNK = 16  # blocks per prefetch request: small enough for a smooth bar, big enough to stay cheap
# --chunk's ceiling: more blocks than any session has (one request takes the whole session), and small
# enough that start_block + chunk always travels in msgpack (a 10**20 chunk was an OverflowError)
PREFETCH_CHUNK_MAX = 2**31 - 1
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
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive and finite")
    return seconds


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


def _chunk_arg(text: str) -> int:
    n = _positive_int(text)
    if n > PREFETCH_CHUNK_MAX:
        raise argparse.ArgumentTypeError(
            f"{n} is over {PREFETCH_CHUNK_MAX}, the most it takes; any chunk longer than the session "
            "brings the whole session up in one request"
        )
    return n


# demo: SmolLM2-135M reads 8192 positions; the document, four turns' questions and answers must fit
DEMO_DOCUMENT_MAX, DEMO_ANSWER_MAX = 6144, 256


def _at_most(limit: int, why: str) -> Callable[[str], int]:
    def check(text: str) -> int:
        n = _positive_int(text)
        if n > limit:
            raise argparse.ArgumentTypeError(f"{n} is over {limit}, the most it takes: {why}")
        return n

    return check


def _namespace_arg(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{16}", text.strip()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace id: 16 hex digits, as `kvstore inspect` shows them"
        )
    return text.strip().lower()


def _nonempty_arg(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


MAX_SESSION_BYTES = 200  # kvstore.store.sessions.MAX_SESSION_BYTES, not imported: it pulls in torch


def _session_arg(text: str) -> str:
    n = len(text.encode("utf-8", errors="surrogatepass"))
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    if n > MAX_SESSION_BYTES:
        raise argparse.ArgumentTypeError(
            f"a session name is at most {MAX_SESSION_BYTES} bytes (UTF-8); this one is {n}"
        )
    if any(c in text for c in "\x00\n\r"):
        raise argparse.ArgumentTypeError("a session name holds no NUL or line break")
    return text


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
        if name in fields:  # L=30,...,L=32 (or L= and num_layers=): which one was meant is a guess
            raise argparse.ArgumentTypeError(f"layout {name} is given twice in {text!r}; give it once")
        fields[name] = value.strip() if name == "dtype" else _int_field(name, value)
    try:
        return KVLayout.from_dict(fields)
    except KVStoreError as e:  # it names the long field names: say which short ones they are
        short = ", ".join(f"{k}={v}" for k, v in _LAYOUT_ALIASES.items())
        raise argparse.ArgumentTypeError(f"{e} ({short})") from None


def _int_field(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {name} must be an integer, got {value!r}") from None


MAX_TOKEN_ID = 2**32 - 1  # kvstore.keys.MAX_TOKEN_ID, not imported: kvstore.keys pulls in torch


def read_tokens(path: str, stdin: IO[str] | None = None) -> list[int]:
    """Token ids from a file (``-`` = stdin): a JSON list, or integers separated by spaces, commas or newlines."""
    source = stdin or sys.stdin
    if path == "-" and source is None:  # started with fd 0 closed
        raise UsageError("--tokens - reads standard input, and it is closed")
    try:
        text = source.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read tokens from {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not text (token ids as a JSON list or separated by spaces)") from None
    try:
        data = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [int(t) for t in text.replace(",", " ").split()]
        )
    except (ValueError, RecursionError) as e:  # RecursionError: lists nested thousands deep
        raise UsageError(
            f"{path} must hold token ids: a JSON list or integers separated by spaces ({e})"
        ) from None
    if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in data):
        raise UsageError(f"{path} must hold a flat list of integer token ids")
    bad = next((t for t in data if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise UsageError(f"{path}: token id {bad} is out of range (0 to {MAX_TOKEN_ID})")
    return data


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument(
        "--endpoint",
        type=_endpoint_arg,
        help="daemon endpoint (default: $KVSTORE_ENDPOINT or $KVSTORE_SERVER_ENDPOINT, "
        "else the config's [server] endpoint)",
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
    from kvstore import __version__

    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
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
    p.add_argument("--session", type=_session_arg, help="show this session's blocks")
    p.add_argument(
        "--tokens", metavar="FILE", help="token ids (JSON list or whitespace separated; - = stdin)"
    )
    p.add_argument("--model", type=_nonempty_arg, help="model id of --tokens")
    p.add_argument(
        "--layout",
        type=parse_layout,
        metavar="SPEC",
        help="layout of --tokens, e.g. L=30,H=3,D=64,dtype=bfloat16,T=64",
    )
    p.add_argument("--tenant", type=_nonempty_arg, help="tenant of --tokens (default: default)")
    p.add_argument("--revision", help="model revision of --tokens")
    p.set_defaults(parser=p)

    p = sub.add_parser(
        "evict",
        parents=[ops],
        allow_abbrev=False,
        help="drop (or move down) blocks",
        description="Evict the blocks every given filter selects (filters combine with AND). "
        "With --tier the blocks in that tier move down one tier instead of going away (from the "
        "last tier, nvme, they are dropped with the blocks after them).",
    )
    p.add_argument("--session", type=_session_arg, help="blocks of this session (and no other)")
    p.add_argument(
        "--older-than", type=_duration_arg, metavar="DURATION", help="blocks unused this long, e.g. 2d"
    )
    p.add_argument(
        "--tier",
        choices=(*TIERS, "cluster"),
        help="blocks held in this tier move down one tier (nvme: they are dropped; cluster: the cluster's "
        "copies are deleted)",
    )
    p.add_argument("--model", type=_nonempty_arg, help="blocks of this model id")
    p.add_argument("--tenant", type=_nonempty_arg, help="blocks of this tenant")
    p.add_argument(
        "--namespace", type=_namespace_arg, metavar="ID", help="blocks of this namespace id (see inspect)"
    )
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
    p.add_argument("--session", type=_session_arg, required=True, help="the session to warm up")
    p.add_argument(
        "--to",
        choices=(TierName.RAM.value, TierName.HBM.value),
        default=TierName.RAM.value,
        help="target tier (default ram)",
    )
    p.add_argument(
        "--chunk",
        type=_chunk_arg,
        default=PREFETCH_CHUNK,
        metavar="N",
        help=f"blocks per request, 1 to {PREFETCH_CHUNK_MAX} (default {PREFETCH_CHUNK})",
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
    p.add_argument(
        "--session", type=_session_arg, default="demo", help="session tag of the conversation (default: demo)"
    )
    p.add_argument(
        "--tenant",
        type=_nonempty_arg,
        default="default",
        help="tenant of the conversation (default: default)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_at_most(DEMO_ANSWER_MAX, "the conversation must fit the model's 8192 positions"),
        default=48,
        metavar="N",
        help=f"answer length cap (default 48, at most {DEMO_ANSWER_MAX})",
    )
    p.add_argument(
        "--document-tokens",
        type=_at_most(DEMO_DOCUMENT_MAX, "the conversation must fit the model's 8192 positions"),
        default=1024,
        metavar="N",
        help=f"tokens of the document handed over in turn 1 (default 1024, at most {DEMO_DOCUMENT_MAX})",
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


# arguments that reach the daemon (or ZeroMQ) as text
_SENT_AS_TEXT = ("endpoint", "session", "model", "tenant", "namespace", "revision")


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check; usage errors exit 2 with a message naming the flag."""
    args, extra = build_parser().parse_known_args(argv)
    parser = args.parser  # the subcommand's, so messages show its usage
    if extra:
        known = [o for a in parser._actions for o in a.option_strings]
        close = difflib.get_close_matches(extra[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    for name in _SENT_AS_TEXT:  # bytes that are no UTF-8 (a shell's $'\xff'); file paths may be any
        text = getattr(args, name, None)
        if isinstance(text, str) and not _utf8(text):
            parser.error(f"argument --{name.replace('_', '-')}: {text!r} is not valid UTF-8 text")
    if args.command != "serve" and getattr(args, "endpoint", None):
        try:  # serve listens there; every other command connects
            check_connect_endpoint(args.endpoint)
        except ConfigError as e:
            parser.error(f"argument --endpoint: {e}")
    if args.command == "inspect":
        if args.tokens is not None and (args.model is None or args.layout is None):
            parser.error(
                "inspect --tokens needs --model and --layout (the namespace the tokens were stored under)"
            )
        given = [f"--{f}" for f in ("model", "layout", "tenant", "revision") if getattr(args, f) is not None]
        if args.tokens is None and given:
            parser.error(
                f"inspect: {' and '.join(given)} only go{'es' if len(given) == 1 else ''} with --tokens"
            )
        args.tenant = "default" if args.tenant is None else args.tenant
        args.revision = "" if args.revision is None else args.revision
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
