"""kvstore.units: sizes and durations as written in configs and on the command line."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.units import parse_duration, parse_size


@pytest.mark.parametrize(
    "text, expect",
    [
        ("4096", 4096),
        (4096, 4096),
        (0, 0),
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("8gib", 8 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("64k", 65536),
        ("2G", 2 * 2**30),
        ("1TiB", 2**40),
        ("10 MB", 10**7),
        ("100B", 100),
        (2.0**20, 2**20),
        (".5KiB", 512),
    ],
)
def test_parse_size(text: str | int, expect: int) -> None:
    assert parse_size(text) == expect


@pytest.mark.parametrize(
    "text", ["", "GiB", "8 GiBs", "-1", -1, "1.5B", "1e9", "8XB", True, None, 1.5, "1,5GB"]
)
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text, expect",
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("30", 30.0),
        (30, 30.0),
        (2.5, 2.5),
        ("15m", 900.0),
        ("15min", 900.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("0.5s", 0.5),
        ("2H", 7200.0),
    ],
)
def test_parse_duration(text: str | float, expect: float) -> None:
    assert parse_duration(text) == pytest.approx(expect)


@pytest.mark.parametrize("text", ["", "s", "-5s", -5, "5x", "1.5.2", "1h30", "abc", True, None, float("nan")])
def test_parse_duration_rejects(text: object) -> None:
    with pytest.raises(ConfigError, match="duration"):
        parse_duration(text)  # type: ignore[arg-type]


def test_config_reexports_the_parsers() -> None:
    from kvstore import config

    assert config.parse_size is parse_size and config.parse_duration is parse_duration
