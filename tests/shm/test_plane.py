"""The parts of the shared-memory data plane, without a daemon: segments, staging leases, generations."""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import platform
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.codecs import get_codec
from kvstore.errors import ConfigError
from kvstore.shm.plane import ALIGN, RangeAllocator, SharedPlane, StagingFull
from kvstore.shm.segment import NEW_GRACE, Segment, ShmUnavailable, private_dir, sweep
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.paged import extents
from kvstore.tiers.pool import PagePool
from kvstore.tiers.ram import RamTier
from kvstore.wire.errors import ProtocolError
from tests.store.storekit import kv


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return private_dir(tmp_path / "shm")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_segments_are_private_files_and_clients_refuse_others(shm_dir: Path) -> None:
    seg = Segment.create(shm_dir, "ram", 10_000)
    st = os.stat(seg.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(shm_dir).st_mode) == 0o700
    assert seg.size == 12288  # whole 4 KiB pages
    seg.array(0, 4)[:] = [1, 2, 3, 4]
    reader = Segment.open(seg.path, seg.size, writable=False)
    assert list(reader.array(0, 4)) == [1, 2, 3, 4]
    assert not reader.array().flags.writeable
    os.chmod(seg.path, 0o644)  # a segment others could read is not one of ours
    with pytest.raises(ShmUnavailable, match="private"):
        Segment.open(seg.path, seg.size, writable=False)
    with pytest.raises(ShmUnavailable, match="not a kvstore segment"):
        Segment.open(shm_dir / "other", 10, writable=False)
    with pytest.raises(ShmUnavailable, match="cannot open"):
        Segment.open(shm_dir / "kvs-1-0123456789abcdef01234567-ram", 10, writable=False)
    reader.close()
    seg.close()
    assert not seg.path.exists()


def test_a_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(ConfigError, match="mode 0700"):
        private_dir(loose)
    with pytest.raises(ConfigError, match="does not exist"):
        private_dir(tmp_path / "no" / "such")


