"""Daemon configuration: frozen dataclasses loaded from TOML, overridden by ``KVSTORE_*`` variables.

Precedence (last wins)::

    built-in defaults  <  TOML file (--config, else $KVSTORE_CONFIG)  <  KVSTORE_<SECTION>_<KEY> variables

``KVSTORE_ENDPOINT`` is a shorthand for ``KVSTORE_SERVER_ENDPOINT``. Sizes read
``8GiB``, ``512MiB``, ``1.5GB``, ``64k`` or plain byte counts (K/M/G/T alone are
binary, as in systemd); durations read ``500ms``, ``30s``, ``2h``, ``7d``,
``1h30m`` or plain seconds. Relative paths resolve against the current working
directory when the config is loaded (the result is always absolute), but for a relative
``ipc://`` socket path in a file: it resolves against the file's directory, because the daemon
and the CLIs that read the same file run in different directories and must name one socket.

Every value is checked here, once: an invalid file raises ConfigError naming
the key, the value and what is allowed, and an unknown section or key (a typo)
is an error, never silently ignored. ``load_config`` reads files and the
environment only; it creates no directory (the server creates the runtime
directory 0700 and the data directory).

Every configuration key's default and check are here, one table per section, so that a key is
defined once; how one value is checked (a size, a duration, an endpoint ...) is config_values.py.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore import config_values as value
from kvstore.config_values import (
    PAGE_ALIGN,
    check_connect_endpoint,
    check_endpoint,
    ipc_socket_path,
    redact_url,
)
from kvstore.errors import ConfigError
from kvstore.store.writer import Admission
from kvstore.tiers.lmdb_env import Durability
from kvstore.units import parse_duration, parse_size

__all__ = [
    "Config",
    "HbmConfig",
    "NvmeConfig",
    "PolicyConfig",
    "RamConfig",
    "ServerConfig",
    "PAGE_ALIGN",
    "check_connect_endpoint",
    "check_endpoint",
    "default_data_dir",
    "default_endpoint",
    "ipc_socket_path",
    "load_config",
    "parse_duration",
    "parse_size",
    "redact_url",
    "runtime_dir",
    "settings",
    "with_overrides",
]

if TYPE_CHECKING:
    from kvstore.codecs import Codec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

_SECRET = "***"  # what a secret (a password, a CURVE secret key) shows as in logs, errors and to_dict
TTL_MOST = (36500 * 86400.0, "36500d")  # past it, "never" (a cluster's TTL in ms must fit 64 bits)
_FIDELITY = ("int4", "fp8", "int8", "raw")  # nvme codecs, from the one that keeps least


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory for the daemon's socket: ``$XDG_RUNTIME_DIR/kvstore``, else ``/tmp/kvstore-<uid>``.

    Only a path: the server creates it with mode 0700 so that only its user can reach the socket.
    """
    env = os.environ if env is None else env
    base = env.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "kvstore"
    return Path("/tmp") / f"kvstore-{os.getuid()}"


def default_endpoint(env: Mapping[str, str] | None = None) -> str:
    return f"ipc://{runtime_dir(env) / 'kvstore.sock'}"


def env_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The endpoint the environment names: ``KVSTORE_ENDPOINT`` or its long form
    ``KVSTORE_SERVER_ENDPOINT`` (None: neither). ConfigError when both are set and differ: the
    daemon, the CLI and clients would not agree on one socket."""
    env = os.environ if env is None else env
    short, full = env.get("KVSTORE_ENDPOINT") or None, env.get("KVSTORE_SERVER_ENDPOINT") or None  # "": unset
    if short is not None and full is not None and short != full:
        raise ConfigError(
            f"environment variables KVSTORE_ENDPOINT ({short!r}) and KVSTORE_SERVER_ENDPOINT "
            f"({full!r}) name different endpoints; set one of them"
        )
    return short if short is not None else full


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where LMDB lives when no ``[nvme] path`` is given: ``$XDG_DATA_HOME/kvstore`` (``~/.local/share/kvstore``)."""
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or str(Path(env.get("HOME") or Path.home()) / ".local" / "share")
    return Path(base) / "kvstore" / "nvme"


