"""Two real daemons standing for two hosts (their own sockets and LMDB paths) on one Redis Cluster.

::

    host A  turn 1 of a real SmolLM2 conversation -> hbm, nvme, and (background) the cluster
    host B  empty: turn 2's prefix comes from the cluster (int4, checked), then from B's own tiers
            (the same next-token distributions either way, within the int4 gate of recomputing)
    a day later: both restarted, B's LMDB wiped -> the conversation still resumes, from the cluster,
            as good as before

Also: a master killed mid-load, a cluster that cannot be used at start (wrong password, none at
all, required), a full cluster, the CLI and the metrics, and two tenants' blocks under the same
tokens on two hosts, each served only its own.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.integrations.chat import Conversation, run_turn
from kvstore.integrations.models import LoadedModel
from kvstore.integrations.quality import GATES
from kvstore.layout import KVLayout
from tests.cluster.rediscluster import LocalCluster
from tests.integrations.conftest import Served, kvstore_command, write_config
from tests.integrations.test_resume import ANSWER_TOKENS, QUESTION_1, QUESTION_2, next_token_kl

pytestmark = pytest.mark.slow

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def cluster_section(urls: list[str], **settings: Any) -> str:
    lines = ["[cluster]", "enabled = true", f"nodes = {urls!r}".replace("'", '"'), 'timeout = "500ms"']
    lines += ['retry_after = "1s"']
    for k, v in settings.items():
        lines.append(f"{k} = {str(v).lower()}" if isinstance(v, bool) else f'{k} = "{v}"')
    return "\n".join(lines) + "\n"


HostStarter = Callable[..., Served]


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[HostStarter]:
    """``hosts(name, urls, **cluster)``: a daemon under tmp_path/name on the cluster at ``urls``."""
    started: list[Served] = []

    def start(
        name: str, urls: list[str], *, ready: bool = True, metrics_port: int = 0, **cluster: Any
    ) -> Served:
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        config, endpoint = write_config(root, hbm="64MiB", ram="64MiB", nvme="1GiB")
        text = config.read_text().replace("workers = 2", f"workers = 2\nmetrics_port = {metrics_port}")
        config.write_text(text + cluster_section(urls, **cluster))
        d = Served(config, endpoint)
        started.append(d)
        return d.start() if ready else d

    yield start
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def cluster_stats(c: KVStoreClient) -> dict[str, Any]:
    return c.stats()["store"]["cluster"]


def wait_written(c: KVStoreClient, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster_stats(c)["written"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the cluster got {cluster_stats(c)} not {n} blocks")


def cli(d: Served, *args: str) -> str:
    r = subprocess.run(
        [*kvstore_command(), *args, "--endpoint", d.endpoint], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    return r.stdout


@pytest.mark.model
def test_a_conversation_moves_between_hosts_and_survives_a_day(
    rc: LocalCluster, hosts: HostStarter, smollm2: LoadedModel
) -> None:
    model, layout = smollm2.model, smollm2.layout(dtype="float32")
    a, b = hosts("a", rc.urls), hosts("b", rc.urls)
    chat = Conversation(smollm2.tokenizer)
    kw: dict[str, Any] = {"model": smollm2.model_id, "layout": layout, "timeout": 60.0}
    with KVStoreClient(a.endpoint, **kw) as ca:
        first = run_turn(model, ca, chat.ask(QUESTION_1), max_new_tokens=ANSWER_TOKENS, session="garden")
        chat.answer(first.output_ids)
        blocks = first.stored_blocks
        assert blocks >= 2
        wait_written(ca, blocks)
    ids = chat.ask(QUESTION_2)
    T = layout.block_tokens
    with KVStoreClient(b.endpoint, **kw) as cb:
        assert cb.lookup(ids).tiers == ["cluster"] * blocks
        kl, reused, tiers = next_token_kl(model, cb, ids)  # host B never computed any of it
        assert reused == blocks * T and tiers == ["cluster"] * blocks
        assert 0.0 < kl <= GATES["int4"].max_kl
        assert cb.lookup(ids).tiers == ["hbm"] * blocks  # B keeps them now
        again, reused, tiers = next_token_kl(model, cb, ids)  # and serves them itself
        assert reused == blocks * T and tiers == ["hbm"] * blocks
        assert again == pytest.approx(kl, rel=1e-4)  # the same K/V as the cluster's, kept as served
        st = cluster_stats(cb)
        assert st["hits"] == blocks and st["written"] == 0 and st["state"] == "up"
        assert "cluster: up" in cli(b, "stats")

    # a day later: both hosts restarted, B's disk replaced
    a.stop()
    b.stop()
    shutil.rmtree(b.config.parent / "nvme")
    a.start()
    b.start()
    with KVStoreClient(b.endpoint, **kw) as cb:
        assert cb.stats()["store"]["blocks"] == 0
        shown = cli(b, "inspect", "--session", "garden")
        assert f"cluster {blocks}" in shown, shown
        resumed, reused, tiers = next_token_kl(model, cb, ids)  # from the cluster again, as good
        assert reused == blocks * T and tiers == ["cluster"] * blocks
        assert resumed == pytest.approx(kl, rel=1e-4)
        second = run_turn(model, cb, ids, max_new_tokens=4, store=False)
        assert second.reused_tokens == blocks * T and second.tiers == ["hbm"] * blocks
    # the session itself can be warmed up on a host that never saw it
    c = hosts("c", rc.urls)
    assert "moved" in cli(c, "prefetch", "--session", "garden")
    with KVStoreClient(c.endpoint, **kw) as cc:
        assert cc.lookup(ids).tiers == ["hbm"] * blocks
        assert [s.name for s in cc.sessions()] == ["garden"]


def test_a_master_killed_mid_load_costs_misses_never_wrong_bytes(
    rc: LocalCluster, hosts: HostStarter
) -> None:
    a, b = hosts("a", rc.urls, codec="raw"), hosts("b", rc.urls, codec="raw")
    n = 48
    toks = list(range(n * LAYOUT.block_tokens))
    x = torch.randn(LAYOUT.shape(len(toks)), generator=torch.Generator().manual_seed(1)).half()
    with KVStoreClient(a.endpoint, model="m", layout=LAYOUT) as ca:
        ca.put(toks, x)
        wait_written(ca, n)
    time.sleep(0.5)  # the replicas have the values too (asynchronous replication)
    results: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        try:
            with KVStoreClient(b.endpoint, model="m", layout=LAYOUT, timeout=30.0) as cb:
                while not stop.is_set():
                    r = cb.get(toks)
                    got = r.matched_tokens
                    if got:  # whatever came is exactly what A stored
                        assert r.kv is not None and torch.equal(r.kv, x[:, :, :got]), "wrong bytes"
                    results.append(r.matched_blocks)
                    cb.evict(all=True)  # read from the cluster again next time
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=load)
    t.start()
    time.sleep(1.0)
    victim = rc.master_of(b"kvstore:b:" + b"0")  # some master: it serves a third of the blocks
    rc.kill(victim)
    rc.wait_ok()  # a replica took over
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not results or results[-1] != n):
        time.sleep(0.2)
    stop.set()
    t.join(60)
    assert not errors, errors
    # a miss during the failover is allowed (a shorter result), an error or a wrong byte is not
    assert (
        len(results) > 3 and results[-1] == n
    )  # recovered: the whole prefix again, from the promoted replica
    with KVStoreClient(b.endpoint, model="m", layout=LAYOUT) as cb:
        assert cluster_stats(cb)["state"] == "up"


def test_a_cluster_that_cannot_be_used_leaves_the_daemon_local_only(
    rc: LocalCluster, hosts: HostStarter
) -> None:
    nowhere = ["redis://127.0.0.1:1"]
    d = hosts("none", nowhere)
    with KVStoreClient(d.endpoint, model="m", layout=LAYOUT) as c:
        toks = list(range(4 * LAYOUT.block_tokens))
        x = torch.randn(LAYOUT.shape(len(toks))).half()
        assert c.put(toks, x).stored == 4 and c.get(toks).matched_blocks == 4
        st = cluster_stats(c)
        assert st["state"] == "down" and st["last_error"]
    assert d.output().count("serving from the local tiers") == 1

    rc.set_password("right")
    try:
        w = hosts("wrong", [*rc.urls, *nowhere], password="wrong-one")  # a dead seed too
        with KVStoreClient(w.endpoint, model="m", layout=LAYOUT) as c:
            assert "refused the credentials" in cluster_stats(c)["last_error"]
        assert "wrong-one" not in w.output()
        r = hosts("required", rc.urls, password="wrong-one", required=True, ready=False)
        with pytest.raises(AssertionError, match="required = true"):
            r.start(timeout=30)
    finally:
        rc.set_password(None)


def test_a_full_cluster_is_counted_and_the_metrics_show_the_tier(
    rc: LocalCluster, hosts: HostStarter
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = hosts("full", rc.urls, metrics_port=port)
    masters = list(rc.live_masters())
    try:
        for p in masters:
            rc.node(p).config_set("maxmemory", "1")
        with KVStoreClient(d.endpoint, model="m", layout=LAYOUT) as c:
            toks = list(range(4 * LAYOUT.block_tokens))
            assert c.put(toks, torch.randn(LAYOUT.shape(len(toks))).half()).stored == 4
            deadline = time.monotonic() + 20
            while cluster_stats(c)["write_refused"] < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = cluster_stats(c)
            assert st["write_refused"] == 4 and st["state"] == "up"
            assert c.get(toks).matched_blocks == 4
    finally:
        for p in masters:
            rc.node(p).config_set("maxmemory", "0")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'kvstore_tier_hits_total{tier="cluster"}' in text
    assert "kvstore_cluster_up 1.0" in text and "kvstore_cluster_refused_blocks_total 4.0" in text
    assert "kvstore_cluster_dropped_sessions_total 0.0" in text


def test_evict_from_the_cli_reaches_the_cluster(rc: LocalCluster, hosts: HostStarter) -> None:
    d = hosts("a", rc.urls)
    with KVStoreClient(d.endpoint, model="m", layout=LAYOUT) as c:
        toks = list(range(3 * LAYOUT.block_tokens))
        c.put(toks, torch.randn(LAYOUT.shape(len(toks))).half(), session="s1")
        wait_written(c, 3)
        out = cli(d, "evict", "--tier", "cluster", "--yes")
        assert "3" in out, out
        assert rc.keys() == [] or all(not k.startswith(b"kvstore:b:") for k in rc.keys())
        assert c.lookup(toks).tiers == ["hbm"] * 3  # local copies stay


def test_a_tenant_s_blocks_never_reach_another_tenant_on_another_host(
    rc: LocalCluster, hosts: HostStarter
) -> None:
    a, b = hosts("a", rc.urls, codec="raw"), hosts("b", rc.urls, codec="raw")
    n = 3
    toks = list(range(1000, 1000 + n * LAYOUT.block_tokens))
    mine = torch.randn(LAYOUT.shape(len(toks)), generator=torch.Generator().manual_seed(2)).half()
    theirs = torch.randn(LAYOUT.shape(len(toks)), generator=torch.Generator().manual_seed(3)).half()

    def tenant(d: Served, name: str) -> KVStoreClient:
        return KVStoreClient(d.endpoint, model="m", layout=LAYOUT, tenant=name)

    with tenant(a, "alice") as c:
        assert c.put(toks, mine, session="plans").stored == n
        wait_written(c, n)
    with tenant(b, "bob") as c:  # the same tokens, model and layout on another host: not bob's
        assert c.lookup(toks).matched_blocks == 0 and c.get(toks).matched_blocks == 0
        assert c.put(toks, theirs).stored == n  # bob's own blocks, under keys of his own
        wait_written(c, n)
    with tenant(b, "alice") as c:
        shown = c.inspect(session="plans")  # from the cluster's record: this host never had it
        assert len(shown.blocks) == n and all(blk.tiers == ["cluster"] for blk in shown.blocks)
        r = c.get(toks)
        assert r.tiers == ["cluster"] * n and r.kv is not None and torch.equal(r.kv, mine)
    with tenant(a, "bob") as c:
        r = c.get(toks)
        assert r.tiers == ["cluster"] * n and r.kv is not None and torch.equal(r.kv, theirs)