def test_sweep_removes_only_segments_whose_daemon_is_gone(shm_dir: Path) -> None:
    mine = Segment.create(shm_dir, "hbm", 4096)
    # a "daemon" that creates a segment and dies without removing it
    code = (
        "import os, sys; from pathlib import Path; from kvstore.shm.segment import Segment; "
        f"s = Segment.create(Path({str(shm_dir)!r}), 'ram', 4096); print(s.path); os._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    dead = Path(out.stdout.strip())
    assert dead.exists()
    (shm_dir / "unrelated").write_text("x")
    assert sweep(shm_dir) == 1
    assert not dead.exists() and mine.path.exists() and (shm_dir / "unrelated").exists()
    mine.close()


def _sweep_until(directory: str, started: Any, stop: Any) -> None:
    started.set()
    while not stop.is_set():
        sweep(Path(directory))


def test_another_daemon_s_sweep_never_takes_a_segment_being_made(shm_dir: Path) -> None:
    """Two daemons of one user share the directory: one's start-up sweep runs while the other makes
    segments. A segment is locked before it bears a segment's name, so the sweep never takes it
    for a dead daemon's; one a daemon died making is removed once it is old enough."""
    ctx = multiprocessing.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    sweeper = ctx.Process(target=_sweep_until, args=(str(shm_dir), started, stop))
    sweeper.start()
    try:
        assert started.wait(60)
        deadline = time.monotonic() + 3
        made = 0
        while time.monotonic() < deadline:
            seg = Segment.create(shm_dir, "staging", 4096)
            assert seg.path.exists()
            seg.close()
            made += 1
    finally:
        stop.set()
        sweeper.join()
    assert made > 100
    dead = shm_dir / f".kvs-1-{'ab' * 12}-staging.new"  # a daemon died between open and rename
    dead.write_bytes(b"x")
    assert sweep(shm_dir) == 0 and dead.exists()  # it may be about to be locked
    old = time.time() - 2 * NEW_GRACE
    os.utime(dead, (old, old))
    assert sweep(shm_dir) == 1 and not dead.exists()


def test_a_segment_larger_than_the_filesystem_is_refused_at_creation(tmp_path: Path) -> None:
    from tests.hardening.conftest import mounted

    where = tmp_path / "small"
    with mounted(where, "size=1m", "mode=0700") as ok:
        if not ok:
            pytest.skip("needs root to mount a small tmpfs")
        with pytest.raises(ConfigError, match="cannot be allocated"):
            Segment.create(where, "ram", 8 * 2**20)
        assert not [p for p in where.iterdir() if p.name.startswith("kvs-")]  # nothing left behind


def _pmd_mapped_kb(address: int) -> int:
    """ShmemPmdMapped (kB) of the mapping of this process that holds ``address``: its huge pages."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "ShmemPmdMapped:":
            return int(line.split()[1])
    return 0


def test_segments_are_huge_pages_where_the_filesystem_gives_them_on_advice(tmp_path: Path) -> None:
    from tests.hardening.conftest import mounted

    if Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().find("[deny]") >= 0:
        pytest.skip("transparent huge pages are denied to shared memory on this host")
    where = tmp_path / "huge"
    with mounted(where, "size=64m", "huge=advise", "mode=0700") as ok:
        if not ok:
            pytest.skip("needs root to mount a tmpfs")
        seg = Segment.create(where, "hbm", 16 * 2**20)
        client = Segment.open(seg.path, seg.size, writable=False)
        try:
            # the daemon's pages and the client's view of them: 2 MiB pages, both sides
            assert _pmd_mapped_kb(seg.array().ctypes.data) >= 8 * 1024
            view = client.array()
            assert int(view[: 16 * 2**20 : 4096].sum()) == 0  # the client maps them as it reads
            assert _pmd_mapped_kb(view.ctypes.data) >= 8 * 1024
            # freed (an idle staging segment) while the client still maps it: a read there makes one
            # small page of the file again, not a huge one (the client's mapping asks for none)
            seg.close(free=True)
            before = _used_bytes(where)
            assert int(view[5 * 2**20]) == 0
            assert _used_bytes(where) - before <= 64 * 1024
        finally:
            client.close()
            seg.close()
        assert not [p for p in where.iterdir() if p.name.startswith("kvs-")]


def _used_bytes(fs: Path) -> int:
    st = os.statvfs(fs)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_staging_ranges_merge_back_and_stay_aligned() -> None:
    r = RangeAllocator(10 * ALIGN)
    a, b, c = r.alloc(1), r.alloc(ALIGN + 1), r.alloc(3 * ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and r.used == 6 * ALIGN
    assert a is not None and b is not None and c is not None
    assert r.alloc(5 * ALIGN) is None
    r.free(b, ALIGN + 1)
    r.free(a, 1)
    assert r.alloc(3 * ALIGN) == 0  # a and b merged into one run
    r.free(0, 3 * ALIGN)
    r.free(c, 3 * ALIGN)
    assert r.used == 0 and r.alloc(10 * ALIGN) == 0


def test_a_staging_segment_is_made_outside_the_planes_lock(shm_dir: Path, monkeypatch: Any) -> None:
    """Making a client's staging segment makes its pages (huge ones may wait on the kernel): other
    clients' leases, takes and stats go on meanwhile; a second request of the same client waits
    for that segment instead of making another."""
    plane = SharedPlane(shm_dir, staging_bytes=4 << 20, per_client=1 << 20, lease=5.0)
    try:
        plane.take(plane.reserve(b"b", 4096).handle)  # b's segment exists
        making, go = threading.Event(), threading.Event()
        real = Segment.create
        made: list[Segment] = []

        def slow(*args: Any, **kw: Any) -> Segment:
            making.set()
            assert go.wait(60)
            made.append(real(*args, **kw))
            return made[-1]

        monkeypatch.setattr(Segment, "create", slow)
        got: list[Any] = []
        first = threading.Thread(target=lambda: got.append(plane.reserve(b"a", 4096)))
        first.start()
        assert making.wait(60)
        others = threading.Thread(
            target=lambda: (plane.take(plane.reserve(b"b", 4096).handle), plane.stats(), plane.sweep())
        )
        others.start()
        others.join(10)
        assert not others.is_alive()  # b was served while a's segment was being made
        second = threading.Thread(target=lambda: got.append(plane.reserve(b"a", 4096)))
        second.start()
        time.sleep(0.2)
        assert got == []  # a's second request waits for the segment being made
        go.set()
        first.join(60)
        second.join(60)
        assert len(got) == 2 and len(made) == 1
        assert got[0].staging is got[1].staging is made[0]
        assert plane.stats()["staging_clients"] == 2
    finally:
        plane.close()


def test_idle_staging_segments_make_room_for_a_new_clients_first_reserve(shm_dir: Path) -> None:
    """The budget holds two segments, both of clients gone quiet: a third client's first reserve
    (a client that only stores asks nothing else) finds them swept, not the budget full."""
    clock = Clock()
    plane = SharedPlane(shm_dir, staging_bytes=2 << 20, per_client=1 << 20, lease=5.0, clock=clock)
    try:
        for peer in (b"a", b"b"):
            plane.take(plane.reserve(peer, 4096).handle)
        clock.now += 1000  # both idle for long
        assert plane.reserve(b"c", 4096).nbytes == 4096
        assert plane.stats()["staging_clients"] == 1
    finally:
        plane.close()


def test_a_staging_segment_made_while_the_plane_closes_is_removed(shm_dir: Path, monkeypatch: Any) -> None:
    plane = SharedPlane(shm_dir, staging_bytes=4 << 20, per_client=1 << 20, lease=5.0)
    making, go = threading.Event(), threading.Event()
    real = Segment.create

    def slow(*args: Any, **kw: Any) -> Segment:
        making.set()
        assert go.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(Segment, "create", slow)
    errors: list[BaseException] = []

    def reserve() -> None:
        try:
            plane.reserve(b"a", 4096)
        except StagingFull as e:
            errors.append(e)

    t = threading.Thread(target=reserve)
    t.start()
    assert making.wait(60)
    plane.close()
    go.set()
    t.join(60)
    assert len(errors) == 1  # no staging from a closed plane
    assert not [p for p in shm_dir.iterdir() if "staging" in p.name]


def test_staging_leases_are_bounded_per_client_and_lapse(shm_dir: Path) -> None:
    clock = Clock()
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=512 << 10, lease=5.0, clock=clock)
    try:
        a = plane.reserve(b"a", 300 << 10)
        with pytest.raises(StagingFull):
            plane.reserve(b"a", 300 << 10)  # over a's share
        b = plane.reserve(b"b", 300 << 10)
        with pytest.raises(ProtocolError, match="shm_staging_per_client"):
            plane.reserve(b"c", 600 << 10)  # could never fit
        with pytest.raises(StagingFull, match="clients hold staging segments"):
            plane.reserve(b"c", 4096)  # two clients' segments are all 1 MiB allows
        assert plane.reserve(b"c", 0).staging is None  # a lease without staging needs none
        plane.staging_tensor(a).fill_(7)
        assert plane.stats()["staging_used"] == 600 << 10
        clock.now += 4
        assert plane.hold(a.handle) is a  # a commit in progress: a cannot lapse under it
        clock.now += 2  # b's lease ran out; it is taken back
        st = plane.stats()
        assert st["staging_used"] == 300 << 10 and st["leases"] == 1 and st["lapsed"] == 2
        assert plane.take(b.handle) is None
        # a finish that overtook the commit still reading a's range: the range stays a's until the
        # commit is done (the client's next reserve must not get it while the daemon copies from it)
        assert plane.take(a.handle) is a
        assert plane.stats()["staging_used"] == 300 << 10
        with pytest.raises(StagingFull):
            plane.reserve(b"a", 300 << 10)
        assert plane.hold(a.handle) is None and plane.take(a.handle) is None  # ended: no new commit
        plane.done_reading(a, keep=True)
        assert plane.stats()["staging_used"] == 0 and plane.stats()["leases"] == 0
        kept = plane.reserve(b"a", 300 << 10)  # a commit of one chunk of several keeps its range
        assert plane.hold(kept.handle) is kept
        plane.done_reading(kept, keep=True)
        clock.now += 0.5
        assert plane.hold(kept.handle) is kept  # the next chunk's commit
        plane.done_reading(kept, keep=False)  # the last one gives it back
        assert plane.stats()["staging_used"] == 0 and plane.take(kept.handle) is None
        late = plane.reserve(b"a", 4096, armed=False)  # filled by the daemon first: no clock yet
        clock.now += 100
        assert plane.hold(late.handle) is late
        plane.arm(late, 1.0)
        clock.now += 2  # lapsed while read: kept until the reading is done, then given back
        assert plane.stats()["leases"] == 1 and plane.take(late.handle) is None
        plane.done_reading(late, keep=True)
        assert plane.stats()["leases"] == 0 and plane.stats()["staging_used"] == 0
    finally:
        plane.close()
    assert not list(shm_dir.iterdir())


def test_live_leases_are_bounded_per_client_and_in_all(shm_dir: Path, monkeypatch) -> None:
    # a client locating in a loop without finishing held a lease (and its blocks' pins) each time
    from kvstore.shm import plane as plane_mod

    monkeypatch.setattr(plane_mod, "MAX_LEASES", 10)
    clock = Clock()
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 18, lease=5.0, clock=clock)
    try:
        monkeypatch.setattr(plane_mod, "MAX_LEASES_PER_CLIENT", 6)
        held = [plane.reserve(b"a", 0) for _ in range(6)]
        with pytest.raises(ProtocolError, match="holds 6 shared-memory leases") as e:
            plane.reserve(b"a", 0)
        assert e.value.code == "too_many_leases"
        others = [plane.reserve(b"b", 0) for _ in range(4)]
        with pytest.raises(ProtocolError, match="at most 6; 10 for all"):
            plane.reserve(b"c", 0)  # all clients' leases together are at their bound
        assert plane.take(held[0].handle, b"a") is held[0]
        plane.reserve(b"a", 0)  # one given back: one more
        clock.now += 6  # all lapse: a sweep takes back each once
        assert plane.stats()["leases"] == 0 and plane.lapsed == 10
        assert [plane.take(x.handle) for x in others] == [None] * 4
        plane.reserve(b"a", 0)
    finally:
        plane.close()


def test_a_sweep_takes_back_lapsed_leases_only_once_their_clock_runs_out(shm_dir: Path) -> None:
    clock = Clock()
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 18, lease=5.0, clock=clock)
    try:
        a = plane.reserve(b"a", 4096, lease=1.0)
        b = plane.reserve(b"a", 4096, lease=3.0)
        clock.now += 0.5
        plane.arm(a, 4.0)  # its clock set again: 4.5 from the start
        clock.now += 1.0  # a's first clock is past, b's not
        assert plane.stats()["leases"] == 2
        clock.now += 2.0  # b's ran out
        assert plane.stats()["leases"] == 1 and plane.take(b.handle) is None
        clock.now += 1.5
        assert plane.stats()["leases"] == 0 and plane.take(a.handle) is None and plane.lapsed == 2
    finally:
        plane.close()


def test_a_lease_answers_only_the_client_that_took_it(shm_dir: Path) -> None:
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 18, lease=5.0)
    try:
        mine = plane.reserve(b"me", 4096)
        assert plane.hold(mine.handle, b"other") is None and plane.take(mine.handle, b"other") is None
        assert plane.stats()["leases"] == 1  # untouched: still this client's
        assert plane.hold(mine.handle, b"me") is mine
        plane.done_reading(mine, keep=True)
        assert plane.take(mine.handle, b"me") is mine and plane.stats()["leases"] == 0
    finally:
        plane.close()


def test_a_range_the_daemon_reads_after_its_reply_outlives_the_lease(shm_dir: Path) -> None:
    """A get's blocks from the cluster are stored from the client's staging after the reply: the range
    is not given back while that reads it, whether the client finishes or its lease lapses first."""
    clock = Clock()
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=512 << 10, lease=5.0, clock=clock)
    try:
        got = plane.reserve(b"a", 300 << 10, held="located", armed=False)
        plane.reading(got)
        plane.arm(got)
        assert plane.take(got.handle) is got  # the client finished first
        assert plane.stats()["staging_used"] == 300 << 10
        with pytest.raises(StagingFull):
            plane.reserve(b"a", 300 << 10)  # not the client's next request's yet
        plane.done_reading(got, keep=True)
        assert plane.stats()["staging_used"] == 0 and plane.stats()["leases"] == 0

        lapsing = plane.reserve(b"a", 300 << 10, held="located", armed=False)
        plane.reading(lapsing)
        plane.arm(lapsing)
        clock.now += 6  # the client paused past its lease
        st = plane.stats()
        assert st["staging_used"] == 300 << 10 and st["lapsed"] == 1
        assert plane.take(lapsing.handle) is None  # lapsed: the finish finds nothing
        plane.done_reading(lapsing, keep=True)
        assert plane.stats()["staging_used"] == 0 and plane.stats()["leases"] == 0

        quick = plane.reserve(b"a", 300 << 10, held="located", armed=False)
        plane.reading(quick)
        plane.done_reading(quick, keep=True)  # read before the reply: the lease goes on as it was
        plane.arm(quick)
        clock.now += 4
        assert plane.stats()["staging_used"] == 300 << 10
        assert plane.take(quick.handle) is quick and plane.stats()["staging_used"] == 0
    finally:
        plane.close()


def test_freeing_a_page_bumps_its_generation() -> None:
    pool = PagePool(8 * 1024, page_bytes=1024)
    a = pool.alloc(2500)
    gens = pool.generations(a)
    assert list(gens) == [1, 1, 1]  # never 0: memory given back reads 0
    pool.free(a)
    b = pool.alloc(1024)  # reuses a page of a
    assert b.pages[0] in a.pages
    assert pool.gens[b.pages[0]] == 2 and not np.array_equal(pool.generations(a), gens)


def test_a_stopping_daemon_moves_every_page_s_generation(shm_dir: Path) -> None:
    # a client mapped the generations and located a block; the daemon stops before the client's copy
    # is checked: the block reads as moved (a GPU arena is freed at exit, its bytes are anyone's)
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 20, lease=5.0)
    hbm = HbmTier(16 * 1024, page_bytes=1024, memory=plane.pools.memory("hbm", "raw"))
    hbm.put(b"x" * 32, kv(4)[:, :, :4].contiguous())
    offer = plane.offer()
    assert offer is not None
    gens = offer["segments"][0]
    client = Segment.open(gens["gens_path"], gens["gens_size"], writable=False)
    seen = client.array(gens["gens_offset"], 8 * gens["num_pages"]).view(np.uint64)
    before = seen.copy()
    plane.close(free=False)  # even where the tiers were not closed first (their own close failed)
    assert (seen == before + 1).all()
    client.close()


def test_a_stopped_daemon_s_pools_are_freed_under_a_client_s_mapping(shm_dir: Path) -> None:
    # an idle client keeps its mappings of the pools: their memory is given back all the same, and
    # what the client would read there now (zeros) matches no block it was told of
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 20, lease=5.0)
    hbm = HbmTier(64 * 1024, page_bytes=1024, memory=plane.pools.memory("hbm", "raw"))
    hbm.put(b"x" * 32, kv(4)[:, :, :4].contiguous())
    place = hbm.locate(b"x" * 32)
    offer = plane.offer()
    assert offer is not None
    seg = offer["segments"][0]
    client = Segment.open(seg["gens_path"], seg["gens_size"], writable=False)
    mapped = client.array()
    assert mapped.any() and resident(client) > 0
    plane.close()
    assert not Path(seg["gens_path"]).exists()
    assert resident(client) == 0  # freed: no page of it is held any more
    gens = client.array(seg["gens_offset"], 8 * seg["num_pages"]).view(np.uint64)
    assert not gens[list(place.pages)].any() and all(g >= 1 for g in place.gens)
    assert not mapped.any()
    client.close()


def test_the_next_daemon_frees_a_killed_daemon_s_segments_under_a_client_s_mapping(shm_dir: Path) -> None:
    # the segment a killed daemon left (no lock held on it), mapped by a client: the sweep removes it
    # and gives its memory back
    path = shm_dir / "kvs-1-0123456789abcdef01234567-ram"
    path.write_bytes(b"\x07" * (64 * 1024))
    path.chmod(0o600)
    client = Segment.open(path, 64 * 1024, writable=False)
    assert client.array().all() and resident(client) > 0
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 20, lease=5.0)
    try:
        assert not path.exists() and resident(client) == 0 and not client.array().any()
    finally:
        plane.close()
        client.close()


def resident(seg: Segment) -> int:
    """How many of ``seg``'s pages are in memory, as this process maps them (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    pages = -(-seg.size // 4096)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(seg.array().ctypes.data, seg.size, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def test_a_located_block_reads_back_from_its_extents(shm_dir: Path) -> None:
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 20, lease=5.0)
    try:
        hbm = HbmTier(16 * 1024, page_bytes=1024, memory=plane.pools.memory("hbm", "raw"))
        ram = RamTier(
            16 * 1024, get_codec("raw"), page_bytes=1024, memory=plane.pools.memory("ram", "frames")
        )
        block = kv(4)[:, :, :4].contiguous()
        hbm.put(b"x" * 32, block)
        place = hbm.locate(b"x" * 32)
        arena = hbm.pool._flat
        data = torch.cat([arena[o : o + n] for o, n in place.extents])
        assert torch.equal(data.view(block.dtype).view(block.shape), block)
        ram.put(b"y" * 32, block)
        assert sum(n for _, n in ram.locate(b"y" * 32).extents) == ram.locate(b"y" * 32).nbytes
        offer = plane.offer()
        assert offer is not None
        assert [s["role"] for s in offer["segments"]] == ["hbm", "ram"]
        hbm.close()
        ram.close()
    finally:
        plane.close()


