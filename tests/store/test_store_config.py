"""Store.from_config: the tiers a Config describes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from conftest import NS, T, kv, same, tokens

from kvstore.config import Config, HbmConfig, NvmeConfig, PolicyConfig, RamConfig
from kvstore.store import Store


def small_config(path: Path, **nvme: object) -> Config:
    return Config(hbm=HbmConfig(device="cpu", capacity=8 * 1024),
                  ram=RamConfig(capacity=16 * 1024, codec="raw", pin_memory=False),
                  nvme=replace(NvmeConfig(path=path, capacity=1 << 22), **nvme),  # type: ignore[arg-type]
                  policy=PolicyConfig(page_bytes=1024))


def test_from_config_builds_all_three_tiers(tmp_path: Path) -> None:
    with Store.from_config(small_config(tmp_path / "nvme")) as s:
        toks = tokens(3)
        s.put(NS, toks, kv(3 * T))
        got = s.get(NS, toks).kv
        assert got is not None and same(got, kv(3 * T))
        assert s.flush(10)
        assert list(s.stats().tiers) == ["hbm", "ram", "nvme"]
    # the same config again finds the blocks on nvme
    with Store.from_config(small_config(tmp_path / "nvme")) as s:
        assert s.lookup(NS, tokens(3)).tiers == ["nvme"] * 3


def test_from_config_without_nvme(tmp_path: Path) -> None:
    with Store.from_config(small_config(tmp_path / "unused", enabled=False)) as s:
        s.put(NS, tokens(2), kv(2 * T))
        assert list(s.stats().tiers) == ["hbm", "ram"]
        assert s.flush(1)
    assert not (tmp_path / "unused").exists()
