"""A client checks every located block before reading it, and every page's generation after; what it
page-locked for GPU copies is unlocked before its mapping goes, closed or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.shm.mapping import SharedMapping, _first_moved, _Mapped
from kvstore.shm.segment import ShmUnavailable

GENS = np.zeros(4, np.uint64)  # the pool's page generations, as the daemon bumps them


def mapping() -> SharedMapping:
    m = SharedMapping({"instance": "test", "per_client": 0, "segments": []})
    m.mapped = [_Mapped("ram", "frames", torch.zeros(4096, dtype=torch.uint8), GENS, [])]
    return m


def block(off: int, length: int, pages: list[int], gens: list[int]) -> list[object]:
    return [
        0,
        np.array([[off, length]], "<i8").tobytes(),
        np.array(pages, "<i8").tobytes(),
        np.array(gens, "<u8").tobytes(),
    ]


def test_blocks_inside_the_segment_are_located() -> None:
    got = mapping()._parse([block(0, 1024, [0], [0]), block(1024, 3072, [1, 2, 3], [0, 0, 0])], None)
    assert [e.tolist() for _, e, _, _ in got] == [[[0, 1024]], [[1024, 3072]]]


@pytest.mark.parametrize(
    ("second", "says"),
    [
        (block(4000, 100, [3], [0]), "block 1's extents are outside"),
        (block(-8, 8, [0], [0]), "block 1's extents are outside"),
        (block(8, -8, [0], [0]), "block 1's extents are outside"),
        (block(0, 8, [4], [0]), "block 1 names pages outside"),
        (block(0, 8, [-1], [0]), "block 1 names pages outside"),
        (block(0, 8, [0, 1], [0]), "block 1 names 2 pages and 1 generations"),
        ([7, b"", b"", b""], "block 1 is located in segment 7"),
        ([0, b"\x00" * 5, b"", b""], "located block 1 is malformed"),
    ],
)
def test_a_malformed_block_is_refused_by_its_index(second: list[object], says: str) -> None:
    with pytest.raises(ShmUnavailable, match=says):
        mapping()._parse([block(0, 8, [0], [0]), second, block(16, 8, [2], [0])], None)


def test_the_first_block_whose_generations_moved_ends_the_result() -> None:
    located = mapping()._parse(
        [block(0, 8, [0], [5]), block(8, 8, [1, 2], [5, 5]), block(16, 8, [3], [5])], None
    )
    GENS[:] = 5
    assert _first_moved(located) is None
    GENS[2] = 6  # block 1's second page was freed
    assert _first_moved(located) == 1


def test_a_mapping_dropped_without_close_undoes_its_page_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    # a client that never closed: its segments unmap as they are collected, and the driver must not
    # keep their pages locked (the lock itself needs a GPU: it is the bookkeeping that is tested)
    import gc

    import kvstore.shm.cuda as cuda
    from kvstore.shm.mapping import SharedMapping

    undone: list[int] = []
    monkeypatch.setattr(cuda, "host_unregister", undone.append)
    m = SharedMapping({"instance": "test", "per_client": 4096, "segments": []})
    m._registered.extend([0x7F0000000000, 0x7F0000100000])  # as two GPU reads locked them
    del m
    gc.collect()
    assert undone == [0x7F0000000000, 0x7F0000100000]
    closed = SharedMapping({"instance": "test", "per_client": 4096, "segments": []})
    closed.close()  # close() unlocks what it locked itself: nothing is left for the collector
    del closed
    gc.collect()
    assert undone == [0x7F0000000000, 0x7F0000100000]
