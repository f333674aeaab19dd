"""The daemon's malloc tuning (kvstore/daemon/heap.py), in child processes so this one keeps glibc's defaults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# A worker thread decoding: six 3 MB temporaries alive at once, freed, again, 20 times; prints the
# pages faulted in over those 20 rounds.
PROBE = """
import resource, sys, threading, torch
from kvstore.daemon.heap import keep_scratch
if sys.argv[1] == "tuned":
    assert keep_scratch()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rounds(n):
    for _ in range(n):
        held = [torch.empty(3 * 2**20, dtype=torch.uint8).fill_(1) for _ in range(6)]
        del held
got = []
def work():
    rounds(3)
    before = faults()
    rounds(20)
    got.append(faults() - before)
t = threading.Thread(target=work)
t.start()
t.join()
print(got[0])
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_temporaries_stay_in_the_heap_instead_of_being_faulted_in_again() -> None:
    pages = 20 * 6 * 3 * 2**20 // 4096
    faulted = {}
    for mode in ("default", "tuned"):
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True
        )
        faulted[mode] = int(out.stdout.split()[-1])
    assert faulted["default"] > pages // 2, faulted  # glibc's defaults: most pages mapped afresh each round
    assert faulted["tuned"] < pages // 20, faulted  # kept: the rounds after the first fault in (almost) none
