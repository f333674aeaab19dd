"""kvstore.config: defaults, TOML files, KVSTORE_* overrides, and errors that name the key.

Many short stories, one per configuration rule.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from kvstore.config import (
    Config,
    default_endpoint,
    ipc_socket_path,
    load_config,
    runtime_dir,
    with_overrides,
)
from kvstore.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvstore.toml"
    p.write_text(text)
    return p


# ---- defaults ----


def test_defaults_without_file_or_environment(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_DATA_HOME": str(tmp_path / "share")}
    c = load_config(env=env)
    assert c.source is None
    # the socket lives in a per-user directory; load_config creates nothing
    assert c.server.endpoint == f"ipc://{tmp_path}/run/kvstore/kvstore.sock"
    assert not (tmp_path / "run").exists()
    assert c.nvme.path == tmp_path / "share" / "kvstore" / "nvme"
    assert c.hbm.device == "auto" and c.ram.codec == "fp8"
    assert (c.nvme.codec, c.nvme.zstd, c.nvme.write_through) == ("int4", 3, True)
    assert c.nvme.ttl == 7 * 86400 and c.policy.pin_lease == 30.0
    assert c.ram.pin_memory is None and c.server.metrics_port is None
    assert c.server.allow_insecure_tcp is False


def test_runtime_dir_falls_back_to_a_per_uid_tmp_dir() -> None:
    assert runtime_dir({}) == Path(f"/tmp/kvstore-{os.getuid()}")
    assert default_endpoint({}) == f"ipc:///tmp/kvstore-{os.getuid()}/kvstore.sock"
    assert ipc_socket_path(default_endpoint({})) == Path(f"/tmp/kvstore-{os.getuid()}/kvstore.sock")
    assert ipc_socket_path("tcp://127.0.0.1:5555") is None


def test_data_dir_falls_back_to_home_local_share(tmp_path: Path) -> None:
    c = load_config(env={"HOME": str(tmp_path)})
    assert c.nvme.path == tmp_path / ".local" / "share" / "kvstore" / "nvme"


def test_hbm_auto_resolves_to_cpu_without_cuda() -> None:
    import torch

    c = load_config(env={})
    assert c.hbm.resolved_device() == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert with_overrides(c, "hbm", device="cuda").hbm.resolved_device() == "cuda:0"
    assert with_overrides(c, "hbm", device="cpu").hbm.resolved_device() == "cpu"


# ---- shipped files ----


@pytest.mark.parametrize("name", ["default.toml", "gpu.toml", "laptop.toml"])
def test_shipped_configs_load(name: str) -> None:
    c = load_config(CONFIGS / name, env={})
    assert c.source == CONFIGS / name
    assert c.nvme.path.is_absolute()


def test_default_toml_fits_a_cpu_only_24gib_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    c = load_config(CONFIGS / "default.toml", env={})
    assert c.hbm.device == "auto"
    assert c.hbm.capacity + c.ram.capacity <= 8 * 2**30
    # a relative path resolves against the working directory at load time
    assert c.nvme.path == tmp_path / "data" / "nvme"
    # the file states the defaults: loading it or nothing gives the same tiers
    bare = load_config(env={})
    assert (c.hbm, c.ram, c.policy) == (bare.hbm, bare.ram, bare.policy)


# ---- every key from a file ----

FULL = """
[server]
endpoint = "tcp://0.0.0.0:5555"
workers = 8
max_message_bytes = "64MiB"
max_tokens_per_request = 4096
max_inflight_per_client = 3
allow_insecure_tcp = true
curve_secret_key = "secret"
curve_allowed_keys = "/etc/kvstore/clients"
metrics_port = 9464
log_level = "DEBUG"

[hbm]
device = "cuda:1"
capacity = "1GiB"

[ram]
capacity = 3000000
codec = "int8"
pin_memory = false

[nvme]
path = "store"
capacity = "10GB"
codec = "raw"
zstd = 0
rotate = false
head_codec = "fp8"
head_blocks = 2
write_through = false
admit = "second_use"
ttl = "2h"
durability = "safe"
enabled = false

