"""Keeping freed memory in the process (training/cpu/memory.py). Each mode runs in a fresh
process, as `mallopt` settings are process-wide. Page-fault counts of a workload move with
the address-space layout from one process to the next, so this checks, through glibc's own
`mallinfo2`, where a 16 MB block is served from and whether its memory stays after `free`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.cpu import memory as cpu_memory

BLOCK = 16 << 20

PROBE = r"""
import ctypes, json, sys, torch
from training.cpu import memory as cpu_memory
if sys.argv[1] == "retain":
    assert cpu_memory.retain()

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
block = torch.ones(int(sys.argv[2]) // 4)  # touched, like an activation
live = libc.mallinfo2()
del block
freed = libc.mallinfo2()
print(json.dumps({"mapped_while_live": live.hblkhd, "heap_free_after": freed.fordblks, "heap_after": freed.arena}))
"""


def _allocator_state(mode: str) -> dict[str, int]:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", PROBE, mode, str(BLOCK)], capture_output=True, text=True,
                          check=True, cwd=root)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
@pytest.mark.skipif(not cpu_memory.available(), reason="glibc's mallopt only")
def test_a_freed_block_stays_in_the_process_for_the_next_step() -> None:
    system, retained = _allocator_state("system"), _allocator_state("retain")
    # glibc's defaults map a fresh 16 MB block and unmap it on free: the next step's block
    # is new pages, faulted in one by one
    assert system["mapped_while_live"] >= BLOCK and system["heap_free_after"] < BLOCK
    # retained: served from the heap, and still there after free for the next step to reuse
    assert retained["mapped_while_live"] < BLOCK
    assert retained["heap_free_after"] >= BLOCK and retained["heap_after"] >= BLOCK