@dataclass(frozen=True)
class ServerConfig:
    endpoint: str = ""  # "" is replaced by default_endpoint() when loading
    workers: int = 4
    max_message_bytes: int = 512 * 2**20
    max_tokens_per_request: int = 131072
    max_inflight_per_client: int = 64
    # Memory held by requests received and not yet answered (a put's payload; a get's largest possible
    # reply), across all connections and per tenant; over it a request gets ``busy``. A request bigger
    # than a budget is still taken when nothing else is charged to it, so neither needs to exceed
    # max_message_bytes. kvstore.daemon.budget.
    max_inflight_bytes: int = 2 * 2**30
    max_inflight_bytes_per_tenant: int = 1 * 2**30
    max_queued_requests: int = 1024  # requests handed to workers and not yet answered, all clients
    # Per-tenant shares of the daemon's tables, so that one tenant cannot fill them for all
    # (the tenant: a CURVE connection's, else the one its hello names).
    max_namespaces_per_tenant: int = 256
    max_pins_per_tenant: int = 1024
    max_pinned_blocks_per_tenant: int = 65536
    allow_insecure_tcp: bool = False
    # tcp only (kvstore.daemon.auth): the daemon's Z85 secret key or the path of its key file (`kvstore keygen`).
    # Never shown (it may be the key itself): repr leaves it out, to_dict and config errors print ***.
    curve_secret_key: str | None = field(default=None, repr=False)
    curve_allowed_keys: str | None = (
        None  # a file path, lines "<Z85 client public key> <tenant>" (* = operator)
    )
    metrics_port: int | None = None  # serves on 127.0.0.1 only; None = off
    log_level: str = "info"
    # Same-host data plane (kvstore.shm): for an ipc:// endpoint, the pools live in shared memory that
    # clients of the daemon's user map read-only, and K/V never crosses the socket. "off": socket only.
    shared_memory: str = "auto"
    shm_dir: Path | None = None  # None: /dev/shm/kvstore-<uid>
    shm_staging: int = 1 * 2**30  # staging for puts and for blocks read from nvme, all clients
    shm_staging_per_client: int = 64 * 2**20  # one client's segment, made on its first need


@dataclass(frozen=True)
class HbmConfig:
    device: str = "auto"  # "auto" = cuda:0 when CUDA is present, else cpu
    capacity: int = 2 * 2**30

    def resolved_device(self) -> str:
        """The device the pool goes on: ``device`` with ``"auto"`` decided now (imports torch)."""
        if self.device != "auto":
            return "cuda:0" if self.device == "cuda" else self.device
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class RamConfig:
    capacity: int = 4 * 2**30
    codec: str = "fp8"
    pin_memory: bool | None = None  # None ("auto") = when CUDA is present


@dataclass(frozen=True)
class NvmeConfig:
    path: Path = field(default_factory=default_data_dir)
    capacity: int = 64 * 2**30
    codec: str = "int4"
    zstd: int = 3  # zstd level on top of the codec; 0 = off
    # int4 only: Hadamard-rotate the head dimension (with head_codec, lower KL). Ignored for the other
    # codecs, so switching ``codec`` alone never turns a valid config into an invalid one.
    rotate: bool = True
    # The first ``head_blocks`` blocks of every prefix (the attention sink's) are stored with
    # ``head_codec`` instead; None = off. int4 loses most on the sink's K (see codecs/int4.py).
    head_codec: str | None = "int8"
    head_blocks: int = 1

    def codecs(self) -> tuple[Codec, Codec | None]:
        """The tier codec and the head codec these settings describe (imports torch).

        The head codec is None (off) when ``head_codec`` is "none", ``head_blocks`` is 0, or it
        keeps no more than ``codec`` does (int4 < fp8 < int8 < raw): the head blocks are there
        to be kept better, so with ``codec = "raw"`` every block stays lossless. ``rotate`` is
        passed to int4 only; every other codec ignores it.
        """
        from kvstore.codecs import get_codec

        params: dict[str, Any] = {"rotate": self.rotate} if self.codec == "int4" else {}
        better = self.head_codec is not None and _FIDELITY.index(self.head_codec) > _FIDELITY.index(
            self.codec
        )
        head = None
        if better and self.head_blocks and self.head_codec is not None:
            head = get_codec(self.head_codec, zstd=self.zstd)
        return get_codec(self.codec, zstd=self.zstd, **params), head

    write_through: bool = True
    admit: str = Admission.ALWAYS.value  # see kvstore.store.writer.Admission
    ttl: float = 7 * 86400.0  # math.inf = never expire
    durability: str = Durability.BALANCED.value  # see kvstore.tiers.lmdb_env.Durability
    enabled: bool = True