[policy]
promote_on_hit = false
pin_lease = "500ms"
write_queue = 7
page_bytes = "4KiB"
"""


def test_every_key_is_read_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    c = load_config(write(tmp_path, FULL), env={})
    s = c.server
    assert (s.endpoint, s.workers, s.max_message_bytes, s.max_tokens_per_request) == (
        "tcp://0.0.0.0:5555",
        8,
        64 * 2**20,
        4096,
    )
    assert (s.max_inflight_per_client, s.allow_insecure_tcp, s.curve_secret_key, s.curve_allowed_keys) == (
        3,
        True,
        "secret",
        "/etc/kvstore/clients",
    )
    assert (s.metrics_port, s.log_level) == (9464, "debug")
    assert (c.hbm.device, c.hbm.capacity) == ("cuda:1", 2**30)
    assert (c.ram.capacity, c.ram.codec, c.ram.pin_memory) == (3_000_000, "int8", False)
    n = c.nvme
    assert (n.path, n.capacity, n.codec, n.zstd, n.write_through) == (
        tmp_path / "store",
        10**10,
        "raw",
        0,
        False,
    )
    assert (n.admit, n.ttl, n.durability, n.enabled) == ("second_use", 7200.0, "safe", False)
    assert (n.rotate, n.head_codec, n.head_blocks) == (False, "fp8", 2)
    p = c.policy
    assert (p.promote_on_hit, p.pin_lease, p.write_queue, p.page_bytes) == (False, 0.5, 7, 4096)


def test_config_is_frozen_and_serializable(tmp_path: Path) -> None:
    c = load_config(write(tmp_path, FULL), env={})
    with pytest.raises(AttributeError):
        c.hbm.capacity = 1  # type: ignore[misc]
    d = c.to_dict()
    assert d["nvme"]["path"] == str(c.nvme.path) and d["source"] == str(tmp_path / "kvstore.toml")
    assert d["policy"]["pin_lease"] == 0.5


def test_ttl_never_and_pin_memory_auto(tmp_path: Path) -> None:
    c = load_config(write(tmp_path, '[nvme]\nttl = "never"\n[ram]\npin_memory = "auto"\n'), env={})
    assert c.nvme.ttl == math.inf and c.ram.pin_memory is None
    c = load_config(write(tmp_path, "[nvme]\nttl = 60\n[server]\nmetrics_port = 0\n"), env={})
    assert c.nvme.ttl == 60.0 and c.server.metrics_port is None


def test_home_is_expanded_in_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    c = load_config(write(tmp_path, '[nvme]\npath = "~/kv"\n'), env={})
    assert c.nvme.path == tmp_path / "kv"


# ---- environment overrides ----


def test_env_overrides_single_keys_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[ram]\ncapacity = "4GiB"\ncodec = "int8"\n')
    env = {
        "KVSTORE_RAM_CAPACITY": "2GiB",
        "KVSTORE_NVME_PATH": str(tmp_path / "elsewhere"),
        "KVSTORE_SERVER_ENDPOINT": "ipc:///tmp/x.sock",
        "KVSTORE_NVME_WRITE_THROUGH": "off",
        "KVSTORE_POLICY_PIN_LEASE": "2m",
        "KVSTORE_HBM_DEVICE": "cpu",
        "KVSTORE_SERVER_WORKERS": "2",
        "KVSTORE_RAM_PIN_MEMORY": "yes",
        "KVSTORE_SERVER_METRICS_PORT": "",
        "KVSTORE_VENV": ".venv",  # not a setting prefix: belongs to ./dev, ignored
    }
    c = load_config(path, env=env)
    assert c.ram.capacity == 2 * 2**30 and c.ram.codec == "int8"  # only the overridden key changes
    assert c.nvme.path == tmp_path / "elsewhere"
    assert c.server.endpoint == "ipc:///tmp/x.sock"
    assert c.nvme.write_through is False and c.policy.pin_lease == 120.0
    assert (c.hbm.device, c.server.workers, c.ram.pin_memory, c.server.metrics_port) == ("cpu", 2, True, None)


def test_endpoint_shorthand_and_precedence() -> None:
    assert (
        load_config(env={"KVSTORE_ENDPOINT": "tcp://127.0.0.1:7000"}).server.endpoint
        == "tcp://127.0.0.1:7000"
    )
    full = {"KVSTORE_SERVER_ENDPOINT": "tcp://127.0.0.1:7001"}
    assert load_config(env=full).server.endpoint == "tcp://127.0.0.1:7001"
    same = {**full, "KVSTORE_ENDPOINT": "tcp://127.0.0.1:7001"}
    assert load_config(env=same).server.endpoint == "tcp://127.0.0.1:7001"
    assert (
        load_config(env={**full, "KVSTORE_ENDPOINT": ""}).server.endpoint == "tcp://127.0.0.1:7001"
    )  # "": unset
    # two endpoints: the CLI and a client in the same environment would talk to different sockets
    with pytest.raises(ConfigError, match="KVSTORE_ENDPOINT .* KVSTORE_SERVER_ENDPOINT .* set one"):
        load_config(env={**full, "KVSTORE_ENDPOINT": "tcp://127.0.0.1:7000"})


def test_a_client_reads_the_endpoint_either_variable_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.client import KVStoreClient

    monkeypatch.delenv("KVSTORE_ENDPOINT", raising=False)
    monkeypatch.setenv("KVSTORE_SERVER_ENDPOINT", "tcp://127.0.0.1:7001")
    with KVStoreClient(timeout=0.1) as c:
        assert c.endpoint == "tcp://127.0.0.1:7001"
    monkeypatch.setenv("KVSTORE_ENDPOINT", "tcp://127.0.0.1:7000")
    with pytest.raises(ConfigError, match="name different endpoints"):
        KVStoreClient(timeout=0.1)


def test_kvstore_config_variable_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nworkers = 3\n")
    assert load_config(env={"KVSTORE_CONFIG": str(path)}).server.workers == 3
    # an explicit path beats the variable
    other = tmp_path / "other.toml"
    other.write_text("[server]\nworkers = 5\n")
    assert load_config(other, env={"KVSTORE_CONFIG": str(path)}).server.workers == 5


def test_env_uses_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_RAM_CODEC", "raw")
    assert load_config().ram.codec == "raw"


# ---- errors name the key, the value and what is allowed ----


@pytest.mark.parametrize(
    "section, key, value, allowed",
    [
        ("server", "endpoint", '"http://x"', "ipc://"),
        ("server", "endpoint", '"tcp://127.0.0.1:99999"', "port up to 65535"),
        ("server", "endpoint", '"ipc://@abstract"', "a file path"),
        ("server", "workers", "0", "integer from 1"),
        ("server", "workers", '"four"', "integer from 1"),
        ("server", "max_message_bytes", '"lots"', "size"),
        ("server", "max_tokens_per_request", "-1", "integer"),
        ("server", "max_inflight_per_client", "1.5", "integer"),
        ("server", "allow_insecure_tcp", '"maybe"', "true or false"),
        ("server", "curve_allowed_keys", "[1]", "non-empty string"),
        ("server", "metrics_port", "70000", "65535"),
        ("server", "log_level", '"loud"', "debug, info"),
        ("hbm", "device", '"tpu"', "cuda:N"),
        ("hbm", "capacity", '"8 GiBs"', "size"),
        ("hbm", "capacity", "0", "at least 1"),
        # sizes past any machine: the pools' numbers overflowed (a traceback at start, or stats failing)
        ("hbm", "capacity", "1e+20", "at most 1024TiB"),
        ("ram", "capacity", '"1000000000TiB"', "at most 1024TiB"),
        ("nvme", "capacity", '"9999999999999999999"', "at most 1024TiB"),
        ("server", "max_message_bytes", "1e+30", "at most 1024TiB"),
        ("hbm", "capacity", '"99PiB"', "units B, KiB"),
        ("ram", "capacity", "-5", "size"),
        ("ram", "codec", '"int4"', "fp8, int8, raw"),
        ("ram", "pin_memory", "2", "'auto'"),
        ("nvme", "path", '""', "directory path"),
        ("nvme", "capacity", '"1KiB"', "at least"),
        ("nvme", "codec", '"zip"', "int4"),
        ("nvme", "zstd", "23", "0 to 22"),
        ("nvme", "rotate", '"sideways"', "true or false"),
        ("nvme", "head_codec", '"int3"', "int8, fp8, raw, int4, none"),
        ("nvme", "head_blocks", "-1", "integer from 0"),
        ("nvme", "write_through", '"sometimes"', "true or false"),
        ("nvme", "admit", '"third_use"', "second_use"),
        ("nvme", "ttl", '"7 days"', "duration"),
        ("nvme", "ttl", "0", "positive duration"),
        ("nvme", "durability", '"paranoid"', "fast, balanced, safe"),
        ("nvme", "enabled", "1", "true or false"),
        ("policy", "promote_on_hit", '"yes please"', "true or false"),
        ("policy", "pin_lease", '"never"', "positive duration"),
        # a lease or a time-out that never ends in practice: pins never lapsed
        ("policy", "pin_lease", "1e+300", "at most 1d"),
        ("cluster", "timeout", '"2d"', "at most 1h"),
        # a TTL past 64 bits of milliseconds: every write to the cluster failed, the tier went down
        ("cluster", "ttl", "1e+16", "at most 36500d"),
        ("nvme", "ttl", "1e+16", "at most 36500d"),
        # a {hash tag} puts every key of every host on one node of the cluster
        ("cluster", "prefix", '"{kv}"', "without { or }"),
        ("cluster", "retry_after", '"30d"', "at most 1d"),
        ("policy", "write_queue", "0", "integer from 1"),
        ("policy", "page_bytes", "16", "at least 256"),
    ],
)
def test_invalid_value_names_key_value_and_allowed(
    tmp_path: Path, section: str, key: str, value: str, allowed: str
) -> None:
    path = write(tmp_path, f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    msg = str(e.value)
    assert str(path) in msg and f"[{section}] {key}" in msg and allowed in msg
    assert value.strip('"') in msg


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"\xff\xfe[server]\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path, env={})


def test_invalid_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"environment KVSTORE_RAM_CAPACITY: \[ram\] capacity = 'two gigs'"):
        load_config(env={"KVSTORE_RAM_CAPACITY": "two gigs"})


def test_unknown_key_is_an_error_with_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'capcity' in \[ram\] \(did you mean 'capacity'\?\)"):
        load_config(write(tmp_path, "[ram]\ncapcity = 5\n"), env={})


def test_unknown_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown section \[nvm\] \(did you mean 'nvme'\?\)"):
        load_config(write(tmp_path, "[nvm]\npath = 'x'\n"), env={})
    with pytest.raises(ConfigError, match="outside any section"):
        load_config(write(tmp_path, "workers = 4\n"), env={})


def test_unknown_env_setting_in_a_known_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match="KVSTORE_RAM_CAPCITY is not a setting.*KVSTORE_RAM_CAPACITY"):
        load_config(env={"KVSTORE_RAM_CAPCITY": "1GiB"})
    # the shared KVSTORE_POLICY_ made any name look like every setting: FOO got "PROMOTE_ON_HIT?"
    with pytest.raises(ConfigError, match=r"KVSTORE_POLICY_FOO is not a setting; \[policy\] settings"):
        load_config(env={"KVSTORE_POLICY_FOO": "1"})


def test_missing_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[ram\ncapacity = 1\n"), env={})
    with pytest.raises(ConfigError, match="must be a table"):
        load_config(write(tmp_path, "ram = 5\n"), env={})


def test_cluster_frames_take_the_nvme_codecs_unless_told(tmp_path: Path) -> None:
    c = load_config(env={})
    codec, head = c.cluster.codecs(c.nvme)
    assert (codec.name, codec.zstd_level) == ("int4", 3) and head is not None and head.name == "int8"
    # a fast network: raw frames without zstd (the head codec follows: nothing above raw)
    c = load_config(write(tmp_path, '[cluster]\ncodec = "raw"\nzstd = 0\n'), env={})
    codec, head = c.cluster.codecs(c.nvme)
    assert (codec.name, codec.zstd_level) == ("raw", 0) and c.nvme.zstd == 3
    c = load_config(env={"KVSTORE_CLUSTER_ZSTD": "0"})
    assert [x.zstd_level for x in c.cluster.codecs(c.nvme) if x is not None] == [0, 0]
    with pytest.raises(ConfigError, match=r"cluster.*zstd"):
        load_config(env={"KVSTORE_CLUSTER_ZSTD": "99"})


def test_nvme_head_block_policy_keys(tmp_path: Path) -> None:
    # default: int4 rotated, the first block of each prefix at int8, all at the same zstd level
    n = load_config(env={}).nvme
    assert (n.codec, n.rotate, n.head_codec, n.head_blocks, n.zstd) == ("int4", True, "int8", 1, 3)
    codec, head = n.codecs()
    assert (codec.name, codec.params()["rotate"], codec.zstd_level) == ("int4", True, 3)
    assert head is not None and (head.name, head.zstd_level) == ("int8", 3)
    # "none" (file or environment) switches the policy off; so does head_blocks = 0
    off = load_config(write(tmp_path, '[nvme]\nhead_codec = "none"\n'), env={}).nvme
    assert off.head_codec is None and off.codecs()[1] is None
    env = {"KVSTORE_NVME_HEAD_CODEC": "raw", "KVSTORE_NVME_HEAD_BLOCKS": "2", "KVSTORE_NVME_ROTATE": "off"}
    n = load_config(env=env).nvme
    assert (n.head_codec, n.head_blocks, n.rotate) == ("raw", 2, False)
    assert n.codecs()[0].params()["rotate"] is False
    assert load_config(env={"KVSTORE_NVME_HEAD_BLOCKS": "0"}).nvme.codecs()[1] is None
    # a head codec that keeps no more than the tier codec is not used: raw stays lossless throughout
    assert load_config(env={"KVSTORE_NVME_CODEC": "raw"}).nvme.codecs()[1] is None
    assert (
        load_config(env={"KVSTORE_NVME_CODEC": "int8", "KVSTORE_NVME_HEAD_CODEC": "fp8"}).nvme.codecs()[1]
        is None
    )
    assert load_config(env={"KVSTORE_NVME_CODEC": "fp8"}).nvme.codecs()[1].name == "int8"  # type: ignore[union-attr]
    # rotate is int4's: every other codec ignores it, so changing codec alone keeps a config valid
    n = load_config(write(tmp_path, '[nvme]\ncodec = "int8"\n'), env={}).nvme
    assert n.codecs()[0].name == "int8"
    n = load_config(write(tmp_path, '[nvme]\ncodec = "raw"\nrotate = true\n'), env={}).nvme
    assert n.codecs()[0].name == "raw" and "rotate" not in n.codecs()[0].params()
    assert load_config(env={"KVSTORE_NVME_CODEC": "fp8", "KVSTORE_NVME_ROTATE": "true"}).nvme.codec == "fp8"
    assert with_overrides(Config(), "nvme", codec="int8").nvme.codec == "int8"
    assert with_overrides(Config(), "nvme", codec="raw", rotate=True).nvme.codecs()[0].name == "raw"


def test_with_overrides_checks_like_a_file(tmp_path: Path) -> None:
    c = with_overrides(Config(), "nvme", path=tmp_path, ttl="1h")
    assert c.nvme.path == tmp_path and c.nvme.ttl == 3600.0
    with pytest.raises(ConfigError, match=r"\[ram\] codec = 'zip'"):
        with_overrides(c, "ram", codec="zip")
    with pytest.raises(ConfigError, match="unknown key"):
        with_overrides(c, "ram", colour="red")
    with pytest.raises(ConfigError, match="unknown section"):
        with_overrides(c, "disk", path="x")


def test_allowed_values_match_the_parts_that_use_them(tmp_path: Path) -> None:
    # config must accept exactly what the tiers and codecs implement, or a valid file fails at start-up
    from kvstore.codecs import CODECS
    from kvstore.tiers.lmdb_env import DURABILITY

    for mode in DURABILITY:
        assert (
            load_config(write(tmp_path, f'[nvme]\ndurability = "{mode}"\n'), env={}).nvme.durability == mode
        )
    for section, codecs in (("ram", ("fp8", "int8", "raw")), ("nvme", ("int4", "int8", "fp8", "raw"))):
        for name in codecs:
            assert name in CODECS
            assert (
                getattr(
                    load_config(write(tmp_path, f'[{section}]\ncodec = "{name}"\n'), env={}), section
                ).codec
                == name
            )
    with pytest.raises(ConfigError, match="durability"):
        load_config(write(tmp_path, '[nvme]\ndurability = "sync"\n'), env={})


# ---- values that looked valid and failed later ----


@pytest.mark.parametrize("value", ["257", "4097", '"1000"', '"65537"'])
def test_page_bytes_off_the_256_byte_grid_is_refused_at_load(tmp_path: Path, value: str) -> None:
    # 4097 was accepted, and every put of a float16 block that landed on an odd page failed `internal`
    path = write(tmp_path, f"[policy]\npage_bytes = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    msg = str(e.value)
    assert "[policy] page_bytes" in msg and "a multiple of 256" in msg and value.strip('"') in msg


def test_every_page_of_a_store_on_the_smallest_page_size_takes_a_put(tmp_path: Path) -> None:
    import torch

    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    from kvstore.store.engine import Store

    path = write(
        tmp_path,
        '[hbm]\ndevice = "cpu"\ncapacity = "64KiB"\n[ram]\ncapacity = "64KiB"\n'
        f'[nvme]\nenabled = false\npath = "{tmp_path}/nvme"\n[policy]\npage_bytes = 256\n',
    )
    config = load_config(path, env={})
    assert config.policy.page_bytes == 256
    # a block of 1 x 2 x 2 x 1 x 8 float32 = 128 bytes: one page each, so blocks start on every page
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_tokens=2)
    store = Store.from_config(config)
    try:
        r = store.put(Namespace(model="m", layout=layout), list(range(16)), torch.randn(layout.shape(16)))
        assert (r.stored, r.failed) == (8, [])
    finally:
        store.close()


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("server", "metrics_port", "false"),  # was taken as "off"
        ("server", "metrics_port", "true"),
        ("server", "workers", "true"),
        ("server", "max_message_bytes", "true"),
        ("nvme", "zstd", "false"),
        ("nvme", "head_blocks", "false"),
        ("nvme", "ttl", "true"),
        ("cluster", "zstd", "false"),
        ("cluster", "ttl", "false"),
        ("policy", "page_bytes", "true"),
        ("policy", "write_queue", "true"),
    ],
)
def test_a_boolean_is_never_a_number(tmp_path: Path, section: str, key: str, value: str) -> None:
    path = write(tmp_path, f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"\[{section}\] {key} = {value.title()} is not allowed"):
        load_config(path, env={})


def test_metrics_port_off_is_said_with_0_or_off(tmp_path: Path) -> None:
    for value in ("0", '"off"', '"none"'):
        c = load_config(write(tmp_path, f"[server]\nmetrics_port = {value}\n"), env={})
        assert c.server.metrics_port is None
    with pytest.raises(ConfigError, match=r"1 to 65535, or 0 or 'off' for none"):
        load_config(write(tmp_path, "[server]\nmetrics_port = false\n"), env={})
    # from the environment, a text: "0" as the README says (it was refused, the daemon down)
    for text in ("0", "off"):
        c = load_config(
            write(tmp_path, "[server]\nmetrics_port = 9464\n"), env={"KVSTORE_SERVER_METRICS_PORT": text}
        )
        assert c.server.metrics_port is None


def test_a_relative_ipc_endpoint_in_a_file_resolves_against_the_files_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.config import check_endpoint

    # the daemon and the CLIs reading this file run in different directories: one socket for all
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    c = load_config(
        write(tmp_path, '[server]\nendpoint = "ipc://run/kv.sock"\n[nvme]\npath = "data"\n'), env={}
    )
    assert c.server.endpoint == f"ipc://{tmp_path}/run/kv.sock"
    assert c.nvme.path == cwd / "data"  # other paths: against the working directory, as documented
    # given in the environment or on a command line: against the working directory
    assert load_config(env={"KVSTORE_ENDPOINT": "ipc://kv.sock"}).server.endpoint == f"ipc://{cwd}/kv.sock"
    assert check_endpoint(" ipc://./a/kv.sock ") == f"ipc://{cwd}/a/kv.sock"
    assert (
        with_overrides(Config(), "server", endpoint="ipc://o.sock").server.endpoint == f"ipc://{cwd}/o.sock"
    )
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert check_endpoint("ipc://~/kv.sock") == f"ipc://{tmp_path}/home/kv.sock"
    assert check_endpoint("ipc:///abs/kv.sock") == "ipc:///abs/kv.sock"  # absolute ones are left alone
    assert check_endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"


def test_curve_secret_key_is_never_shown(tmp_path: Path) -> None:
    import json

    key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a Z85 secret key's shape
    path = write(tmp_path, f'[server]\ncurve_secret_key = "{key}"\nshm_dir = "{tmp_path}/shm"\n')
    c = load_config(path, env={})
    assert c.server.curve_secret_key == key  # still usable
    d = c.to_dict()
    assert d["server"]["curve_secret_key"] == "***"
    for text in (repr(c), str(c.server), json.dumps(d)):
        assert key not in text
    # nor in an error about the value (a list holding the key, say)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f'[server]\ncurve_secret_key = ["{key}"]\n'), env={})
    assert key not in str(e.value) and "[server] curve_secret_key = *** is not allowed" in str(e.value)
    assert (
        load_config(env={"KVSTORE_SERVER_CURVE_SECRET_KEY": key}).to_dict()["server"]["curve_secret_key"]
        == "***"
    )


def test_a_missing_file_is_named_by_where_it_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist; give an existing file to KVSTORE_CONFIG"):
        load_config(env={"KVSTORE_CONFIG": str(tmp_path / "nope.toml")})
    with pytest.raises(ConfigError, match=r"does not exist; give an existing file to --config"):
        load_config(tmp_path / "nope.toml", env={})


def test_a_key_outside_any_section_says_where_it_belongs(tmp_path: Path) -> None:
    # "workers = 4" before any [section] was "unknown section [workers]"
    with pytest.raises(
        ConfigError, match=r"'workers' is set outside any section; it belongs under \[server\]"
    ):
        load_config(write(tmp_path, "workers = 4\n"), env={})
    with pytest.raises(ConfigError, match="'colour' is set outside any section; sections are server"):
        load_config(write(tmp_path, 'colour = "red"\n'), env={})


def test_a_cluster_password_and_its_environment_variable_are_not_both_taken(tmp_path: Path) -> None:
    # both were accepted, and the variable silently ignored
    path = write(tmp_path, '[cluster]\npassword = "x"\npassword_env = "REDIS_PASSWORD"\n')
    with pytest.raises(ConfigError, match="both set"):
        load_config(path, env={"REDIS_PASSWORD": "y"})
    path = write(tmp_path, '[cluster]\npassword = "x"\n')
    with pytest.raises(ConfigError, match="both set"):
        load_config(path, env={"KVSTORE_CLUSTER_PASSWORD_ENV": "REDIS_PASSWORD"})


def test_a_password_in_a_cluster_node_url_is_never_shown(tmp_path: Path) -> None:
    import json

    path = write(tmp_path, '[cluster]\nnodes = ["redis://u:p@ss@h:1", "redis://:s3cret@h:2"]\n')
    c = load_config(path, env={})
    assert c.cluster.nodes == ("redis://u:p@ss@h:1", "redis://:s3cret@h:2")  # still usable
    assert c.to_dict()["cluster"]["nodes"] == ["redis://u:***@h:1", "redis://:***@h:2"]
    for text in (repr(c), str(c.cluster), json.dumps(c.to_dict())):
        assert "p@ss" not in text and "s3cret" not in text and "ss@h" not in text
    assert "nodes=('redis://u:***@h:1', 'redis://:***@h:2')" in repr(c.cluster)
