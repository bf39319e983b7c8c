"""Keeping freed memory in the process (training/cpu_memory.py): training steps stop
faulting their buffers in again. Each mode runs in its own process, as `mallopt` settings
are process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from training import cpu_memory

STEPS = r"""
import resource, sys, torch
from training import cpu_memory
if sys.argv[1] == "retain":
    assert cpu_memory.retain()
torch.manual_seed(0)
torch.set_num_threads(2)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 1))
optimizer = torch.optim.Adam(model.parameters())
batch = torch.randn(2048, 64)
def step():
    optimizer.zero_grad()
    model(batch).sum().backward()
    optimizer.step()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def _faults_per_step(mode: str) -> float:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True, cwd=root
    )
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not cpu_memory.available(), reason="glibc's mallopt only")
def test_retained_memory_cuts_the_page_faults_of_training_steps() -> None:
    system, retained = _faults_per_step("system"), _faults_per_step("retain")
    # seen on a Zen 4 EPYC: ~1,300 faults a step with glibc's defaults, ~100 retained
    assert system > 500, (
        f"glibc's defaults fault {system:.0f} pages a step: the comparison shows nothing"
    )
    assert retained < system / 4, (system, retained)
