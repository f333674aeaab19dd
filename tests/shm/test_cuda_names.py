"""Which local GPU a daemon's GPU pool is: matched by UUID, since ``cuda:N`` depends on what each process
sees (CUDA_VISIBLE_DEVICES). The GPUs are stand-ins here: the matching is what is tested."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstore.shm.cuda import local_device


@pytest.fixture
def three_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    uuids = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))


@pytest.mark.usefixtures("three_gpus")
def test_the_daemons_gpu_is_found_by_uuid_whatever_its_index_there() -> None:
    # the daemon sees all three and names its pool cuda:2; this client may see it as cuda:2
    assert local_device("GPU-cccc", "cuda:2") == "cuda:2"
    # ... and a client that sees only other GPUs, or the same ones in another order, never opens a wrong one
    assert local_device("GPU-bbbb", "cuda:0") == "cuda:1"
    assert local_device("GPU-dddd", "cuda:0") is None


@pytest.mark.usefixtures("three_gpus")
def test_an_offer_without_a_uuid_keeps_the_daemons_name() -> None:
    assert local_device(None, "cuda:1") == "cuda:1"
    assert local_device("", "cuda:0") == "cuda:0"
