"""A real Redis Cluster on loopback ports from Debian's ``redis-server``: for the tests and bench/cluster.py.

::

    LocalCluster(root, masters=3, replicas=1).start()
        6 redis-server processes on 127.0.0.1 (cluster-enabled, no persistence), joined by
        ``redis-cli --cluster create``; cluster-node-timeout 1 s, so a dead master fails over in ~2-4 s
    .urls            ["redis://127.0.0.1:PORT", ...] (the seed nodes a config names)
    LocalCluster(root, tls=True): TLS only (rediss://), node and client certificates signed by a CA
                     made for it with openssl (.ca, .cert, .key); clients may present one
    .kill(port) / .pause(port) / .resume(port)      faults
    .master_of(key)  the port of the master serving a key's slot
    .flushall()      every master emptied (between tests)
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

HOST = "127.0.0.1"


def redis_server() -> str:
    """The redis-server binary; RuntimeError saying how to get it when missing."""
    exe = shutil.which("redis-server")
    if exe is None or shutil.which("redis-cli") is None:
        raise RuntimeError(
            "redis-server and redis-cli are not installed: ./dev setup installs them "
            "(apt-get install -y redis-server)"
        )
    return exe


def _free_port() -> int:
    """A port free for the node and for its cluster bus (port + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each; ``password`` for every node (requirepass)."""

    def __init__(
        self,
        root: Path,
        *,
        masters: int = 3,
        replicas: int = 1,
        password: str | None = None,
        tls: bool = False,
    ) -> None:
        self.root = root
        self.tls = tls
        self.ca = self.cert = self.key = ""
        self.masters = masters
        self.replicas = replicas
        self.password = password
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def urls(self) -> list[str]:
        scheme = "rediss" if self.tls else "redis"
        return [f"{scheme}://{HOST}:{p}" for p in self.ports[: self.masters]]

    def _certificates(self) -> None:
        """A CA, and a certificate for 127.0.0.1 it signed (the nodes' and the clients')."""
        d = self.root / "tls"
        d.mkdir(parents=True, exist_ok=True)
        self.ca, self.cert, self.key = str(d / "ca.crt"), str(d / "node.crt"), str(d / "node.key")
        (d / "san.ext").write_text(f"subjectAltName=IP:{HOST}\n")
        for cmd in (
            f"req -x509 -newkey rsa:2048 -nodes -keyout {d}/ca.key -out {self.ca} -days 2 -subj /CN=kvstore-test-ca",
            f"req -newkey rsa:2048 -nodes -keyout {self.key} -out {d}/node.csr -subj /CN={HOST}",
            f"x509 -req -in {d}/node.csr -CA {self.ca} -CAkey {d}/ca.key -CAcreateserial -out {self.cert} "
            f"-days 2 -extfile {d}/san.ext",
        ):
            subprocess.run(["openssl", *cmd.split()], check=True, capture_output=True, timeout=60)

    def start(self, timeout: float = 60.0) -> LocalCluster:
        exe = redis_server()
        if self.tls:
            self._certificates()
        self.ports = [_free_port() for _ in range(self.masters * (1 + self.replicas))]
        for port in self.ports:
            self._spawn(exe, port)
        for port in self.ports:
            self._wait_ping(port, timeout)
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        if self.tls:
            auth += ["--tls", "--cacert", self.ca, "--cert", self.cert, "--key", self.key]
        subprocess.run(
            ["redis-cli", *auth, "--cluster", "create", *[f"{HOST}:{p}" for p in self.ports]]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        self.wait_ok(timeout)
        return self

    def _spawn(self, exe: str, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(parents=True, exist_ok=True)
        conf = [
            *(
                ["port 0", f"tls-port {port}", f"tls-cert-file {self.cert}", f"tls-key-file {self.key}"]
                + [f"tls-ca-cert-file {self.ca}", "tls-cluster yes", "tls-replication yes"]
                + ["tls-auth-clients optional"]
                if self.tls
                else [f"port {port}"]
            ),
            f"bind {HOST}",
            "cluster-enabled yes",
            f"cluster-config-file {d / 'nodes.conf'}",
            "cluster-node-timeout 1000",
            "cluster-replica-validity-factor 0",
            "appendonly no",
            'save ""',
            f"dir {d}",
            "daemonize no",
            f"logfile {d / 'redis.log'}",
        ]
        if self.password:
            conf += [f"requirepass {self.password}", f"masterauth {self.password}"]
        (d / "redis.conf").write_text("\n".join(conf) + "\n")
        self.procs[port] = subprocess.Popen(
            [exe, str(d / "redis.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def node(self, port: int) -> redis.Redis:
        if self.tls:
            return redis.Redis(
                HOST, port, password=self.password, socket_timeout=2.0, ssl=True, ssl_ca_certs=self.ca
            )
        return redis.Redis(HOST, port, password=self.password, socket_timeout=2.0)

    def _wait_ping(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.node(port).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not start; see {self.root / str(port)}")

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node says the cluster is ok, every slot is served by a live master, and
        every live replica is in sync with its master (a replica still loading its first copy, some
        seconds after the start, would lose everything if a test failed its master over then)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = [p for p in self.ports if self.procs[p].poll() is None]
                if all(self.node(p).cluster("info")["cluster_state"] == "ok" for p in live):
                    masters = self.live_masters()
                    synced = all(
                        info.get("role") != "slave" or info.get("master_link_status") == "up"
                        for info in (self.node(p).info("replication") for p in live)
                    )
                    if synced and sum(b - a + 1 for r in masters.values() for a, b in r) == 16384:
                        return
            except (redis.RedisError, KeyError, TypeError):
                pass
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not become ok")

    def live_masters(self) -> dict[int, list[tuple[int, int]]]:
        """Each live master's port and its slot ranges, as a live node sees them."""
        live = next(p for p in self.ports if self.procs[p].poll() is None)
        out: dict[int, list[tuple[int, int]]] = {}
        for start, end, master, *_ in self.node(live).execute_command("CLUSTER", "SLOTS"):
            port = int(master[1])
            if self.procs.get(port) is not None and self.procs[port].poll() is None:
                out.setdefault(port, []).append((int(start), int(end)))
        return out

    def master_of(self, key: str | bytes) -> int:
        """The port of the master serving ``key``'s slot now."""
        live = next(p for p in self.ports if self.procs[p].poll() is None)
        slot = int(self.node(live).cluster("keyslot", key))
        for port, ranges in self.live_masters().items():
            if any(a <= slot <= b for a, b in ranges):
                return port
        raise RuntimeError(f"no live master serves slot {slot}")

    def keys(self) -> list[bytes]:
        """Every key on every live master."""
        out: list[bytes] = []
        for port in self.live_masters():
            out += list(self.node(port).scan_iter(count=1000))
        return out

    def set_password(self, password: str | None) -> None:
        """Require ``password`` on every live node from now on (None: no password)."""
        for port in self.ports:
            if self.procs[port].poll() is None:
                node = self.node(port)
                node.config_set("masterauth", password or "")
                node.config_set("requirepass", password or "")
        self.password = password

    def flushall(self) -> None:
        for port in self.live_masters():
            self.node(port).flushall()

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def pause(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
