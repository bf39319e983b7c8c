"""How a test process shares the machine's cores with the other test processes (tests/conftest.py
applies it before torch is imported; this module imports torch only once it has set the policy).

Under pytest-xdist, two test processes share two cores. torch's OpenMP threads wait actively
after each parallel region (they spin for a while), so a test process's regression fit or
compiled model held the core the other process, or the commands and ranks it started,
needed: two fits of 8,000 rows side by side took 9.5 s each against 1.2 s alone. So:

- **a test process** keeps every core for its own work (its unit tests have both when the
  other process waits on a server), its threads waiting passively (`OMP_WAIT_POLICY`);
- **what it starts** (`dlrm` commands, simulated hosts, servers) inherits its share of the
  cores (`OMP_NUM_THREADS`). Training ranks set their own (`training.threads_per_proc`), as does
  the reference's fit (flows/stages/evaluate.py).

The whole suite on 2 cores, warm: 700–702 s of pytest as it was, 700 s with one thread in
every process (the unit tests lost what the end-to-end ones gained), 593 s so
(docs/performance.md).
"""

from __future__ import annotations

import os

shared = False  # share_the_cores applied it in this process
developers_own = False  # … or found the developer's own OMP_NUM_THREADS and changed nothing


def share_the_cores() -> None:
    """In a test process under pytest-xdist, before torch is imported: torch on every core with
    passive threads here, the share in what it starts. A developer's own OMP_NUM_THREADS (then
    nothing is changed) or OMP_WAIT_POLICY wins."""
    global shared, developers_own
    share = share_of_the_cores()
    developers_own = share is not None and "OMP_NUM_THREADS" in os.environ
    if share is None or developers_own:
        return
    own_policy = "OMP_WAIT_POLICY" in os.environ
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # libgomp reads it once, as torch loads it
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    if not own_policy:
        del os.environ["OMP_WAIT_POLICY"]
    os.environ["OMP_NUM_THREADS"] = str(share)  # for what this process starts
    shared = True


def share_of_the_cores() -> int | None:
    """A test process's share of the cores under pytest-xdist (None outside it)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    return max(1, len(os.sched_getaffinity(0)) // int(workers)) if workers else None
