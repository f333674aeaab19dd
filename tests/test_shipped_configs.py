"""The shipped configs stay valid when a user changes any one key to any other allowed value.

For each file in configs/, for each key kvstore accepts (present in the file or not), each
value of ALTERNATIVES is written into a copy of the file in place of (or beside) the key's
line, and the copy must load. Codec keys go further: a store is built from the copy (small
capacities, a tmp path) and one block goes through it.

    configs/default.toml   [nvme] codec = "raw"      -> loads (rotate = true is int4's, ignored)
    configs/gpu.toml       [nvme] enabled = false    -> loads
    ...
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.config import Config, load_config, settings, with_overrides
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
BOOL = [True, False]
# every key, with values a user could sensibly choose: enums every choice, booleans both,
# sizes/durations/counts another sane value at either end
ALTERNATIVES: dict[str, dict[str, list[Any]]] = {
    "server": {
        "endpoint": ["ipc:///tmp/kvstore-test/kv.sock", "tcp://127.0.0.1:5555", "tcp://0.0.0.0:5555"],
        "workers": [1, 16],
        "max_message_bytes": ["64MiB", "2GiB"],
        "max_tokens_per_request": [4096, 1 << 20],
        "max_inflight_per_client": [1, 256],
        "max_inflight_bytes": ["64MiB", "8GiB"],
        "max_inflight_bytes_per_tenant": ["16MiB", "8GiB"],
        "max_queued_requests": [16, 8192],
        "max_namespaces_per_tenant": [1, 4096],
        "max_pins_per_tenant": [1, 4096],
        "max_pinned_blocks_per_tenant": [1, 1 << 18],
        "allow_insecure_tcp": BOOL,
        "curve_secret_key": ["/etc/kvstore/server.key"],
        "curve_allowed_keys": ["/etc/kvstore/clients.txt"],
        "metrics_port": [0, 9464],
        "log_level": ["debug", "info", "warning", "error", "critical"],
        "shared_memory": ["auto", "off"],
        "shm_dir": ["/tmp/kvstore-test/shm"],
        "shm_staging": ["16MiB", "4GiB"],
        "shm_staging_per_client": ["8MiB", "1GiB"],
    },
    "hbm": {"device": ["auto", "cpu", "cuda", "cuda:1"], "capacity": ["64MiB", "32GiB"]},
    "ram": {"capacity": ["64MiB", "256GiB"], "codec": ["fp8", "int8", "raw"], "pin_memory": ["auto", *BOOL]},
    "nvme": {
        "path": ["/tmp/kvstore-test/nvme", "relative/nvme"],
        "capacity": ["16MiB", "4TiB"],
        "codec": ["int4", "int8", "fp8", "raw"],
        "zstd": [0, 19],
        "rotate": BOOL,
        "head_codec": ["int8", "fp8", "raw", "int4", "none"],
        "head_blocks": [0, 4],
        "write_through": BOOL,
        "admit": ["always", "second_use"],
        "ttl": ["1h", "never"],
        "durability": ["fast", "balanced", "safe"],
        "enabled": BOOL,
    },
    "cluster": {
        "enabled": BOOL,
        "nodes": ["redis://cache-1:7000", "rediss://cache-1:7000,rediss://cache-2:7000"],
        "username": ["kvstore"],
        "password": ["s3cret"],
        "password_env": ["KVSTORE_REDIS_PASSWORD"],
        "codec": ["int4", "int8", "fp8", "raw", "none"],
        "zstd": [0, 9],
        "ttl": ["1d", "never"],
        "timeout": ["100ms", "5s"],
        "retry_after": ["1s", "1m"],
        "write_queue": [16, 1 << 16],
        "prefix": ["kvstore-prod"],
        "required": BOOL,
        "tls_ca_file": ["/etc/kvstore/redis-ca.crt"],
        "tls_cert_file": ["/etc/kvstore/redis-client.crt"],
        "tls_key_file": ["/etc/kvstore/redis-client.key"],
    },
    "policy": {
        "promote_on_hit": BOOL,
        "pin_lease": ["5s", "10m"],
        "write_queue": [16, 1 << 16],
        "page_bytes": ["4KiB", "1MiB"],
    },
}
# keys that choose or tune a codec: a store is built and a block goes through it
CODEC_KEYS = {
    ("ram", "codec"),
    *(("nvme", k) for k in ("codec", "rotate", "head_codec", "head_blocks", "zstd")),
}
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return str(v) if isinstance(v, int) else f'"{v}"'


def substitute(text: str, section: str, key: str, value: Any) -> str:
    """``text`` with ``[section] key`` set to ``value``: its line rewritten (comment kept), else added."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"[{section}]"), None)
    if start is None:
        return text + f"\n[{section}]\n{key} = {toml_value(value)}\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    for i in range(start + 1, end):
        m = re.match(rf"{re.escape(key)}\s*=\s*(\"[^\"]*\"|[^#\s]+)(.*)", lines[i])
        if m:
            lines[i] = f"{key} = {toml_value(value)}{m.group(2)}"
            return "\n".join(lines) + "\n"
    lines.insert(start + 1, f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def test_the_alternatives_cover_every_key() -> None:
    # a new key needs its alternative values here, or the shipped configs go untested against it
    assert {s: set(keys) for s, keys in settings().items()} == {s: set(v) for s, v in ALTERNATIVES.items()}


def one_block_through(config: Config, tmp: Path) -> None:
    from kvstore.store.engine import Store

    small = with_overrides(config, "hbm", device="cpu", capacity="64KiB")
    small = with_overrides(small, "ram", capacity="64KiB", pin_memory=False)
    small = with_overrides(small, "nvme", capacity="16MiB", path=tmp / "nvme")
    small = with_overrides(small, "policy", page_bytes="4KiB")
    store = Store.from_config(small)
    try:
        ns = Namespace(model="m", layout=LAYOUT)
        tokens = list(range(LAYOUT.block_tokens))
        kv = torch.randn(LAYOUT.shape(LAYOUT.block_tokens)).to(torch.float16)
        assert store.put(ns, tokens, kv).stored == 1
        got = store.get(ns, tokens, device="cpu")
        assert got.matched_blocks == 1 and got.kv is not None and got.kv.shape == kv.shape
    finally:
        store.close()


@pytest.mark.parametrize("shipped", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_single_key_change_keeps_a_shipped_config_valid(shipped: Path, tmp_path: Path) -> None:
    text = shipped.read_text()
    load_config(shipped, env={})  # as shipped
    refused = []
    for section, keys in ALTERNATIVES.items():
        for key, values in keys.items():
            for value in values:
                path = tmp_path / "kvstore.toml"
                path.write_text(substitute(text, section, key, value))
                try:
                    config = load_config(path, env={})
                except Exception as e:
                    refused.append(f"[{section}] {key} = {toml_value(value)}: {e}")
                    continue
                if (section, key) in CODEC_KEYS:
                    one_block_through(config, tmp_path / f"{section}-{key}-{value}")
    assert not refused, f"{shipped.name} breaks when one key changes:\n" + "\n".join(refused)
