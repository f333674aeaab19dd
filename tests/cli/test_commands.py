"""The ``kvstore`` command as an operator runs it: real subprocesses against a real daemon.

Many short stories, one per command and operator mistake.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.commands import Unreachable, check_reachable, plain, resolve_endpoint
from kvstore.cli.parser import parse_args, parse_layout
from kvstore.errors import ConfigError
from kvstore.results import EvictResult
from tests.cli.harness import LAYOUT_SPEC, clean_env, kvstore_cmd, run_cli, serve, stop, write_daemon_config


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
    # --endpoint wins, but a --config named beside it is still read: a wrong one is said so
    both = ["stats", "--endpoint", "ipc:///tmp/flag.sock", "--config"]
    assert resolve_endpoint(parse_args([*both, str(cfg)])) == "ipc:///tmp/flag.sock"
    with pytest.raises(ConfigError):
        resolve_endpoint(parse_args([*both, str(tmp_path / "missing.toml")]))
    (tmp_path / "bad.toml").write_text("[server]\nendpoint = 5\n")
    with pytest.raises(ConfigError):
        resolve_endpoint(parse_args([*both, str(tmp_path / "bad.toml")]))


def test_plain_makes_results_json_ready() -> None:
    r = plain(EvictResult(blocks=1, bytes_freed={"hbm": 10}, moved=0, keys=[b"\x01\xff"], dry_run=True))
    assert r == {
        "blocks": 1,
        "bytes_freed": {"hbm": 10},
        "moved": 0,
        "keys": ["01ff"],
        "dry_run": True,
        "not_done": "",
        "displaced": 0,
    }
    assert json.loads(json.dumps(r)) == r


def test_no_daemon_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = run_cli("stats", "--endpoint", f"ipc://{tmp_path}/kv.sock")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kvstore: no kvstore daemon is running at ipc://{tmp_path}/kv.sock; "
        "start it with `kvstore serve` (or `./dev serve` in a checkout)"
    ]
    assert r.stdout == ""


def stale_socket(tmp_path: Path) -> Path:
    """A socket file left by a crashed daemon: nothing listens on it."""
    path = tmp_path / "kv.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def test_stale_socket_times_out_with_a_hint(tmp_path: Path) -> None:
    # a socket file left by a crashed daemon: nobody answers
    path = stale_socket(tmp_path)
    r = run_cli("inspect", "--endpoint", f"ipc://{path}", "--timeout", "300ms")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "no reply" in r.stderr and "kvstore serve" in r.stderr


@pytest.mark.slow
def test_a_stale_socket_past_the_grace_says_how_to_start_a_daemon_once(tmp_path: Path) -> None:
    # with a timeout past the grace nothing listens for, the client says no daemon runs, and how to
    # start one; the CLI added "If it is not, start it ..." after it: two hints, one contradicting it
    path = stale_socket(tmp_path)
    r = run_cli("inspect", "--endpoint", f"ipc://{path}", "--timeout", "20s")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no kvstore daemon is running" in r.stderr and r.stderr.count("kvstore serve") == 1
    assert "If it is not" not in r.stderr


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[ram]\ncodec = 'zip'\n")
    r = run_cli("serve", "--config", str(cfg))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kvstore: {cfg}: [ram] codec = 'zip' is not allowed; expected one of fp8, int8, raw"
    ]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real daemon on an ipc socket with small tiers; yields its config file. Stopped with SIGTERM."""
    root = tmp_path_factory.mktemp("cli")
    cfg = write_daemon_config(root)
    proc = serve(cfg)
    try:
        yield cfg
    finally:
        stop(proc)
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
    assert typo.returncode == 1 and "no blocks matched" in typo.stdout  # as inspect: scripts see it
    assert typo.stderr.strip().splitlines() == ["no session 'nope' here (kvstore inspect lists them)"]
    typo = run_cli("evict", "--session", "nope", "--json", "--config", str(daemon))
    assert (
        typo.returncode == 1 and json.loads(typo.stdout)["blocks"] == 0
    )  # --json: the same exit, the same hint
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
    # nothing to evict: nothing asked, and what is said is what was done, not a dry run
    rc, out, err = run_on_terminal(["evict", "--older-than", "3650d", "--config", str(daemon)], "y")
    assert rc == 0 and out.strip() == "no blocks matched" and "Proceed" not in err


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
    # every frame on disk damaged: the first block cannot be read, the prefetch stops there, exit 1
    import lmdb

    env = lmdb.open(str(load_config(cfg, env={}).nvme.path), max_dbs=8, subdir=True)
    try:
        with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
            for key, frame in list(txn.cursor()):
                txn.put(key, frame[:-1] + bytes([frame[-1] ^ 0xFF]))
    finally:
        env.close()
    proc = serve(cfg)
    try:
        r = run_cli("prefetch", "--session", "conv-9", "--to", "ram", "--config", str(cfg))
        assert r.returncode == 1 and " 1 failed" in r.stdout, (r.stdout, r.stderr)
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


def test_an_endpoint_whose_lock_a_live_daemon_holds_is_not_said_to_have_no_daemon(tmp_path: Path) -> None:
    """Between taking its endpoint's lock and binding the socket a daemon is starting: the CLI does not
    fail fast saying none runs (the client waits for the socket, then hears "starting"); a lock file
    naming a dead process is a daemon gone, as before."""
    endpoint = f"ipc://{tmp_path}/kv.sock"
    lock = tmp_path / "kv.sock.lock"
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(f"{starting.pid}\n")
        check_reachable(endpoint)  # no Unreachable
        old = time.time() - 600  # written long ago: a stopped daemon's pid, reused since
        os.utime(lock, (old, old))
        with pytest.raises(Unreachable, match="no kvstore daemon is running"):
            check_reachable(endpoint)
        lock.write_text(f"{starting.pid}\n")
    finally:
        starting.kill()
        starting.wait()
    with pytest.raises(Unreachable, match="no kvstore daemon is running"):
        check_reachable(endpoint)  # the pid is gone
    lock.write_text("not a pid\n")
    with pytest.raises(Unreachable, match="no kvstore daemon is running"):
        check_reachable(endpoint)