@dataclass(frozen=True)
class ClusterConfig:
    """The shared tier below nvme on a Redis Cluster or Valkey (kvstore.tiers.cluster); off by default."""

    enabled: bool = False
    nodes: tuple[str, ...] = ()  # seed nodes: "redis://host:port" (or rediss:// for TLS)
    username: str | None = None  # the ACL user; None: the default user
    password: str | None = field(default=None, repr=False)
    password_env: str | None = None  # read the password from this environment variable instead
    codec: str | None = None  # None: the nvme codecs (int4 + zstd, the head blocks at head_codec)
    zstd: int | None = None  # zstd level on top of the codec, 0 = off; None: the nvme level
    ttl: float | None = None  # None: the nvme ttl
    timeout: float = 0.5  # every call to the cluster, connecting included
    retry_after: float = 5.0  # after a failure, calls go to the local tiers only for this long
    write_queue: int = 1024  # blocks waiting to be written; more are dropped (and counted)
    prefix: str = "kvstore"  # of every key kvstore writes in the cluster
    tls_ca_file: Path | None = None  # rediss:// nodes: the CA of their certificates (None: the system's)
    tls_cert_file: Path | None = None  # this host's client certificate, when the nodes ask for one
    tls_key_file: Path | None = None
    required: bool = False  # refuse to start when the cluster cannot be used (default: start local-only)

    def __repr__(self) -> str:  # a node URL may carry the password: never in a log or a traceback
        shown = (
            f"{f.name}={tuple(redact_url(n) for n in self.nodes)!r}"
            if f.name == "nodes"
            else f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr
        )
        return f"ClusterConfig({', '.join(shown)})"

    def resolved_password(self, env: Mapping[str, str] | None = None) -> str | None:
        """The password: ``password``, else the variable ``password_env`` names (ConfigError when unset)."""
        if self.password is not None or self.password_env is None:
            return self.password
        secret = (os.environ if env is None else env).get(self.password_env)
        if secret is None:
            raise ConfigError(
                f"[cluster] password_env = {self.password_env!r}, but that environment variable is not set"
            )
        return secret

    def codecs(self, nvme: NvmeConfig) -> tuple[Codec, Codec | None]:
        """The codec and head codec of cluster frames: nvme's, or ``codec`` with nvme's head; zstd at
        ``zstd`` (default: nvme's level)."""
        return replace(
            nvme,
            codec=nvme.codec if self.codec is None else self.codec,
            zstd=nvme.zstd if self.zstd is None else self.zstd,
        ).codecs()


