"""Authentication: CURVE keys, the allow-list, the ZAP handler, and what an unknown key gets (nothing)."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvstore.cli import commands as cli
from kvstore.client import KVStoreClient
from kvstore.config import with_overrides
from kvstore.daemon.auth import ClientKeys, ServerAuth, parse_allow_list, read_allow_list, write_keypair
from kvstore.daemon.endpoint import UnsafeEndpoint, secure_dir
from kvstore.daemon.process import serve
from kvstore.errors import ConfigError, Forbidden, KVStoreError
from kvstore.wire.errors import RequestTimeout
from tests.hardening.conftest import (
    LAYOUT,
    MODEL,
    T,
    assert_exact,
    loaded,
    prefix_kv,
    random_tokens,
    write_config,
)
from tests.hardening.curve_daemon import CurveDaemon, start_curve_daemon

# ---------------------------------------------------------------- keys and key files (no daemon)


def test_keygen_writes_a_private_pair_and_prints_the_public_key(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "keys"
    assert cli.main(["keygen", "--out", str(out), "--name", "server"]) == 0
    printed = capsys.readouterr().out.strip()
    # stdout is the public key alone; the files hold the pair, the secret one private
    assert (out / "server.key").read_text().strip() == printed
    secret = (out / "server.key_secret").read_text().split()[-1].encode()
    assert zmq.curve_public(secret) == printed.encode()
    assert stat.S_IMODE(os.stat(out / "server.key_secret").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
    # a second run never overwrites a pair by accident
    assert cli.main(["keygen", "--out", str(out), "--name", "server"]) == cli.EXIT_USAGE
    assert "--force" in capsys.readouterr().err
    assert (out / "server.key").read_text().strip() == printed
    assert cli.main(["keygen", "--out", str(out), "--name", "server", "--force", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["public_key"] != printed and Path(data["secret_file"]) == out / "server.key_secret"


def test_allow_list_maps_each_key_to_its_tenant(tmp_path: Path) -> None:
    a, b, op = (zmq.curve_keypair()[0].decode() for _ in range(3))
    text = f"# clients of the daemon\n{a} alice\n\n{b}   team-b.prod   # a comment\n{op} *\n"
    assert parse_allow_list(text, "clients") == {
        a.encode(): "alice",
        b.encode(): "team-b.prod",
        op.encode(): "*",
    }


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_an_allow_list_or_secret_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    # mode 0644 is fine for an allow list, but its owner could rewrite it and put the mode back
    from kvstore.daemon.auth import check_private
    from kvstore.errors import ConfigError

    listed = tmp_path / "clients"
    listed.write_text(f"{zmq.curve_keypair()[0].decode()} alice\n")
    listed.chmod(0o644)
    assert list(read_allow_list(listed).values()) == ["alice"]
    os.chown(listed, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to user 4242"):
        read_allow_list(listed)
    secret = tmp_path / "server.key_secret"
    secret.write_text("x\n")
    secret.chmod(0o600)
    check_private(secret, "curve_secret_key")
    os.chown(secret, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to user 4242"):
        check_private(secret, "curve_secret_key")


@pytest.mark.parametrize(
    "line, complaint",
    [
        ("{key}", "expected '<Z85 public key> <tenant>'"),  # no tenant
        ("{key} alice extra", "expected '<Z85 public key> <tenant>'"),
        ("not-a-key alice", "is not a CURVE key"),
        ("{key} al/ice", "tenant 'al/ice'"),  # would break session qualification
        ("{key} alice\n{key} bob", "already listed for tenant 'alice'"),
    ],
)
def test_allow_list_refuses_malformed_lines(line: str, complaint: str) -> None:
    key = zmq.curve_keypair()[0].decode()
    with pytest.raises(ConfigError, match="clients line") as e:
        parse_allow_list(line.format(key=key), "clients")
    assert complaint in str(e.value)


def test_allow_list_others_can_write_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "clients"
    path.write_text(f"{zmq.curve_keypair()[0].decode()} alice\n")
    os.chmod(path, 0o666)
    with pytest.raises(ConfigError, match="chmod go-w"):
        read_allow_list(path)
    os.chmod(path, 0o644)
    assert list(read_allow_list(path).values()) == ["alice"]


def _server_files(tmp_path: Path) -> tuple[Path, Path]:
    pair = write_keypair(tmp_path / "keys", "server")
    allowed = tmp_path / "clients"
    allowed.write_text(f"{zmq.curve_keypair()[0].decode()} alice\n")
    return pair.secret_file, allowed


def test_server_keys_load_from_a_file_or_inline(tmp_path: Path) -> None:
    secret, allowed = _server_files(tmp_path)
    from_file = ServerAuth.from_config("tcp://127.0.0.1:1", str(secret), str(allowed))
    inline = ServerAuth.from_config("tcp://127.0.0.1:1", secret.read_text().split()[-1], str(allowed))
    assert from_file is not None and inline is not None and from_file.public_key == inline.public_key
    assert ServerAuth.from_config("tcp://127.0.0.1:1", None, None) is None  # CURVE off


@pytest.mark.parametrize(
    "case, complaint",
    [
        ("no allow-list", "curve_allowed_keys is not"),
        ("allow-list only", "curve_secret_key is not"),
        ("ipc endpoint", "applies to tcp:// endpoints"),
        ("secret readable by others", "chmod 600"),
        ("garbage key", "is not a CURVE key"),
    ],
)
def test_server_curve_settings_fail_closed(tmp_path: Path, case: str, complaint: str) -> None:
    secret, allowed = _server_files(tmp_path)
    endpoint, key, allow = "tcp://0.0.0.0:5555", str(secret), str(allowed)
    if case == "no allow-list":
        allow = None  # type: ignore[assignment]
    elif case == "allow-list only":
        key = None  # type: ignore[assignment]
    elif case == "ipc endpoint":
        endpoint = f"ipc://{tmp_path}/run/kv.sock"
    elif case == "secret readable by others":
        os.chmod(secret, 0o644)
    else:
        key = "neither-a-file-nor-a-key"
    with pytest.raises(ConfigError) as e:
        ServerAuth.from_config(endpoint, key, allow)
    assert complaint in str(e.value)


def test_serve_refuses_to_start_rather_than_serve_without_its_allow_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret, _ = _server_files(tmp_path)
    config = with_overrides(
        loaded(write_config(tmp_path)), "server", endpoint="tcp://127.0.0.1:1", curve_secret_key=str(secret)
    )
    with caplog.at_level(logging.ERROR, logger="kvstore"):
        assert serve(config) == 1
    assert "refusing to start" in caplog.text and "curve_allowed_keys" in caplog.text


def test_client_keys_from_arguments_files_or_environment(tmp_path: Path) -> None:
    server, me = write_keypair(tmp_path, "server"), write_keypair(tmp_path, "me")
    my_secret = me.secret_file.read_text().split()[-1]
    by_file = ClientKeys.resolve("tcp://h:1", str(server.public_file), str(me.secret_file), env={})
    by_text = ClientKeys.resolve("tcp://h:1", server.public_key, my_secret, me.public_key, env={})
    assert by_file == by_text and by_file is not None and by_file.public_key == me.public_key.encode()
    env = {
        "KVSTORE_CURVE_SERVER_KEY": str(server.public_file),
        "KVSTORE_CURVE_SECRET_KEY": str(me.secret_file),
    }
    assert ClientKeys.resolve("tcp://h:1", env=env) == by_file
    # the environment is for tcp daemons only: an ipc client on the same host never picks it up
    assert ClientKeys.resolve("ipc:///run/kv.sock", env=env) is None
    assert ClientKeys.resolve("tcp://h:1", env={}) is None


@pytest.mark.parametrize(
    "case, complaint",
    [
        ("server key alone", "without curve_secret_key"),
        ("secret alone", "without curve_server_key"),
        ("public key of another pair", "does not belong to"),
        ("secret readable by others", "chmod 600"),
        ("the public file given as the secret", "is a public key file"),
        ("the secret file given as the server's key", "is a secret key file"),
        ("a key file that is not there", "names no file"),
        # it was "names no file (it does not exist)", of a path that exists
        ("a directory given as the secret", "is not a file (a directory?)"),
    ],
)
def test_client_keys_refuse_incomplete_or_exposed_pairs(tmp_path: Path, case: str, complaint: str) -> None:
    server, me, other = (write_keypair(tmp_path, n) for n in ("server", "me", "other"))
    args: dict[str, str | None] = {"server_key": server.public_key, "secret_key": str(me.secret_file)}
    if case == "server key alone":
        args["secret_key"] = None
    elif case == "secret alone":
        args["server_key"] = None
    elif case == "public key of another pair":
        args["public_key"] = other.public_key
    elif case == "the public file given as the secret":
        args["secret_key"] = str(me.public_file)
    elif case == "the secret file given as the server's key":
        args["server_key"] = str(server.secret_file)
    elif case == "a key file that is not there":
        args["secret_key"] = str(tmp_path / "keys" / "me.key_secret")
    elif case == "a directory given as the secret":
        args["secret_key"] = str(tmp_path)
    else:
        os.chmod(me.secret_file, 0o640)
    with pytest.raises(ConfigError) as e:
        ClientKeys.resolve("tcp://h:1", env={}, **args)
    assert complaint in str(e.value)


def test_ipc_socket_directory_is_private_to_the_daemon_user(tmp_path: Path) -> None:
    # missing: created 0700 whatever the umask
    run = tmp_path / "run"
    old = os.umask(0o022)
    try:
        secure_dir(run)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    # opened up to others: refused with the fix
    os.chmod(run, 0o750)
    with pytest.raises(UnsafeEndpoint, match=f"chmod 700 {run}"):
        secure_dir(run)
    # a symlink to a directory is not trusted (it may point anywhere)
    os.chmod(run, 0o700)
    link = tmp_path / "link"
    link.symlink_to(run)
    with pytest.raises(UnsafeEndpoint, match="not a directory"):
        secure_dir(link)


# ---------------------------------------------------------------- a real CURVE daemon on 127.0.0.1


@pytest.fixture(scope="module")
def curve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CurveDaemon]:
    cd = start_curve_daemon(tmp_path_factory.mktemp("auth"))
    try:
        yield cd
    finally:
        assert cd.daemon.stop() == 0, cd.daemon.output()


def _counters(cd: CurveDaemon) -> tuple[int, int]:
    """(requests the daemon received, lookups the store ran), as the operator sees them."""
    with cd.client("operator", namespace=False) as op:
        s = op.stats()
    return s["server"]["requests"], s["store"]["lookups"]


def test_a_listed_key_puts_and_gets_over_curve(curve: CurveDaemon) -> None:
    tokens = random_tokens(np.random.default_rng(1), 3)
    with curve.client("alice") as c:
        assert c.put(tokens, prefix_kv(tokens), session="conv").stored == 3
        got = c.get(tokens)
        assert not c.shared_memory  # a CURVE client is never offered shared memory
    assert got.matched_tokens == 3 * T
    assert_exact(tokens, got.kv, got.matched_tokens)


def test_an_unknown_key_gets_nothing_and_nothing_reaches_the_store(curve: CurveDaemon) -> None:
    tokens = random_tokens(np.random.default_rng(2), 2)
    requests, lookups = _counters(curve)
    # a key the allow-list does not name: the handshake is refused, so no request is ever read
    with curve.client("stranger", tenant="alice", timeout=1.0, retries=0) as c:
        with pytest.raises(RequestTimeout, match="curve_allowed_keys"):
            c.lookup(tokens)
        with pytest.raises(RequestTimeout):
            c.ping()
    # only the operator's second stats call was counted; the store ran no lookup
    assert _counters(curve) == (requests + 1, lookups)
    stranger = curve.keys["stranger"].public_key
    assert f"key {stranger} is not in curve_allowed_keys" in curve.daemon.output()


def test_a_client_without_curve_or_with_a_wrong_server_key_gets_nothing(
    curve: CurveDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVSTORE_CURVE_SERVER_KEY", "KVSTORE_CURVE_SECRET_KEY", "KVSTORE_CURVE_PUBLIC_KEY"):
        monkeypatch.delenv(name, raising=False)
    requests, _ = _counters(curve)
    with KVStoreClient(curve.endpoint, timeout=0.5, retries=0) as plain:
        with pytest.raises(RequestTimeout, match="set KVSTORE_CURVE_SERVER_KEY and KVSTORE_CURVE_SECRET_KEY"):
            plain.ping()
    # a listed client key but the wrong daemon key: the client cannot prove the daemon, nor the daemon it
    with KVStoreClient(
        curve.endpoint,
        timeout=0.5,
        retries=0,
        curve_server_key=curve.keys["bob"].public_key,
        curve_secret_key=str(curve.keys["alice"].secret_file),
    ) as wrong:
        with pytest.raises(RequestTimeout):
            wrong.ping()
    assert _counters(curve)[0] == requests + 1


def test_the_environment_gives_a_tcp_client_its_keys(
    curve: CurveDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_CURVE_SERVER_KEY", str(curve.keys["server"].public_file))
    monkeypatch.setenv("KVSTORE_CURVE_SECRET_KEY", str(curve.keys["operator"].secret_file))
    with KVStoreClient(curve.endpoint, timeout=5.0, retries=0) as c:
        assert c.ping()["pid"] == curve.daemon.proc.pid


def test_a_curve_client_asking_for_shared_memory_is_told_it_has_none(curve: CurveDaemon) -> None:
    from kvstore.wire.messages import Finish, Reserve

    for who in ("alice", "operator"):
        with curve.client(who) as c:
            for msg in (Reserve(nbytes=4096), Finish(handle=1, used=0)):
                with pytest.raises(KVStoreError) as e:
                    c._call(msg)
                # not an internal error with a traceback in the log: a tcp client has no shared memory
                assert e.value.code == "no_shared_memory", e.value
            assert c.ping()["pid"] == curve.daemon.proc.pid
    assert "Traceback" not in curve.daemon.output()


def test_a_hello_for_another_tenant_than_the_key_is_forbidden(curve: CurveDaemon) -> None:
    tokens = random_tokens(np.random.default_rng(3), 2)
    with curve.client("alice", tenant="bob", retries=0) as c:
        with pytest.raises(Forbidden) as e:
            c.lookup(tokens)
    assert (
        e.value.code == "forbidden" and "tenant 'alice'" in str(e.value) and "tenant='alice'" in str(e.value)
    )
    # the operator key (tenant *) may speak for any tenant
    with curve.client("operator", tenant="bob") as op:
        assert op.lookup(tokens).matched_tokens == 0


def test_ops_for_operators_only_need_an_operator_key(curve: CurveDaemon) -> None:
    with curve.client("operator", namespace=False) as op:
        assert op.stats()["server"]["clients"] >= 0  # store-wide counters: the operator sees them
    with curve.client("alice", namespace=False) as c:
        s = c.stats()
    assert s["tenant"] == "alice" and "requests" not in s["server"] and "clients" not in s["server"]


def test_model_and_layout_stay_part_of_a_tenant_namespace(curve: CurveDaemon) -> None:
    # same tenant, same tokens, another model: still a miss (the namespace is more than the tenant)
    tokens = random_tokens(np.random.default_rng(4), 2)
    with curve.client("alice") as c:
        assert c.put(tokens, prefix_kv(tokens)).stored == 2
    other = KVStoreClient(
        curve.endpoint,
        model=MODEL + "-other",
        layout=LAYOUT,
        tenant="alice",
        timeout=5.0,
        curve_server_key=curve.keys["server"].public_key,
        curve_secret_key=str(curve.keys["alice"].secret_file),
    )
    with other:
        assert other.lookup(tokens).matched_tokens == 0
