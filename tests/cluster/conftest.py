"""A real Redis Cluster (3 masters, 3 replicas, loopback) for the whole session, emptied before each test.

``cluster_tier(**kw)`` builds kvstore's ClusterTier on it (raw codec: bit-exact round trips unless a
test asks for another). ``hosts``: two stores standing for two hosts, each with its own LMDB path, both
on the cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.codecs import get_codec
from kvstore.store.engine import Store
from kvstore.tiers.cluster import ClusterTier
from kvstore.tiers.cluster_format import ClusterNodes, TlsFiles
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from tests.cluster.rediscluster import LocalCluster
from tests.store.storekit import HBM_PAGE, RAM_PAGE


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("redis-cluster")) as c:
        yield c


@pytest.fixture
def rc(redis_cluster: LocalCluster) -> LocalCluster:
    """The session's cluster, empty, every slot served (a test may have killed a master)."""
    redis_cluster.wait_ok()
    redis_cluster.flushall()
    return redis_cluster


ClusterFactory = Callable[..., ClusterTier]


@pytest.fixture
def cluster_tier(rc: LocalCluster) -> Iterator[ClusterFactory]:
    made: list[ClusterTier] = []

    def make(
        codec: str = "raw",
        *,
        urls: list[str] | None = None,
        password: str | None = None,
        tls: TlsFiles | None = None,
        **kw: Any,
    ) -> ClusterTier:
        nodes = ClusterNodes.parse(urls or rc.urls, None, password, tls)
        kw.setdefault("timeout", 1.0)
        kw.setdefault("retry_after", 0.5)
        tier = ClusterTier(nodes, get_codec(codec), **kw)
        made.append(tier)
        return tier

    yield make
    for t in made:
        t.close()


HostFactory = Callable[..., Store]


@pytest.fixture
def host(tmp_path: Path, cluster_tier: ClusterFactory) -> Iterator[HostFactory]:
    """``host(name)``: a store with its own tiers and LMDB under tmp_path/name, on the cluster
    (``cluster_queue``: its [cluster] write_queue; ``write_through``: its [nvme] one; ``clock``: its
    clock; other keywords go to the ClusterTier)."""
    opened: list[Store] = []

    def make(
        name: str,
        *,
        codec: str = "raw",
        connect: bool = True,
        cluster_queue: int = 1024,
        write_through: bool = True,
        clock: Callable[[], float] | None = None,
        **kw: Any,
    ) -> Store:
        hbm = HbmTier(8 * HBM_PAGE, page_bytes=HBM_PAGE)
        ram = RamTier(8 * RAM_PAGE, get_codec("raw"), page_bytes=RAM_PAGE, pin_memory=False)
        nvme = NvmeTier(tmp_path / name, 1 << 22, get_codec("int4"))
        tier = cluster_tier(codec, **kw)
        if connect:
            tier.connect()
        s = Store(
            hbm,
            ram,
            nvme,
            cluster=tier,
            tick=0.05,
            cluster_queue=cluster_queue,
            write_through=write_through,
            clock=clock or time.time,
        )
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
