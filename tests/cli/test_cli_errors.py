"""The ``kvstore`` command's mistakes and a peer's: one line on stderr and an exit code, never a traceback.

Real subprocesses against a real daemon, and against a fake one: a ZeroMQ ROUTER on an ipc socket
that speaks the envelope of kvstore's protocol but answers with data of the wrong shape (another
version of kvstore, or another program on the socket).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvstore.cli.parser import (
    DEMO_ANSWER_MAX,
    DEMO_DOCUMENT_MAX,
    PREFETCH_CHUNK_MAX,
    parse_args,
    parse_layout,
)
from kvstore.errors import ConfigError
from kvstore.wire.errors import RemoteProtocolError
from kvstore.wire.protocol import PROTOCOL_VERSION
from tests.cli.harness import (
    LAYOUT_SPEC,
    clean_env,
    kvstore_cmd,
    run_cli,
    serve,
    stop,
    usage_error,
    write_daemon_config,
)

# ---------------------------------------------------------------- a fake daemon

Answer = Callable[[dict[str, Any]], list[bytes]]


def reply(head: dict[str, Any], **fields: Any) -> list[bytes]:
    """A well-formed envelope answering ``head`` (its op and id) with ``fields``."""
    return [msgpack.packb({"v": PROTOCOL_VERSION, "op": head["op"], "id": head["id"], **fields})]


class FakeDaemon:
    """A ROUTER on ``ipc://path`` answering every request with ``answer(header)``; on its own thread."""

    def __init__(self, path: Path, answer: Answer) -> None:
        self.endpoint = f"ipc://{path}"
        self.requests: list[str] = []
        self._answer = answer
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind(self.endpoint)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._done.is_set():
            if not self._sock.poll(50):
                continue
            peer, header, *_ = self._sock.recv_multipart()
            head = msgpack.unpackb(header)
            self.requests.append(head["op"])
            self._sock.send_multipart([peer, *self._answer(head)])

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Callable[[Answer], FakeDaemon]]:
    started: list[FakeDaemon] = []

    def start(answer: Answer) -> FakeDaemon:
        d = FakeDaemon(tmp_path / f"fake-{len(started)}.sock", answer)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The single line of stderr a failed command leaves."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore: "), r.stderr
    return lines[0]


SESSION = {
    "name": "s",
    "namespace": "ab",
    "model": "m",
    "tenant": "default",
    "tokens": 8,
    "blocks": 2,
    "tiers": {"hbm": 2},
    "created": 1.0,
    "last_access": 2.0,
}


@pytest.mark.parametrize(
    "argv, fields, said",
    [
        (["stats"], {"data": [1, 2, 3]}, "stats reply is malformed: its data is list [1, 2, 3], not a map"),
        (["stats"], {"data": {"store": 5}}, "stats reply is malformed: 'store' is int 5, not a map"),
        (["inspect"], {"data": 5}, "inspect reply is malformed: its data is int 5, not a list"),
        (["inspect"], {"data": [{"name": "s"}]}, "a SessionInfo has no 'namespace'"),
        (
            ["inspect"],
            {"data": [{**SESSION, "tiers": {"hbm": "2"}}]},
            "a SessionInfo's 'tiers' is {'hbm': '2'}, not dict[str, int]",
        ),
        (["inspect", "--session", "s"], {"data": {"info": SESSION}}, "'blocks' is NoneType None, not a list"),
        (
            ["inspect", "--session", "s"],
            {
                "data": {
                    "info": SESSION,
                    "blocks": [{"position": "0", "key": "00", "tiers": [], "last_access": 0}],
                }
            },
            "a BlockInfo's 'position' is '0', not int",
        ),
        (
            ["prefetch", "--session", "s"],
            {"data": {"session": "s", "to": "ram"}},
            "a PrefetchResult has no 'moved'",
        ),
        (
            ["evict", "--session", "s"],
            {"blocks": 1, "bytes_freed": {"hbm": "lots"}, "moved": 0, "keys": []},
            "the daemon's evict reply is malformed",
        ),
        # the renderings take fields that are missing, not fields of another type
        (
            ["stats"],
            {"data": {"store": {"tiers": {"hbm": {"hits": "many"}}}, "server": {}}},
            "the daemon's reply has a field this kvstore cannot show (TypeError",
        ),
    ],
)
def test_a_reply_of_the_wrong_shape_is_one_line_and_exit_1(
    fake: Callable[[Answer], FakeDaemon], argv: list[str], fields: dict[str, Any], said: str
) -> None:
    d = fake(lambda head: reply(head, **fields))
    r = run_cli(*argv, "--endpoint", d.endpoint, "--timeout", "10s")
    assert r.returncode == 1 and r.stdout == ""
    line = one_line(r)
    assert said in line, line
    # evict --session first asks which sessions there are (for its hint on a name it does not know)
    assert d.requests == ["inspect"] * (argv[:2] == ["evict", "--session"]) + [argv[0]]


