"""CURVE authentication for tcp endpoints: key files, the allow-list, the daemon's and the client's keys.

::

    kvstore keygen --out DIR --name NAME   ->  DIR/NAME.key         Z85 public key (share it)
                                               DIR/NAME.key_secret  Z85 secret key (mode 0600)

    [server] curve_secret_key   = "DIR/server.key_secret"   (or the Z85 key itself)
    [server] curve_allowed_keys = "/etc/kvstore/clients"    lines "<Z85 public key> <tenant>"

    client DEALER ──CURVE handshake──► daemon ROUTER ──ZAP request──► ZapHandler (kvstore.daemon.zap; a thread)
                                            ◄── 200 + User-Id = tenant, or 400 (unknown key: no connection)

Every message on an authenticated connection carries its tenant as the
``User-Id`` property set by the ZAP reply, so the daemon reads the tenant from
the transport, never from a field the client wrote. The tenant ``*`` in the
allow-list marks an operator key: its connections are not confined to a tenant.

A key value (in config, in ``KVSTORE_CURVE_*`` or a client argument) that
names an existing file is read from that file; anything else must be the
40-character Z85 key itself. Secret key files must not be readable by group
or others, and the allow-list must not be writable by them (it grants access).
The ZAP handler only exists while the daemon serves; the router also enforces
the ZAP domain, so a missing handler refuses every client rather than letting
them all in.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

from kvstore.config_values import expand_home
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from kvstore.daemon.zap import ZapHandler

log = logging.getLogger("kvstore.daemon.auth")

ZAP_DOMAIN = b"kvstore"
OPERATOR = "*"  # allow-list tenant of keys whose connections span every tenant
KEY_CHARS = 40  # a 32-byte curve25519 key in Z85
KEY_SUFFIXES = (".key", ".key_secret")  # the files `kvstore keygen` writes
SECRET_MARK = "CURVE secret key"  # the comment above the key in a secret file keygen wrote
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
ENV_SERVER_KEY, ENV_SECRET_KEY, ENV_PUBLIC_KEY = (
    "KVSTORE_CURVE_SERVER_KEY",
    "KVSTORE_CURVE_SECRET_KEY",
    "KVSTORE_CURVE_PUBLIC_KEY",
)


# ---------------------------------------------------------------- keys and key files


def parse_key(text: str | bytes, what: str) -> bytes:
    """``text`` as a Z85 key (bytes); ConfigError naming ``what`` unless it is 40 Z85 characters of 32 bytes."""
    raw = text.encode(errors="replace") if isinstance(text, str) else bytes(text)  # not UTF-8: no key
    raw = raw.strip()
    try:
        ok = len(raw) == KEY_CHARS and len(z85.decode(raw)) == 32
    except Exception:  # z85 raises ValueError, KeyError or struct.error on garbage
        ok = False
    if not ok:
        raise ConfigError(
            f"{what} is not a CURVE key: expected {KEY_CHARS} Z85 characters (as written by "
            "`kvstore keygen`) or the path of a key file"
        )
    return raw


def _is_key(text: str) -> bool:
    try:
        parse_key(text, "")
    except ConfigError:
        return False
    return True


def _read_checked(path: Path, what: str) -> tuple[os.stat_result, str]:
    """(status, text) of the file ``path`` as one open file: what is checked is what is read (a file
    swapped between a check by path and a read by path would be read unchecked). ConfigError when it
    cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"{what} file {path} cannot be read: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{what} {path} is not a file (a directory?); give the path of a key file")
    with os.fdopen(fd, "rb") as f:
        try:
            return st, f.read(1 << 20).decode()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{what} file {path} cannot be read: {e}") from None


def check_private(path: Path, what: str, st: os.stat_result | None = None) -> None:
    """Raise ConfigError when the secret file ``path`` (whose status ``st`` is, when given) can be read
    by group or others (as ssh does)."""
    st = os.stat(path) if st is None else st
    mode = st.st_mode
    if mode & 0o077:
        raise ConfigError(
            f"{what} {path} has mode {oct(stat.S_IMODE(mode))}; others could read the secret key. "
            f"Run: chmod 600 {path}"
        )
    _check_owner(st, path, what, "read the secret key")