@dataclass(frozen=True)
class PolicyConfig:
    promote_on_hit: bool = True
    pin_lease: float = 30.0
    write_queue: int = 1024  # blocks waiting for write-through
    page_bytes: int = 65536


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    ram: RamConfig = field(default_factory=RamConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    source: Path | None = None  # the TOML file read, if any

    def to_dict(self) -> dict[str, Any]:
        """Plain values (paths as strings), e.g. for logs and ``--json``."""
        d = asdict(self)
        d["nvme"]["path"] = str(self.nvme.path)
        d["source"] = None if self.source is None else str(self.source)
        s = d["server"]  # never a secret in a log or on a screen
        s["curve_secret_key"] = None if s["curve_secret_key"] is None else _SECRET
        s["shm_dir"] = None if s["shm_dir"] is None else str(s["shm_dir"])
        c = d["cluster"]
        c["password"] = None if c["password"] is None else _SECRET
        for k in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            c[k] = None if c[k] is None else str(c[k])
        c["nodes"] = [redact_url(n) for n in c["nodes"]]
        return d


def _shown(section: str, key: str, raw: Any) -> str:
    """``raw`` as a config error may show it: never a [cluster] password, alone or in a node URL, nor
    a [server] curve_secret_key."""
    if (section, key) in (("cluster", "password"), ("server", "curve_secret_key")):
        return _SECRET
    if section == "cluster" and key == "nodes":
        items = raw.split(",") if isinstance(raw, str) else raw
        if isinstance(items, (list, tuple)):
            return repr([redact_url(i) if isinstance(i, str) else i for i in items])
    return repr(raw)


_CHECKS: dict[str, tuple[type, dict[str, Callable[[Any], Any]]]] = {
    "server": (
        ServerConfig,
        {
            "endpoint": value.endpoint,
            "workers": value.integer(1, 256),
            "max_message_bytes": value.size(4096),
            "max_tokens_per_request": value.integer(1, 2**31),
            "max_inflight_per_client": value.integer(1, 65536),
            "max_inflight_bytes": value.size(4096),
            "max_inflight_bytes_per_tenant": value.size(4096),
            "max_queued_requests": value.integer(1, 2**20),
            "max_namespaces_per_tenant": value.integer(1, 4096),
            "max_pins_per_tenant": value.integer(1, 4096),
            "max_pinned_blocks_per_tenant": value.integer(1, 1 << 18),
            "allow_insecure_tcp": value.boolean,
            "curve_secret_key": value.optional(value.text),
            "curve_allowed_keys": value.optional(value.text),
            "metrics_port": value.optional(value.integer(1, 65535), 0),
            "log_level": value.choice("debug", "info", "warning", "error", "critical"),
            "shared_memory": value.choice("auto", "off"),
            "shm_dir": value.optional(value.path),
            "shm_staging": value.size(1 << 16),
            "shm_staging_per_client": value.size(1 << 16),
        },
    ),
    "hbm": (HbmConfig, {"device": value.device, "capacity": value.size(1)}),
    "ram": (
        RamConfig,
        {"capacity": value.size(1), "codec": value.choice("fp8", "int8", "raw"), "pin_memory": value.pin},
    ),
    "nvme": (
        NvmeConfig,
        {
            "path": value.path,
            "capacity": value.size(1 << 20),
            "codec": value.choice("int4", "int8", "fp8", "raw"),
            "zstd": value.integer(0, 22),
            "rotate": value.boolean,
            "head_codec": value.optional(value.choice("int8", "fp8", "raw", "int4", "none")),
            "head_blocks": value.integer(0, 65536),
            "write_through": value.boolean,
            "admit": value.choice(*Admission),
            "ttl": value.duration(never=True, most=TTL_MOST),
            "durability": value.choice(*Durability),
            "enabled": value.boolean,
        },
    ),
    "cluster": (
        ClusterConfig,
        {
            "enabled": value.boolean,
            "nodes": value.nodes,
            "username": value.optional(value.text),
            "password": value.optional(value.text),
            "password_env": value.optional(value.text),
            "codec": value.optional(value.choice("int4", "int8", "fp8", "raw")),
            "zstd": value.optional(value.integer(0, 22)),
            "ttl": value.optional(value.duration(never=True, most=TTL_MOST)),
            "timeout": value.duration(never=False, most=(3600.0, "1h")),
            "retry_after": value.duration(never=False, most=(86400.0, "1d")),
            "write_queue": value.integer(1, 2**24),
            "prefix": value.key_prefix,
            "required": value.boolean,
            "tls_ca_file": value.optional(value.path),
            "tls_cert_file": value.optional(value.path),
            "tls_key_file": value.optional(value.path),
        },
    ),
    "policy": (
        PolicyConfig,
        {
            "promote_on_hit": value.boolean,
            "pin_lease": value.duration(never=False, most=(86400.0, "1d")),
            "write_queue": value.integer(1, 2**24),
            "page_bytes": value.page_size,
        },
    ),
}


def settings() -> dict[str, tuple[str, ...]]:
    """Every key ``load_config`` accepts, by section (what a TOML file or KVSTORE_* may set)."""
    return {section: tuple(checks) for section, (_, checks) in _CHECKS.items()}


def _suggest(name: str, options: list[str], prefix: str = "") -> str:
    """A close match of ``name`` among ``options``; ``prefix``: one they all share (an environment
    variable's KVSTORE_SECTION_), left out of the comparison, where it would make any two look alike."""
    close = difflib.get_close_matches(
        name.removeprefix(prefix), [o.removeprefix(prefix) for o in options], n=1
    )
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def _apply(
    values: dict[str, dict[str, Any]], section: str, key: str, raw: Any, where: str, base: Path | None = None
) -> None:
    """Check ``raw`` into ``values``; a relative ipc:// endpoint resolves against ``base`` (default: the cwd)."""
    check = _CHECKS[section][1][key]
    try:
        values[section][key] = check(raw)
        if (section, key) == ("server", "endpoint"):
            values[section][key] = value.absolute_endpoint(values[section][key], base or Path.cwd())
    except value.Invalid as e:
        raise ConfigError(
            f"{where}: [{section}] {key} = {_shown(section, key, raw)} is not allowed; expected {e}"
        ) from None


def _read_file(path: Path, values: dict[str, dict[str, Any]], named_by: str) -> None:
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; give an existing file to {named_by}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not valid TOML: not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    for section, table in doc.items():
        if section not in _CHECKS and not isinstance(table, dict):  # a key before any [section]
            homes = [f"[{s}]" for s, (_, checks) in _CHECKS.items() if section in checks]
            where = (
                f"it belongs under {' or '.join(homes)}" if homes else f"sections are {', '.join(_CHECKS)}"
            )
            raise ConfigError(f"{path}: {section!r} is set outside any section; {where}")
        if section not in _CHECKS:
            hint = _suggest(section, list(_CHECKS))
            raise ConfigError(f"{path}: unknown section [{section}]{hint}; sections are {', '.join(_CHECKS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}]), got {table!r}")
        for key, raw in table.items():
            if key not in _CHECKS[section][1]:
                keys = list(_CHECKS[section][1])
                raise ConfigError(
                    f"{path}: unknown key {key!r} in [{section}]{_suggest(key, keys)}; "
                    f"allowed: {', '.join(keys)}"
                )
            _apply(values, section, key, raw, str(path), base=path.parent)


def _read_env(env: Mapping[str, str], values: dict[str, dict[str, Any]]) -> None:
    """Apply ``KVSTORE_<SECTION>_<KEY>``; other ``KVSTORE_*`` names (KVSTORE_VENV, ...) belong to others."""
    overrides = []
    env_endpoint(env)  # ConfigError when KVSTORE_ENDPOINT and KVSTORE_SERVER_ENDPOINT differ
    if env.get("KVSTORE_ENDPOINT"):
        overrides.append(("KVSTORE_ENDPOINT", "server", "endpoint"))
    for name in sorted(env):
        for section, (_, checks) in _CHECKS.items():
            prefix = f"KVSTORE_{section.upper()}_"
            if not name.startswith(prefix):
                continue
            key = name[len(prefix) :].lower()
            if key not in checks:
                known = [f"{prefix}{k.upper()}" for k in checks]
                raise ConfigError(
                    f"environment variable {name} is not a setting{_suggest(name, known, prefix)}; "
                    f"[{section}] settings: {', '.join(known)}"
                )
            overrides.append((name, section, key))
    for name, section, key in overrides:
        _apply(values, section, key, env[name], f"environment {name}")


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the TOML file (``path``, else ``$KVSTORE_CONFIG``), then ``KVSTORE_*`` overrides.

    ``env`` defaults to ``os.environ``. Reads only; creates nothing. Raises
    ConfigError naming the key, the value and what is allowed.
    """
    env = os.environ if env is None else env
    named_by = "--config"
    if path is None and env.get("KVSTORE_CONFIG"):
        path, named_by = env["KVSTORE_CONFIG"], "KVSTORE_CONFIG (the environment)"
    values: dict[str, dict[str, Any]] = {s: {} for s in _CHECKS}
    source = None
    if path is not None:
        source = value.expand_home(path).absolute()
        _read_file(source, values, named_by)
    _read_env(env, values)
    cluster = values["cluster"]
    if cluster.get("password") is not None and cluster.get("password_env") is not None:
        raise ConfigError(
            "[cluster] password and password_env are both set: give the password, or the name of the "
            "environment variable that holds it, not both"
        )
    values["server"].setdefault("endpoint", default_endpoint(env))
    values["nvme"].setdefault("path", default_data_dir(env))
    sections = {s: cls(**values[s]) for s, (cls, _) in _CHECKS.items()}
    return Config(source=source, **sections)


def check_pools(config: Config) -> None:
    """ConfigError unless the hbm and ram pools each hold a page at least (with none, every block
    would skip the tier)."""
    page = config.policy.page_bytes
    for name, capacity in (("hbm", config.hbm.capacity), ("ram", config.ram.capacity)):
        if capacity < page:
            raise ConfigError(
                f"[{name}] capacity = {capacity} bytes is less than one page ([policy] page_bytes = "
                f"{page}); give the tier at least one page (a block takes several)"
            )


def with_overrides(config: Config, section: str, **changes: Any) -> Config:
    """A copy of ``config`` with ``[section]`` keys changed, checked like file values (tests, CLI flags)."""
    if section not in _CHECKS:
        raise ConfigError(f"unknown section [{section}]; sections are {', '.join(_CHECKS)}")
    values: dict[str, dict[str, Any]] = {section: {}}
    names = {f.name for f in fields(_CHECKS[section][0])}
    for key, raw in changes.items():
        if key not in names:
            raise ConfigError(f"unknown key {key!r} in [{section}]{_suggest(key, sorted(names))}")
        _apply(values, section, key, raw, "override")
    changed = replace(getattr(config, section), **values[section])
    return replace(config, **{section: changed})