def test_json_prints_a_reply_it_cannot_render_as_it_came(fake: Callable[[Answer], FakeDaemon]) -> None:
    data = {"store": {"tiers": {"hbm": {"hits": "many"}}}, "server": {}}
    d = fake(lambda head: reply(head, data=data))
    r = run_cli("stats", "--json", "--endpoint", d.endpoint, "--timeout", "10s")
    assert r.returncode == 0 and json.loads(r.stdout) == data, r.stderr


def test_a_reply_that_is_not_msgpack_is_one_line(fake: Callable[[Answer], FakeDaemon]) -> None:
    d = fake(lambda head: [b"\xc1 not msgpack"])
    r = run_cli("stats", "--endpoint", d.endpoint, "--timeout", "10s")
    assert r.returncode == 1 and "not valid msgpack" in one_line(r)


def test_the_library_raises_a_protocol_error_for_a_malformed_put_reply(
    fake: Callable[[Answer], FakeDaemon],
) -> None:
    import torch

    from kvstore.client import KVStoreClient

    def answer(head: dict[str, Any]) -> list[bytes]:
        if head["op"] == "hello":
            limits = {"max_message_bytes": 2**20, "max_tokens": 4096, "max_inflight": 8}
            return reply(head, ns="fake", limits=limits, server="fake")
        return reply(head, stored=0, present=0, failed=[[0, "no_room"]], deferred=0)  # no message

    d = fake(answer)
    layout = parse_layout(LAYOUT_SPEC)
    with KVStoreClient(d.endpoint, model="m", layout=layout, timeout=10, retries=0, shared_memory=False) as c:
        with pytest.raises(
            RemoteProtocolError, match=r"put reply is malformed: a failed block is \[0, 'no_room'\]"
        ):
            c.put(list(range(8)), torch.zeros(layout.shape(8), dtype=torch.float16))


# ---------------------------------------------------------------- endpoints a client cannot use


