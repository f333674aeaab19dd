"""The ``kvstore`` command: argument parsing, renderings, and real subprocesses against a real daemon.

Many short stories, one per command and operator mistake.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli import display
from kvstore.cli.commands import plain, resolve_endpoint
from kvstore.cli.parser import UsageError, parse_args, parse_layout, read_tokens
from kvstore.results import EvictResult

# ---------------------------------------------------------------- parsing


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


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
    assert "only go with --tokens" in usage_error(["inspect", "--model", "m"], capsys)
    # --tenant and --revision name the tokens' namespace too: alone they were ignored, every tenant listed
    assert "inspect: --tenant only go with --tokens" in usage_error(["inspect", "--tenant", "t"], capsys)
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


def test_endpoint_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nendpoint = "ipc:///tmp/from-file.sock"\n')
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    monkeypatch.delenv("KVSTORE_SERVER_ENDPOINT", raising=False)
    monkeypatch.delenv("KVSTORE_ENDPOINT", raising=False)
    assert resolve_endpoint(parse_args(["stats", "--config", str(cfg)])) == "ipc:///tmp/from-file.sock"
    monkeypatch.setenv("KVSTORE_ENDPOINT", "tcp://127.0.0.1:7000")
    assert resolve_endpoint(parse_args(["stats", "--config", str(cfg)])) == "tcp://127.0.0.1:7000"
    assert (
        resolve_endpoint(parse_args(["stats", "--endpoint", "ipc:///tmp/flag.sock"]))
        == "ipc:///tmp/flag.sock"
    )


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


def test_plain_makes_results_json_ready() -> None:
    r = plain(EvictResult(blocks=1, bytes_freed={"hbm": 10}, moved=0, keys=[b"\x01\xff"], dry_run=True))
    assert r == {
        "blocks": 1,
        "bytes_freed": {"hbm": 10},
        "moved": 0,
        "keys": ["01ff"],
        "dry_run": True,
        "not_done": "",
    }
    assert json.loads(json.dumps(r)) == r


# ---------------------------------------------------------------- renderings


@pytest.mark.parametrize(
    "n, text",
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (100 * 2**20, "100 MiB"),
        (int(1.5 * 2**30), "1.5 GiB"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert display.format_bytes(n) == text


@pytest.mark.parametrize(
    "s, text",
    [
        (0, "0s"),
        (42.9, "42s"),
        (60, "1m"),
        (61, "1m 1s"),
        (3600, "1h"),
        (3725, "1h 2m"),
        (90061, "1d 1h"),
        (7 * 86400, "7d"),
        (None, "-"),
    ],
)
def test_format_duration(s: float | None, text: str) -> None:
    assert display.format_duration(s) == text


def test_format_age_and_ratio() -> None:
    assert display.format_age(1000.0, now=1300.0) == "5m ago"
    assert display.format_age(0, now=1300.0) == "-"
    assert display.format_age(2000.0, now=1300.0) == "just now"
    assert display.format_ratio(1, 3) == "33.3%" and display.format_ratio(1, 0) == "-"
    assert display.format_count(1234567) == "1,234,567"


def test_table_aligns_columns() -> None:
    out = display.table(["name", "n"], [["a", 1], ["long-name", 1000]])
    assert out.splitlines() == ["name          n", "a             1", "long-name  1000"]


STATS = {
    "server": {"endpoint": "ipc:///x.sock", "pid": 42, "uptime": 3725.0, "requests": 1200, "errors": 1},
    "store": {
        "tiers": {
            "hbm": {
                "blocks": 3,
                "used": 3 * 2**20,
                "capacity": 2**30,
                "hits": 9,
                "misses": 1,
                "evictions": 0,
                "demotions": 2,
                "promotions": 0,
                "corrupt": 0,
            },
            "nvme": {
                "blocks": 5,
                "used": 2**20,
                "capacity": 2**36,
                "hits": 0,
                "misses": 0,
                "evictions": 4,
                "demotions": 0,
                "promotions": 1,
                "corrupt": 2,
            },
        },
        "blocks": 5,
        "sessions": 2,
        "namespaces": 1,
        "pinned": 0,
        "write_queue": 0,
        "write_deferred": 0,
        "written": 5,
        "expired": 0,
        "lookups": 4,
        "tokens_asked": 200,  # a lookup and a get of 100 tokens each
        "tokens_matched": 64,
        "tokens_served": 64,
    },
}


def test_render_stats() -> None:
    out = display.render_stats(STATS).splitlines()
    assert out[0] == "kvstore daemon at ipc:///x.sock  pid 42  up 1h 2m  requests 1,200  errors 1"
    hbm = next(line for line in out if line.startswith("hbm")).split()
    assert hbm[:4] == ["hbm", "3", "3.0", "MiB"] and "90.0%" in hbm
    assert any(line.startswith("nvme") and line.endswith("2") for line in out)  # corrupt column
    assert not any(line.startswith("ram") for line in out)  # a tier the daemon did not report
    assert "matched 64, served 64 (hit rate 64.0%)" in out[-1]  # what the metrics export
    # a daemon that sends fewer counters still renders
    assert "blocks -" in display.render_stats({"store": {}, "server": {}})
    # same-host clients' shared memory: on, or off
    shm = {
        "directory": "/dev/shm/kvstore-0",
        "segments": ["a", "b", "c"],
        "staging_bytes": 2**30,
        "staging_used": 3 * 2**20,
        "staging_clients": 2,
        "leases": 1,
        "lapsed": 4,
    }
    on = display.render_stats({**STATS, "server": {**STATS["server"], "shm": shm}}).splitlines()[-1]
    assert on == (
        "shared memory: /dev/shm/kvstore-0, 3 segments; staging 3.0 MiB in use of 1.0 GiB (2 clients); "
        "leases 1, lapsed 4"
    )
    off = display.render_stats({**STATS, "server": {**STATS["server"], "shm": None}}).splitlines()[-1]
    assert off == "shared memory: off (clients use the socket)"


def test_render_sessions_most_recent_first() -> None:
    sessions = [
        {
            "name": "old",
            "model": "m",
            "tenant": "t",
            "tokens": 128,
            "blocks": 2,
            "tiers": {"nvme": 2},
            "created": 100.0,
            "last_access": 100.0,
        },
        {
            "name": "new",
            "model": "m",
            "tenant": "t",
            "tokens": 64,
            "blocks": 1,
            "tiers": {"hbm": 1, "nvme": 1},
            "created": 100.0,
            "last_access": 990.0,
        },
    ]
    out = display.render_sessions(sessions, now=1000.0).splitlines()
    assert out[0].split() == [
        "session",
        "model",
        "tenant",
        "tokens",
        "blocks",
        "hbm",
        "ram",
        "nvme",
        "last",
        "used",
        "created",
    ]
    assert out[1].split()[:8] == ["new", "m", "t", "64", "1", "1", "0", "1"] and "10s ago" in out[1]
    assert out[2].startswith("old") and "15m ago" in out[2]
    assert "no sessions" in display.render_sessions([], now=0.0)


def test_render_session_prefix_evict_prefetch() -> None:
    detail = {
        "info": {
            "name": "s",
            "model": "m",
            "tenant": "t",
            "namespace": "ab",
            "tokens": 8,
            "blocks": 2,
            "tiers": {"hbm": 2},
            "created": 1.0,
            "last_access": 2.0,
        },
        "blocks": [
            {"position": 0, "key": "00" * 32, "tiers": ["hbm", "nvme"], "last_access": 2.0},
            {"position": 1, "key": "11" * 32, "tiers": [], "last_access": 0},
        ],
    }
    out = display.render_session(detail, now=62.0).splitlines()
    assert out[0] == "session s: model m, tenant t, namespace ab"
    assert "2 blocks cached (hbm 2, ram 0, nvme 0)" in out[1]
    assert out[-2].split() == ["0", "0" * 16, "hbm,nvme", "1m", "ago"]
    assert out[-1].split() == ["1", "1" * 16, "-", "-"]
    prefix = display.render_prefix(
        {
            "namespace": "ab",
            "tokens": 10,
            "matched_tokens": 8,
            "blocks": [{"position": 0, "key": "aa" * 32, "tier": "ram"}],
        }
    )
    assert prefix.splitlines()[0] == "namespace ab: 8 of 10 tokens stored in 1 blocks"
    assert display.render_evict({"blocks": 0, "dry_run": True}) == "no blocks matched (dry run)"
    assert (
        display.render_evict({"blocks": 3, "moved": 1, "bytes_freed": {"ram": 2048}, "dry_run": False})
        == "evicted 3 blocks (1 of them moved down a tier); freed ram 2.0 KiB"
    )
    assert (
        display.render_evict(
            {"blocks": 3, "moved": 0, "bytes_freed": {"hbm": 1024, "nvme": 10}, "dry_run": True}
        )
        == "would evict 3 blocks; would free hbm 1.0 KiB, nvme 10 B"
    )
    assert display.render_evict(
        {"blocks": 2, "bytes_freed": {"hbm": 1024}, "not_done": "the cluster is down"}
    ).splitlines() == ["evicted 2 blocks; freed hbm 1.0 KiB", "not done: the cluster is down"]
    assert (
        display.render_prefetch({"session": "s", "to": "hbm", "moved": 2, "present": 1, "failed": 0})
        == "session s: 2 blocks brought up to hbm, 1 already there, 0 failed"
    )


def test_render_prefetch_timing_and_progress() -> None:
    # the CLI's summary adds bytes, wall time and rate
    done = {
        "session": "s",
        "to": "ram",
        "moved": 40,
        "present": 0,
        "failed": 0,
        "bytes_moved": 3 * 2**20,
        "seconds": 0.5,
        "blocks": 40,
        "requests": 3,
    }
    assert (
        display.render_prefetch(done)
        == "session s: 40 blocks brought up to ram, 0 already there, 0 failed; 3.0 MiB moved in 0.50s (6.0 MiB/s)"
    )
    assert display.render_prefetch({**done, "moved": 0, "bytes_moved": 0, "seconds": 0.0}).endswith(
        "; 0 B moved in 0.00s (-)"
    )
    assert [display.format_seconds(x) for x in (0.0421, 12.34, 75, None)] == ["0.04s", "12.3s", "1m 15s", "-"]
    assert display.format_rate(2048, 2.0) == "1.0 KiB/s" and display.format_rate(10, 0) == "-"
    assert display.render_progress(12, 40, 2048, width=10) == "[###.......] 12/40 blocks  2.0 KiB"
    assert display.render_progress(0, 0, 0, width=4) == "[####] 0/0 blocks  0 B"  # an empty session is done


# ---------------------------------------------------------------- real subprocesses


def kvstore_cmd() -> list[str]:
    script = Path(sys.executable).parent / "kvstore"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvstore.cli"]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


def run_cli(*argv: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvstore_cmd(), *argv], input=stdin, capture_output=True, text=True, env=clean_env(), timeout=timeout
    )


def test_no_daemon_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = run_cli("stats", "--endpoint", f"ipc://{tmp_path}/kv.sock")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kvstore: no kvstore daemon is running at ipc://{tmp_path}/kv.sock; "
        "start it with `kvstore serve` (or `./dev serve` in a checkout)"
    ]
    assert r.stdout == ""


def test_stale_socket_times_out_with_a_hint(tmp_path: Path) -> None:
    # a socket file left by a crashed daemon: nobody answers
    path = tmp_path / "kv.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    r = run_cli("inspect", "--endpoint", f"ipc://{path}", "--timeout", "300ms")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "no reply" in r.stderr and "kvstore serve" in r.stderr


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[ram]\ncodec = 'zip'\n")
    r = run_cli("serve", "--config", str(cfg))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kvstore: {cfg}: [ram] codec = 'zip' is not allowed; expected one of fp8, int8, raw"
    ]


LAYOUT_SPEC = "L=2,H=1,D=8,dtype=float16,T=4"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real daemon on an ipc socket with small tiers; yields its config file. Stopped with SIGTERM."""
    root = tmp_path_factory.mktemp("cli")
    cfg = root / "kvstore.toml"
    cfg.write_text(
        f'[server]\nendpoint = "ipc://{root}/run/kv.sock"\nworkers = 2\n'
        '[hbm]\ndevice = "cpu"\ncapacity = "8MiB"\n[ram]\ncapacity = "8MiB"\n'
        f'[nvme]\npath = "{root}/nvme"\ncapacity = "64MiB"\n[policy]\npage_bytes = "4KiB"\n'
    )
    proc = subprocess.Popen(
        [*kvstore_cmd(), "serve", "--config", str(cfg)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sock = root / "run" / "kv.sock"
    deadline = time.monotonic() + 120
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"daemon did not start: {proc.communicate()[0]}")
        time.sleep(0.1)
    try:
        yield cfg
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert proc.returncode == 0, out
        shutil.rmtree(root, ignore_errors=True)


def cli_json(cfg: Path, *argv: str) -> object:
    r = run_cli(*argv, "--config", str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_operator_commands_against_a_real_daemon(daemon: Path, tmp_path: Path) -> None:
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.config import load_config

    layout = parse_layout(LAYOUT_SPEC)
    endpoint = load_config(daemon, env={}).server.endpoint
    with KVStoreClient(endpoint, model="m", layout=layout, timeout=30) as c:
        # conv-42: 3 blocks (+2 tail tokens, not stored); other: 2 blocks of other tokens
        assert c.put(list(range(14)), torch.randn(layout.shape(14)).half(), session="conv-42").stored == 3
        assert c.put(list(range(100, 108)), torch.randn(layout.shape(8)).half(), session="other").stored == 2

    stats = cli_json(daemon, "stats")
    assert isinstance(stats, dict)
    assert (stats["store"]["blocks"], stats["store"]["sessions"]) == (5, 2)
    human = run_cli("stats", "--config", str(daemon))
    assert human.returncode == 0 and "sessions 2" in human.stdout and human.stdout.count("\nhbm ") == 1

    sessions = cli_json(daemon, "inspect")
    assert isinstance(sessions, list)
    assert {(s["name"], s["tokens"], s["blocks"]) for s in sessions} == {("conv-42", 12, 3), ("other", 8, 2)}
    one = run_cli("inspect", "--session", "conv-42", "--config", str(daemon))
    assert one.returncode == 0 and one.stdout.startswith("session conv-42: model m, tenant default")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(13))))
    looked = cli_json(daemon, "stats")
    prefix = cli_json(daemon, "inspect", "--tokens", str(tokens), "--model", "m", "--layout", LAYOUT_SPEC)
    assert isinstance(prefix, dict) and prefix["matched_tokens"] == 12 and len(prefix["blocks"]) == 3
    after = cli_json(daemon, "stats")
    assert isinstance(looked, dict) and isinstance(after, dict)
    assert after["store"]["lookups"] == looked["store"]["lookups"]  # an operator's look is no traffic

    warmed = cli_json(daemon, "prefetch", "--session", "conv-42", "--to", "hbm")
    assert isinstance(warmed, dict) and warmed["moved"] + warmed["present"] == 3 and warmed["failed"] == 0

    # another criterion that selects none of its blocks: the conversation stays (its record was dropped)
    young = run_cli("evict", "--session", "conv-42", "--older-than", "30d", "--config", str(daemon))
    assert young.returncode == 0 and "no blocks matched" in young.stdout and young.stderr == ""
    again = cli_json(daemon, "inspect")
    assert isinstance(again, list) and "conv-42" in {s["name"] for s in again}
    # dry run: reported, nothing changes
    dry = cli_json(daemon, "evict", "--session", "conv-42", "--dry-run")
    assert isinstance(dry, dict) and dry["blocks"] == 3 and dry["dry_run"] is True
    # not a terminal and no --yes: --all is refused, targeted evicts go ahead
    refused = run_cli("evict", "--all", "--config", str(daemon))
    assert refused.returncode == 2 and "add --yes" in refused.stderr
    gone = cli_json(daemon, "evict", "--session", "conv-42")
    assert isinstance(gone, dict) and gone["blocks"] == 3 and len(gone["keys"]) == 3
    with KVStoreClient(endpoint, model="m", layout=layout, timeout=30) as c:
        assert c.lookup(list(range(12))).matched_blocks == 0
        assert c.lookup(list(range(100, 108))).matched_blocks == 2  # the other session is untouched

    missing = run_cli("inspect", "--session", "nope", "--config", str(daemon))
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        "kvstore: no session 'nope'; list them with inspect [not_found]"
    ]
    typo = run_cli("evict", "--session", "nope", "--config", str(daemon))  # nothing to evict, and says why
    assert typo.returncode == 0 and "no blocks matched" in typo.stdout
    assert typo.stderr.strip().splitlines() == ["no session 'nope' here (kvstore inspect lists them)"]


