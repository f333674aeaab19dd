"""Store.from_config: the tiers a Config describes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.config import Config, HbmConfig, NvmeConfig, PolicyConfig, RamConfig
from kvstore.errors import ConfigError
from kvstore.store.engine import Store
from tests.store.storekit import NS, T, kv, same, tokens


def small_config(path: Path, **nvme: object) -> Config:
    return Config(
        hbm=HbmConfig(device="cpu", capacity=8 * 1024),
        ram=RamConfig(capacity=16 * 1024, codec="raw", pin_memory=False),
        nvme=replace(NvmeConfig(path=path, capacity=1 << 22), **nvme),  # type: ignore[arg-type]
        policy=PolicyConfig(page_bytes=1024),
    )


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


def _codec_ids(s: Store, keys: list[bytes]) -> list[int]:
    from kvstore.codecs import read_header

    nvme = s.tiers.nvme
    assert nvme is not None
    return [read_header(nvme.get_frame(k)).codec_id for k in keys]


def test_default_nvme_keeps_block_0_at_int8_and_the_rest_at_int4(tmp_path: Path) -> None:
    from kvstore.codecs import CODECS
    from kvstore.keys import block_keys

    int4, int8 = CODECS["int4"].codec_id, CODECS["int8"].codec_id
    toks, data = tokens(3), kv(3 * T)
    keys = block_keys(NS, toks)
    # write-through: block 0 of the prefix lands on nvme as an int8 frame, blocks 1 and 2 as int4
    with Store.from_config(small_config(tmp_path / "nvme")) as s:
        s.put(NS, toks, data)
        assert s.flush(10)
        assert _codec_ids(s, keys) == [int8, int4, int4]
    # after a restart both kinds are read back from nvme, block 0 closer to the original
    with Store.from_config(small_config(tmp_path / "nvme")) as s:
        assert s.lookup(NS, toks).tiers == ["nvme"] * 3
        got = s.get(NS, toks).kv
        assert got is not None and got.shape == data.shape
        err = [
            float(
                (got[:, :, i * T : (i + 1) * T].float() - data[:, :, i * T : (i + 1) * T].float()).norm()
                / data[:, :, i * T : (i + 1) * T].float().norm()
            )
            for i in range(3)
        ]
        assert err[0] < 0.01 < min(err[1:]) < 0.25


def test_demoted_blocks_get_the_head_policy_too(tmp_path: Path) -> None:
    from kvstore.codecs import CODECS
    from kvstore.keys import block_keys

    int4, int8 = CODECS["int4"].codec_id, CODECS["int8"].codec_id
    # no write-through: blocks reach nvme only by demotion from a full ram tier
    with Store.from_config(small_config(tmp_path / "nvme", write_through=False)) as s:
        toks = tokens(30)
        s.put(NS, toks, kv(30 * T))
        keys = block_keys(NS, toks)
        nvme = s.tiers.nvme
        assert nvme is not None
        on_nvme = [i for i, k in enumerate(keys) if k in nvme]
        assert 0 in on_nvme and len(on_nvme) > 1  # the oldest blocks went down, block 0 first
        ids = _codec_ids(s, [keys[i] for i in on_nvme])
        assert ids == [int8 if i == 0 else int4 for i in on_nvme]
        got = s.get(NS, toks).kv
        assert got is not None and got.shape[2] == 30 * T


def test_a_memory_tier_smaller_than_one_page_is_refused(tmp_path: Path) -> None:
    # with 60 KiB and 64 KiB pages the pool had no page: every block skipped the tier, silently
    config = replace(small_config(tmp_path / "nvme"), policy=PolicyConfig(page_bytes=64 * 1024))
    with pytest.raises(ConfigError, match=r"\[hbm\] capacity = 8192 bytes is less than one page"):
        Store.from_config(config)
    assert not (tmp_path / "nvme").exists()