def test_extents_merge_runs_of_pages() -> None:
    assert extents(np.array([3, 4, 5, 9, 10, 1]), 100, 550) == [(300, 300), (900, 200), (100, 50)]
    assert extents(np.array([7]), 100, 1) == [(700, 1)]


@pytest.mark.parametrize(("machine", "offered"), [("x86_64", True), ("aarch64", False), ("ppc64le", False)])
def test_shared_memory_is_offered_on_x86_64_only(
    shm_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    machine: str,
    offered: bool,
) -> None:
    # a client's generation check after a copy needs x86's memory order: elsewhere, the socket
    monkeypatch.setattr(platform, "machine", lambda: machine)
    with caplog.at_level(logging.WARNING, logger="kvstore.shm"):
        plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 18, lease=5.0)
    try:
        assert plane.offered is offered
        offer = plane.offer()
        assert (offer is not None) is offered
        why = [r.getMessage() for r in caplog.records if "not offered" in r.getMessage()]
        if offered:
            assert offer is not None and offer["instance"] == plane.instance and not why
        else:
            assert len(why) == 1 and machine in why[0] and "x86_64" in why[0]  # said once, with why
            plane.offer()
            assert len([r for r in caplog.records if "not offered" in r.getMessage()]) == 1
    finally:
        plane.close()


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_a_gpu_pool_without_cupy_is_the_daemons_own_and_not_offered(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a GPU host without a cupy that works: one warning, the hbm pool allocated as a private one, and
    # the offer names only the pools that are shared (clients read the rest through staging)
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=1 << 20, lease=5.0)
    with caplog.at_level(logging.WARNING, logger="kvstore.shm"):
        got = plane.pools.memory("hbm", "raw")(16 * 1024, 1024, 16, torch.device("cuda:0"))
    assert got is None and not plane.pools.shares("hbm")
    assert "the hbm pool on cuda:0 is not shared: sharing a pool on a GPU needs cupy" in caplog.text
    ram = RamTier(16 * 1024, get_codec("raw"), page_bytes=1024, memory=plane.pools.memory("ram", "frames"))
    offer = plane.offer()
    assert (
        offer is not None and [s["role"] for s in offer["segments"]] == ["ram"] and plane.pools.shares("ram")
    )
    ram.close()
    plane.close()
