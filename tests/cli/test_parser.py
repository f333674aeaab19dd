"""``kvstore``'s arguments: operator mistakes are caught before anything is asked of a daemon,
named, and given a hint."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from kvstore.cli.parser import UsageError, parse_args, parse_layout, read_tokens
from tests.cli.harness import usage_error


def test_evict_needs_a_filter(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["evict"], capsys)
    assert "kvstore evict: error: evict needs a filter" in err and "--older-than" in err


def test_evict_all_does_not_combine(capsys: pytest.CaptureFixture[str]) -> None:
    assert "drop --session or --all" in usage_error(["evict", "--all", "--session", "s"], capsys)


def test_evict_filters_combine() -> None:
    args = parse_args(["evict", "--model", "m", "--older-than", "2d", "--tier", "ram", "--dry-run"])
    assert (args.model, args.older_than, args.tier, args.dry_run, args.all) == (
        "m",
        172800.0,
        "ram",
        True,
        False,
    )


@pytest.mark.parametrize(
    "argv, named",
    [
        (["evict", "--older-than", "2x"], "--older-than"),
        (["evict", "--older-than", "0s"], "must be positive"),
        (["evict", "--tier", "disk"], "--tier: invalid choice: 'disk'"),
        (["prefetch", "--session", "s", "--to", "nvme"], "--to: invalid choice"),
        (["prefetch"], "--session"),
        (["prefetch", "--session", "s", "--chunk", "0"], "--chunk: 0 must be at least 1"),
        (["prefetch", "--session", "s", "--chunk", "x"], "--chunk: 'x' is not a whole number"),
        (["stats", "--endpoint", "http://x"], "--endpoint"),
        (["stats", "--timeout", "soon"], "--timeout"),
        (["inspect", "--layout", "L=2,H=x"], "--layout"),
        (["stat"], "invalid choice: 'stat'"),
        (["demo", "--max-new-tokens", "-5"], "--max-new-tokens"),
        (["demo", "--document-tokens", "0"], "--document-tokens"),
        ([], "COMMAND"),
    ],
)
def test_bad_flags_and_values_are_named(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert named in usage_error(argv, capsys)


def test_mistyped_flag_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["stats", "--jsn"], capsys)
    assert "kvstore stats: error: unrecognized arguments: --jsn (did you mean --json?)" in err
    # no abbreviations: a prefix of a destructive flag is not silently accepted
    assert "unrecognized arguments: --dry" in usage_error(["evict", "--all", "--dry"], capsys)


def test_inspect_tokens_needs_the_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    assert "needs --model and --layout" in usage_error(["inspect", "--tokens", "f"], capsys)
    assert "--model only goes with --tokens" in usage_error(["inspect", "--model", "m"], capsys)
    # --tenant and --revision name the tokens' namespace too: alone they were ignored, every tenant listed
    assert "inspect: --tenant only goes with --tokens" in usage_error(["inspect", "--tenant", "t"], capsys)
    assert "--revision only go" in usage_error(["inspect", "--revision", "r"], capsys)
    args = parse_args(["inspect", "--tokens", "f", "--model", "m", "--layout", "L=2,H=1,D=8"])
    assert (args.tenant, args.revision) == ("default", "")
    err = usage_error(["inspect", "--tokens", "f", "--model", "", "--layout", "L=2,H=1,D=8"], capsys)
    assert "argument --model: must not be empty" in err


def test_evict_filters_are_checked_before_anything_is_asked(capsys: pytest.CaptureFixture[str]) -> None:
    # a namespace id that is none, or an empty model or tenant, matched nothing and said only that
    err = usage_error(["evict", "--namespace", "zz"], capsys)
    assert "'zz' is not a namespace id: 16 hex digits" in err
    assert "must not be empty" in usage_error(["evict", "--model", ""], capsys)
    assert "must not be empty" in usage_error(["evict", "--tenant", " "], capsys)
    assert parse_args(["evict", "--namespace", "0123456789abcdef"]).namespace == "0123456789abcdef"
    assert parse_args(["evict", "--namespace", "0123456789ABCDEF"]).namespace == "0123456789abcdef"
    assert "not both" in usage_error(
        ["inspect", "--session", "s", "--tokens", "f", "--model", "m", "--layout", "L=2,H=1,D=8"], capsys
    )


def test_defaults() -> None:
    args = parse_args(["prefetch", "--session", "s"])
    assert (args.to, args.timeout, args.json, args.endpoint, args.config) == ("ram", 5.0, False, None, None)
    assert args.chunk == 16 and parse_args(["prefetch", "--session", "s", "--chunk", "2"]).chunk == 2
    assert parse_args(["serve", "--config", "c.toml"]).config == "c.toml"


def test_parse_layout_short_and_long_names() -> None:
    lay = parse_layout("L=30,H=3,D=64,dtype=bfloat16,T=64")
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, lay.block_tokens) == (
        30,
        3,
        64,
        "bfloat16",
        64,
    )
    assert parse_layout("num_layers=2, num_kv_heads=1, head_dim=8") == parse_layout("L=2,H=1,D=8")
    for twice in ("L=2,H=1,D=8,L=3", "L=2,num_layers=2,H=1,D=8"):  # the last one won, silently
        with pytest.raises(argparse.ArgumentTypeError, match="layout num_layers is given twice"):
            parse_layout(twice)


def test_read_tokens(tmp_path: Path) -> None:
    f = tmp_path / "t"
    f.write_text("[1, 2, 3]")
    assert read_tokens(str(f)) == [1, 2, 3]
    f.write_text("1 2\n3,4\n")
    assert read_tokens(str(f)) == [1, 2, 3, 4]
    assert read_tokens("-", io.StringIO("7 8")) == [7, 8]
    for bad in ("[1, 2.5]", "1 two", '{"a": 1}', "[[1]]"):
        f.write_text(bad)
        with pytest.raises(UsageError, match="token ids"):
            read_tokens(str(f))
    with pytest.raises(UsageError, match="cannot read"):
        read_tokens(str(tmp_path / "missing"))
    for bad in ("[1, -2]", f"[{2**32}]"):  # refused here (a usage error), not by the client (exit 1)
        f.write_text(bad)
        with pytest.raises(UsageError, match="out of range"):
            read_tokens(str(f))
    from kvstore.cli.parser import MAX_TOKEN_ID
    from kvstore.keys import MAX_TOKEN_ID as KEYS_MAX

    assert MAX_TOKEN_ID == KEYS_MAX
    f.write_bytes(bytes(range(128, 256)))  # binary: not text at all
    with pytest.raises(UsageError, match="is not text"):
        read_tokens(str(f))