def load_key(value: str | bytes, what: str, *, secret: bool) -> bytes:
    """The Z85 key ``value`` holds: read from the file it names (checked private when ``secret``), else itself."""
    if isinstance(value, str) and value.strip() and os.path.exists(os.path.expanduser(value.strip())):
        path = Path(os.path.expanduser(value.strip()))
        if secret and path.name.endswith(".key"):  # keygen's public half: said so, not "chmod 600 it"
            raise ConfigError(
                f"{what} {path} is a public key file; give the secret one ({path.name}_secret, as "
                "`kvstore keygen` writes it)"
            )
        st, text = _read_checked(path, what)
        if secret:
            check_private(path, what, st)
        if not secret and SECRET_MARK in text:
            raise ConfigError(
                f"{what} {path} is a secret key file; give the public one (the same name without "
                "'_secret'), and keep the secret one to its owner"
            )
        # the key is the last line: keygen writes a comment above it, and a Z85 key may itself start with '#'
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return parse_key(lines[-1] if lines else "", f"{what} file {path}")
    if (
        isinstance(value, str)
        and not _is_key(value)
        and ("/" in value or value.strip().endswith(KEY_SUFFIXES))
    ):
        raise ConfigError(
            f"{what} {value.strip()} names no file (it does not exist); give the path of a key file "
            "(`kvstore keygen` writes them) or the 40-character key itself"
        )
    return parse_key(value, what)


@dataclass(frozen=True)
class KeyFiles:
    """Where ``write_keypair`` put a pair, and the public key (Z85 text)."""

    public_key: str
    public_file: Path
    secret_file: Path


def write_keypair(directory: Path, name: str, *, force: bool = False) -> KeyFiles:
    """Make a CURVE key pair: ``directory/name.key`` (public, 0644) and ``name.key_secret`` (0600).

    Creates ``directory`` (0700) if missing. Raises ConfigError when either
    file exists and ``force`` is not given, or for a name that is not a plain file name.
    """
    if not name or "/" in name or name.startswith(".") or name != name.strip() or "\x00" in name:
        raise ConfigError(f"key name {name!r} must be a plain file name like 'server' or 'client'")
    directory = expand_home(directory)
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # mkdir's mode goes through the umask
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    for f in (public_file, secret_file):
        if f.exists() and not force:
            raise ConfigError(f"{f} exists; choose another --name or pass --force to replace the pair")
    public, secret = zmq.curve_keypair()
    secret_file.unlink(missing_ok=True)
    fd = os.open(
        secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
    )  # never readable by others, not even briefly
    with os.fdopen(fd, "w") as out:
        out.write(f"# kvstore {SECRET_MARK} (the last line); never share it\n{secret.decode()}\n")
    public_file.write_text(f"{public.decode()}\n")
    return KeyFiles(public.decode(), public_file, secret_file)


# ---------------------------------------------------------------- the allow-list