@pytest.mark.parametrize(
    "endpoint, said",
    [
        ("tcp://*:5555", "is where a daemon listens (every interface)"),
        ("tcp://127.0.0.1:*", "is where a daemon listens (any free port)"),
        ("tcp://127.0.0.1:0", "is where a daemon listens (any free port)"),
    ],
)
def test_a_listening_endpoint_is_refused_for_connecting(
    endpoint: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(["stats", "--endpoint", endpoint], capsys)
    assert "kvstore stats: error: argument --endpoint:" in err and said in err
    assert parse_args(["serve", "--endpoint", endpoint]).endpoint == endpoint  # where serve listens
    from kvstore.client import KVStoreClient

    with pytest.raises(ConfigError, match="not an address to connect to"):
        KVStoreClient(endpoint)


@pytest.mark.parametrize("command", [["serve"], ["stats"], ["inspect"]])
def test_an_inproc_endpoint_is_refused_by_the_cli_at_once(command: list[str]) -> None:
    # a daemon served there was reached by nobody, and a command waited its timeout for no reply
    r = run_cli(*command, "--endpoint", "inproc://x", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "kvstore: endpoint 'inproc://x' reaches only clients in the daemon's own process, and a command "
        "of the CLI runs in its own: give the daemon an ipc:// or tcp:// endpoint"
    ]


def test_a_wildcard_endpoint_is_one_line_from_the_flag_and_from_the_daemons_config(tmp_path: Path) -> None:
    r = run_cli("inspect", "--endpoint", "tcp://*:5555")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "connect to tcp://HOST:5555 with the daemon's host name or address" in r.stderr
    # the operator points the CLI at the daemon's own config, which says where the daemon listens
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nendpoint = "tcp://*:5555"\nallow_insecure_tcp = true\n')
    r = run_cli("stats", "--config", str(cfg))
    assert r.returncode == 2
    assert one_line(r).startswith(
        "kvstore: endpoint 'tcp://*:5555' is where a daemon listens (every interface), not an address "
        "to connect to; connect to tcp://HOST:5555"
    )


# ---------------------------------------------------------------- a real daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cfg = write_daemon_config(tmp_path_factory.mktemp("cli-errors"))
    proc = serve(cfg)
    try:
        yield cfg
    finally:
        stop(proc)


@pytest.mark.slow
def test_prefetch_chunk_is_bounded(daemon: Path) -> None:
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.config import load_config

    layout = parse_layout(LAYOUT_SPEC)
    with KVStoreClient(
        load_config(daemon, env={}).server.endpoint, model="m", layout=layout, timeout=30
    ) as c:
        assert c.put(list(range(20)), torch.randn(layout.shape(20)).half(), session="chunky").stored == 5
    # the largest chunk: the whole session in one request
    r = run_cli(
        "prefetch",
        "--session",
        "chunky",
        "--chunk",
        str(PREFETCH_CHUNK_MAX),
        "--json",
        "--config",
        str(daemon),
    )
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    assert (done["requests"], done["moved"] + done["present"], done["failed"]) == (1, 5, 0)
    # one more is a usage error (10**26 was an OverflowError from msgpack)
    for n in (PREFETCH_CHUNK_MAX + 1, 10**26):
        r = run_cli("prefetch", "--session", "chunky", "--chunk", str(n), "--config", str(daemon))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"argument --chunk: {n} is over {PREFETCH_CHUNK_MAX}" in r.stderr


@pytest.mark.slow
def test_a_relative_ipc_endpoint_names_one_socket_from_any_directory(tmp_path: Path) -> None:
    # the daemon starts in its directory, the operator runs the CLI from elsewhere with the same file
    home = tmp_path / "daemon"
    home.mkdir()
    cfg = write_daemon_config(home)
    cfg.write_text(cfg.read_text().replace(f"ipc://{home}/run/kv.sock", "ipc://run/kv.sock"))
    proc = subprocess.Popen(
        [*kvstore_cmd(), "serve", "--config", str(cfg)],
        cwd=home,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (home / "run" / "kv.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not bind run/kv.sock"
            time.sleep(0.1)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        r = subprocess.run(
            [*kvstore_cmd(), "stats", "--json", "--timeout", "60s", "--config", str(cfg)],
            cwd=elsewhere,
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["server"]["endpoint"] == f"ipc://{home}/run/kv.sock"
    finally:
        stop(proc)


def test_demo_lengths_are_bounded_by_the_models_context() -> None:
    # the conversation must fit SmolLM2's 8192 positions: a longer one is a usage error, not a
    # document built and a model run out of positions minutes later
    for flag, most in (("--document-tokens", DEMO_DOCUMENT_MAX), ("--max-new-tokens", DEMO_ANSWER_MAX)):
        assert getattr(parse_args(["demo", flag, str(most)]), flag[2:].replace("-", "_")) == most
        r = run_cli("demo", flag, str(most + 1))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"argument {flag}: {most + 1} is over {most}" in r.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--session", "\udcff"],  # a shell's $'\xff': bytes that are no UTF-8
        ["evict", "--model", "x\udcff"],
        ["evict", "--tenant", "\udcff", "--dry-run"],
        ["serve", "--endpoint", "ipc:///tmp/\udcff.sock"],
    ],
)
def test_an_argument_that_is_no_utf8_is_a_usage_error_naming_it(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(argv, capsys)
    assert "valid UTF-8 text" in err and f"argument {argv[1]}" in err


def test_an_endpoint_path_too_long_for_the_filesystem_is_one_line(tmp_path: Path) -> None:
    r = run_cli("stats", "--endpoint", f"ipc://{tmp_path}/{'a' * 300}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert one_line(r).startswith("kvstore: cannot reach the daemon at ipc://") and "too long" in r.stderr


def test_a_file_path_that_is_no_utf8_is_taken_as_a_path() -> None:
    """A file may be named with any bytes: only what reaches the daemon as text must be UTF-8."""
    assert parse_args(["stats", "--config", "/tmp/\udcff.toml"]).config == "/tmp/\udcff.toml"


# ---------------------------------------------------------------- input a shell passes as given


@pytest.mark.parametrize(
    "argv, said",
    [
        (["evict", "--older-than", "9" * 400 + "d", "--dry-run"], "must be positive and finite"),
        (["stats", "--timeout", "9" * 400 + "s"], "must be positive and finite"),
        (["evict", "--session", "", "--yes"], "argument --session: must not be empty"),
        (["prefetch", "--session", "s" * 201], "a session name is at most 200 bytes"),
        (["inspect", "--session", "a\nb"], "no NUL or line break"),
        (
            ["inspect", "--tokens", "t.json", "--model", "m", "--layout", LAYOUT_SPEC, "--tenant", ""],
            "--tenant",
        ),
        (["stats", "--endpoint", "tcp://host/x:5555"], "argument --endpoint"),
        (["stats", "--endpoint", "tcp://a b:5"], "argument --endpoint"),
        (
            ["stats", "--endpoint", "ipc://~nosuchuser/kv.sock"],
            "'~nosuchuser' in '~nosuchuser/kv.sock' is not known",
        ),
    ],
)
def test_input_the_parser_refuses_is_a_usage_error(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in usage_error(argv, capsys)


def test_the_cli_s_session_name_limit_is_the_store_s() -> None:
    from kvstore.cli import parser
    from kvstore.store import sessions

    assert parser.MAX_SESSION_BYTES == sessions.MAX_SESSION_BYTES


@pytest.mark.parametrize(
    "argv, env, said",
    [
        (["keygen", "--out", "~nosuchuser/keys"], {}, "the home directory of '~nosuchuser'"),
        (["stats", "--config", "~nosuchuser/c.toml"], {}, "the home directory of '~nosuchuser'"),
        (
            ["stats"],
            {"KVSTORE_NVME_PATH": "~nosuchuser/x"},
            "KVSTORE_NVME_PATH: [nvme] path = '~nosuchuser/x'",
        ),
        (["stats"], {"KVSTORE_ENDPOINT": "tcp://http://h:5555"}, "KVSTORE_ENDPOINT: [server] endpoint"),
        (["stats"], {"KVSTORE_ENDPOINT": "tcp://h\udcff:5555"}, "KVSTORE_ENDPOINT: [server] endpoint"),
        (
            ["stats"],
            {"KVSTORE_ENDPOINT": "ipc:///tmp/\udcff.sock"},
            "expected an endpoint in valid UTF-8 text",
        ),
    ],
)
def test_paths_and_endpoints_from_files_and_the_environment_are_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], said: str
) -> None:
    r = subprocess.run(
        [*kvstore_cmd(), *argv], capture_output=True, text=True, env={**clean_env(), **env}, timeout=60
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert said in one_line(r)


def test_a_token_file_nested_too_deep_is_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    r = run_cli("inspect", "--tokens", str(deep), "--model", "m", "--layout", LAYOUT_SPEC)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "must hold token ids" in one_line(r)


def test_output_that_cannot_be_written_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [*kvstore_cmd(), "keygen", "--out", str(tmp_path / "keys")],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
            timeout=60,
        )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["kvstore: No space left on device"]


def test_closed_standard_streams_are_one_line(tmp_path: Path) -> None:
    # stdin or stdout closed (a cron line, `>&-`) was an AttributeError traceback
    import shlex

    cli = " ".join(shlex.quote(c) for c in kvstore_cmd())
    ep = f"ipc://{tmp_path}/kv.sock"

    def run(line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", line], capture_output=True, text=True, env=clean_env(), timeout=60
        )

    r = run(f"{cli} stats --endpoint {ep} >&-")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "kvstore: standard output is closed; nothing can be printed"
    ]
    r = run(f"{cli} evict --older-than 30d --endpoint {ep} <&-")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no kvstore daemon" in r.stderr, r.stderr
    r = run(f"{cli} inspect --tokens - --model m --layout L=2,H=1,D=8,dtype=float16,T=4 --endpoint {ep} <&-")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "standard input" in r.stderr, r.stderr


def test_a_nul_in_a_path_and_a_blank_key_name_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[nvme]\npath = "a\\u0000b"\n')
    r = run_cli("serve", "--config", str(cfg))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "[nvme] path = 'a\\x00b' is not allowed" in one_line(r)
    r = run_cli("keygen", "--name", " ", "--out", str(tmp_path / "keys"))
    assert (
        r.returncode == 2
        and one_line(r) == "kvstore: key name ' ' must be a plain file name like 'server' or 'client'"
    )
    assert not (tmp_path / "keys").exists()


def test_version_is_printed() -> None:
    from kvstore import __version__

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvstore {__version__}"


@pytest.mark.slow
def test_tokens_past_the_daemons_limit_are_a_usage_error(tmp_path: Path) -> None:
    cfg = write_daemon_config(tmp_path, max_tokens_per_request=16)
    proc = serve(cfg)
    try:
        tokens = tmp_path / "t.json"
        tokens.write_text(json.dumps(list(range(40))))
        r = run_cli(
            "inspect", "--tokens", str(tokens), "--model", "m", "--layout", LAYOUT_SPEC, "--config", str(cfg)
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "16" in r.stderr, r.stderr
    finally:
        stop(proc)
