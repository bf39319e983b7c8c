"""training/launch/agent.py: torchrun's agent as the launcher starts it, reading torchrun's own
arguments (every torchrun test trains through it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from training.launch.launcher import AGENT_MODULE, RANK_MODULE

ROOT = Path(__file__).resolve().parents[4]


def test_the_agent_is_torchrun_with_torchruns_arguments() -> None:
    done = subprocess.run([sys.executable, "-m", AGENT_MODULE, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--nproc-per-node" in done.stdout and "--standalone" in done.stdout and "training_script" in done.stdout
    refused = subprocess.run([sys.executable, "-m", AGENT_MODULE, "--no-such-option", "-m", RANK_MODULE, "job.json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert refused.returncode == 2 and "unrecognized arguments: --no-such-option" in refused.stderr, refused.stderr[-2000:]