def parse_allow_list(text: str, source: str) -> dict[bytes, str]:
    """Lines ``<Z85 public key> <tenant>`` (``#`` comments, blank lines) -> {public key: tenant}.

    Tenants are 1-64 characters of letters, digits and ``._@-``, or ``*`` for an
    operator key. A comment is a line whose first word starts with ``#`` and is
    not a key (Z85 keys may contain ``#``), or words after the tenant starting
    with ``#``. Raises ConfigError naming the line for anything else.
    """
    allowed: dict[bytes, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or (words[0].startswith("#") and not _is_key(words[0])):
            continue
        if len(words) > 2 and words[2].startswith("#"):
            words = words[:2]
        where = f"{source} line {n}"
        if len(words) != 2:
            raise ConfigError(f"{where}: expected '<Z85 public key> <tenant>', got {len(words)} word(s)")
        key = parse_key(words[0], f"{where}: the key")
        tenant = words[1]
        if tenant != OPERATOR and not TENANT_RE.fullmatch(tenant):
            raise ConfigError(
                f"{where}: tenant {tenant!r} must be 1-64 letters, digits or ._@- (or * for an operator key)"
            )
        if allowed.get(key, tenant) != tenant:
            raise ConfigError(f"{where}: key {key.decode()} is already listed for tenant {allowed[key]!r}")
        allowed[key] = tenant
    return allowed


def read_allow_list(path: Path) -> dict[bytes, str]:
    """The allow-list file at ``path``; ConfigError when missing, unreadable, malformed or writable by others."""
    st, text = _read_checked(path, "curve_allowed_keys")
    if st.st_mode & 0o022:
        raise ConfigError(
            f"curve_allowed_keys file {path} has mode {oct(stat.S_IMODE(st.st_mode))}; others could "
            f"grant themselves access. Run: chmod go-w {path}"
        )
    _check_owner(st, path, "curve_allowed_keys file", "grant themselves access")
    return parse_allow_list(text, str(path))


def _check_owner(st: os.stat_result, path: Path, what: str, risk: str) -> None:
    """ConfigError unless ``path`` belongs to this process's user or root: its owner could change its
    mode, and its contents, after the check."""
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(
            f"{what} {path} belongs to user {st.st_uid}, not to this daemon's user ({os.getuid()}) or "
            f"root; its owner could {risk}. Run: chown {os.getuid()} {path}"
        )


# ---------------------------------------------------------------- the daemon side


@dataclass(frozen=True)
class ServerAuth:
    """The daemon's CURVE identity and allow-list (``public_key``: what clients pass as the server key)."""

    secret_key: bytes
    public_key: bytes
    allowed: Mapping[bytes, str]

    @classmethod
    def from_config(
        cls, endpoint: str, secret_key: str | None, allowed_keys: str | None
    ) -> ServerAuth | None:
        """None when ``secret_key`` is unset; else the loaded keys. Raises ConfigError (fail closed) for a
        CURVE setting on a non-tcp endpoint, a missing allow-list, or any unreadable or malformed key."""
        if secret_key is None:
            if allowed_keys is not None:
                raise ConfigError(
                    "[server] curve_allowed_keys is set but curve_secret_key is not; set both "
                    "(see `kvstore keygen`) or neither"
                )
            return None
        if not endpoint.startswith("tcp://"):
            raise ConfigError(
                f"[server] curve_secret_key applies to tcp:// endpoints; {endpoint} is protected by "
                "its private directory instead. Remove the curve keys or serve tcp://"
            )
        if allowed_keys is None:
            raise ConfigError(
                "[server] curve_secret_key is set but curve_allowed_keys is not: no client could "
                "connect. Point it at a file of '<Z85 public key> <tenant>' lines"
            )
        secret = load_key(secret_key, "[server] curve_secret_key", secret=True)
        allowed = read_allow_list(expand_home(allowed_keys))
        if not allowed:
            log.warning("curve_allowed_keys %s lists no key: every client will be refused", allowed_keys)
        return cls(secret, zmq.curve_public(secret), allowed)

    def secure(self, router: zmq.Socket) -> None:
        """Make ``router`` a CURVE server whose every handshake goes through the ZAP handler (before bind)."""
        router.curve_secretkey = self.secret_key
        router.curve_publickey = self.public_key
        router.curve_server = True
        router.zap_domain = ZAP_DOMAIN
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler -> refuse, never admit everyone

    def handler(self) -> ZapHandler:
        """A ZAP handler for this allow-list (start it in the router's context before binding)."""
        from kvstore.daemon.zap import ZapHandler

        return ZapHandler(self.allowed)


# ---------------------------------------------------------------- the client side


@dataclass(frozen=True)
class ClientKeys:
    """A client's CURVE settings: the daemon's public key and the client's own pair (all Z85)."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes

    @classmethod
    def resolve(
        cls,
        endpoint: str,
        server_key: str | bytes | None = None,
        secret_key: str | bytes | None = None,
        public_key: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ClientKeys | None:
        """Keys from the arguments, else (tcp:// endpoints only) from ``KVSTORE_CURVE_SERVER_KEY``,
        ``KVSTORE_CURVE_SECRET_KEY`` and ``KVSTORE_CURVE_PUBLIC_KEY``; None when neither gives a server key.

        Each value is a Z85 key or the path of a key file. The public key is
        derived from the secret one when not given. Raises ConfigError for a
        server key without a secret key, a pair that does not match, or a bad key.
        """
        env = os.environ if env is None else env
        if server_key is None and secret_key is None and public_key is None and endpoint.startswith("tcp://"):
            server_key, secret_key = env.get(ENV_SERVER_KEY) or None, env.get(ENV_SECRET_KEY) or None
            public_key = env.get(ENV_PUBLIC_KEY) or None
            where = (ENV_SERVER_KEY, ENV_SECRET_KEY, ENV_PUBLIC_KEY)
        else:
            where = ("curve_server_key", "curve_secret_key", "curve_public_key")
        if server_key is None:
            if secret_key is not None or public_key is not None:
                raise ConfigError(f"{where[1]} is set without {where[0]}: give the daemon's public key too")
            return None
        if secret_key is None:
            raise ConfigError(
                f"{where[0]} is set without {where[1]}: give this client's secret key "
                "(make a pair with `kvstore keygen`)"
            )
        server = load_key(server_key, where[0], secret=False)
        secret = load_key(secret_key, where[1], secret=True)
        public = zmq.curve_public(secret)
        if public_key is not None and load_key(public_key, where[2], secret=False) != public:
            raise ConfigError(
                f"{where[2]} does not belong to {where[1]}; pass the pair `kvstore keygen` made"
            )
        return cls(server, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the daemon (before connect)."""
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