def run_on_terminal(argv: list[str], answer: str) -> tuple[int, str, str]:
    """Run the CLI with a pseudo-terminal as stdin (so it asks), answer the prompt, return (rc, out, err)."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [*kvstore_cmd(), *argv],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        os.write(master, answer.encode() + b"\n")
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    return proc.returncode, out, err


@pytest.mark.slow
def test_evict_asks_on_a_terminal(daemon: Path) -> None:
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.config import load_config

    layout = parse_layout(LAYOUT_SPEC)
    endpoint = load_config(daemon, env={}).server.endpoint
    tokens = list(range(500, 508))
    with KVStoreClient(endpoint, model="m", layout=layout, timeout=30) as c:
        c.put(tokens, torch.randn(layout.shape(8)).half(), session="ask-me")
    # declined: the preview is shown, nothing changes, exit 1
    rc, out, err = run_on_terminal(["evict", "--session", "ask-me", "--config", str(daemon)], "n")
    assert rc == 1 and "would evict 2 blocks" in err and "Proceed? [y/N]" in err and "nothing evicted" in err
    with KVStoreClient(endpoint, model="m", layout=layout, timeout=30) as c:
        assert c.lookup(tokens).matched_blocks == 2
    # accepted
    rc, out, err = run_on_terminal(["evict", "--session", "ask-me", "--config", str(daemon)], "y")
    assert rc == 0 and out.startswith("evicted 2 blocks; freed hbm")
    with KVStoreClient(endpoint, model="m", layout=layout, timeout=30) as c:
        assert c.lookup(tokens).matched_blocks == 0


# ---------------------------------------------------------------- restart, prefetch, metrics


def write_daemon_config(root: Path, **server: object) -> Path:
    """Small tiers like the module's daemon, its own socket and LMDB under ``root``."""
    extra = "".join(f"{k} = {v}\n" for k, v in server.items())
    cfg = root / "kvstore.toml"
    cfg.write_text(
        f'[server]\nendpoint = "ipc://{root}/run/kv.sock"\nworkers = 2\n{extra}'
        '[hbm]\ndevice = "cpu"\ncapacity = "8MiB"\n[ram]\ncapacity = "8MiB"\n'
        f'[nvme]\npath = "{root}/nvme"\ncapacity = "64MiB"\n[policy]\npage_bytes = "4KiB"\n'
    )
    return cfg


def serve(cfg: Path) -> subprocess.Popen[str]:
    """``kvstore serve --config cfg``, returned once it answers a ping."""
    import zmq

    from kvstore.config import load_config
    from kvstore.daemon.endpoint import probe

    endpoint = load_config(cfg, env={}).server.endpoint
    proc = subprocess.Popen(
        [*kvstore_cmd(), "serve", "--config", str(cfg)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + 120
        while probe(ctx, endpoint, timeout_ms=200) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"daemon did not start: {proc.communicate()[0]}")
            time.sleep(0.1)
    finally:
        ctx.destroy(linger=0)
    return proc


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, as an operator (or systemd) would; the daemon must flush and exit 0. Returns its output."""
    proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, out
    return out


def block_tiers(cfg: Path, session: str) -> list[list[str]]:
    detail = cli_json(cfg, "inspect", "--session", session)
    assert isinstance(detail, dict)
    return [b["tiers"] for b in detail["blocks"]]


def run_with_terminal_stderr(argv: list[str]) -> tuple[int, str, str]:
    """Run the CLI with a pseudo-terminal as stderr (so it draws its bar); returns (rc, stdout, stderr)."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [*kvstore_cmd(), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=clean_env(),
        )
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        out = proc.communicate(timeout=120)[0]
    finally:
        os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_prefetch_warms_a_session_up_from_nvme_after_a_restart(tmp_path: Path) -> None:
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.config import load_config

    cfg = write_daemon_config(tmp_path)
    layout = parse_layout(LAYOUT_SPEC)
    proc = serve(cfg)
    try:
        with KVStoreClient(
            load_config(cfg, env={}).server.endpoint, model="m", layout=layout, timeout=30
        ) as c:
            # conv-9: 5 blocks of 4 tokens
            assert c.put(list(range(20)), torch.randn(layout.shape(20)).half(), session="conv-9").stored == 5
        assert all("hbm" in t for t in block_tiers(cfg, "conv-9"))
    finally:
        stop(proc)  # flushes the write-through queue: every block is on nvme
    proc = serve(cfg)
    try:
        # restarted: the memory tiers are empty, the session's blocks sit on nvme only
        assert block_tiers(cfg, "conv-9") == [["nvme"]] * 5

        # piped stderr: no bar; 2 blocks per request -> 3 requests; the summary names time and bytes
        r = run_cli("prefetch", "--session", "conv-9", "--to", "ram", "--chunk", "2", "--config", str(cfg))
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""
        head, _, timing = r.stdout.strip().partition("; ")
        assert head == "session conv-9: 5 blocks brought up to ram, 0 already there, 0 failed"
        m = re.fullmatch(r"(\d+(?:\.\d)?) (B|KiB|MiB) moved in (\d+\.\d+)s \((.+)/s\)", timing)
        assert m is not None, timing
        assert float(m.group(1)) > 0 and m.group(2) != "B"  # 5 blocks, a 4 KiB ram page or more each
        assert [sorted(t) for t in block_tiers(cfg, "conv-9")] == [["nvme", "ram"]] * 5

        # --json: the sums, the request count and the seconds, for scripts
        again = cli_json(cfg, "prefetch", "--session", "conv-9", "--to", "ram", "--chunk", "2")
        assert isinstance(again, dict)
        assert (
            again["moved"],
            again["present"],
            again["failed"],
            again["blocks"],
            again["requests"],
            again["bytes_moved"],
        ) == (0, 5, 0, 5, 3, 0)
        assert again["seconds"] >= 0

        # on a terminal the bar is drawn on stderr, and stdout still gets the summary alone
        rc, out, err = run_with_terminal_stderr(
            ["prefetch", "--session", "conv-9", "--to", "hbm", "--chunk", "2", "--config", str(cfg)]
        )
        assert rc == 0, err
        assert out.startswith("session conv-9: 5 blocks brought up to hbm") and "moved in" in out
        assert "[" in err and "5/5 blocks" in err and "2/5 blocks" in err  # every chunk redrew it
        assert all("hbm" in t for t in block_tiers(cfg, "conv-9"))
        # --json on a terminal: no bar
        rc, out, err = run_with_terminal_stderr(
            ["prefetch", "--session", "conv-9", "--to", "hbm", "--json", "--config", str(cfg)]
        )
        assert rc == 0 and "blocks" not in err and json.loads(out)["present"] == 5

        missing = run_cli("prefetch", "--session", "nope", "--config", str(cfg))
        assert missing.returncode == 1
        assert missing.stderr.strip().splitlines() == ["kvstore: no session 'nope' to prefetch [not_found]"]
    finally:
        stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_metrics_endpoint_agrees_with_kvstore_stats(tmp_path: Path) -> None:
    import urllib.request

    import torch
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore.client import KVStoreClient
    from kvstore.config import load_config

    port = free_port()
    cfg = write_daemon_config(tmp_path, metrics_port=port)
    layout = parse_layout(LAYOUT_SPEC)
    proc = serve(cfg)
    try:
        with KVStoreClient(
            load_config(cfg, env={}).server.endpoint, model="m", layout=layout, timeout=30
        ) as c:
            a, b = list(range(12)), list(range(100, 108))
            assert c.put(a, torch.randn(layout.shape(12)).half(), session="a").stored == 3
            assert c.put(b, torch.randn(layout.shape(8)).half(), session="b").stored == 2
            assert c.get(a).matched_blocks == 3
            assert c.get(b).matched_blocks == 2
            assert c.get(list(range(500, 508))).matched_blocks == 0  # a miss
            assert c.flush(timeout=30)  # nvme is written through: nothing moves between stats and scrape
        stats = cli_json(cfg, "stats")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        stop(proc)
    assert isinstance(stats, dict)
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    tiers = stats["store"]["tiers"]
    assert (
        set(tiers) == {"hbm", "ram", "nvme"} and tiers["hbm"]["blocks"] == 5 and tiers["nvme"]["blocks"] == 5
    )
    for tier, t in tiers.items():
        label = (("tier", tier),)
        assert samples[("kvstore_tier_blocks", label)] == t["blocks"], tier
        assert samples[("kvstore_tier_used_bytes", label)] == t["used"], tier
        assert samples[("kvstore_tier_capacity_bytes", label)] == t["capacity"], tier
        assert samples[("kvstore_tier_hits_total", label)] == t["hits"], tier
        assert samples[("kvstore_tier_misses_total", label)] == t["misses"], tier
    store = stats["store"]
    assert samples[("kvstore_blocks", ())] == store["blocks"] == 5
    assert samples[("kvstore_sessions", ())] == store["sessions"] == 2
    assert samples[("kvstore_lookups_total", ())] == store["lookups"]
    assert samples[("kvstore_tokens_served_total", ())] == store["tokens_served"] == 20
    # every request the daemon counted (this stats call and its hello included) is in kvstore_requests_total
    requests = {
        dict(labels)["op"] + "/" + dict(labels)["code"]: v
        for (name, labels), v in samples.items()
        if name == "kvstore_requests_total"
    }
    assert sum(requests.values()) == stats["server"]["requests"]
    # replies other than ok: none but "starting", while the daemon was still building its store
    errors = {k: v for k, v in requests.items() if not k.endswith("/ok") and not k.endswith("/starting")}
    assert sum(errors.values()) == stats["server"]["errors"] == 0, errors
    # a same-host client puts through commit and gets through locate (shared memory)
    assert requests.get("put/ok", 0) + requests.get("commit/ok", 0) >= 2
    assert requests.get("get/ok", 0) + requests.get("locate/ok", 0) >= 3 and requests["stats/ok"] == 1


def test_names_with_control_characters_print_escaped() -> None:
    # a row written by an earlier build may hold any character; what reaches the terminal must not
    # be a command to it
    evil = {
        "name": "conv\x1b]0;pwned\x07",
        "model": "m\x1b[2J",
        "tenant": "t\u202eevil",
        "namespace": "ns\r",
        "tokens": 64,
        "blocks": 1,
        "tiers": {"hbm": 1},
        "last_access": 10.0,
        "created": 5.0,
    }
    outputs = [
        display.render_sessions([evil], now=20.0),
        display.render_session({"info": evil, "blocks": []}, now=20.0),
        display.render_prefix({"namespace": evil["namespace"], "tokens": 4, "matched_tokens": 0}),
        display.render_prefetch({"session": evil["name"], "to": "ram", "moved": 0}),
    ]
    for out in outputs:
        assert not any(c in out for c in "\x1b\x07\r\u202e"), out
    assert "conv\\x1b]0;pwned\\x07" in outputs[0] and "t\\u202eevil" in outputs[0]
    assert "m\\x1b[2J" in outputs[1] and "ns\\r" in outputs[1]
    assert display.printable("plain — été") == "plain — été"
