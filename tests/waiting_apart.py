"""pytest-xdist's module-by-module scheduling (`--dist loadfile`), with the modules that mostly
wait kept apart in a test process of their own.

`make test` runs three test processes on a 2-core machine. The last one takes only the
modules that spend much of their time waiting (`WAITING_MODULES` in tests/conftest.py:
Slurm's holds and polls, servers starting, a tracking server's outage); the other two take
every other module, in the order given (the longest first). The waits of the one fill the
cores the other two leave idle. Three processes that each took any module kept the cores as
busy but ended no sooner: two long modules that compute, side by side with a third, only
slowed each other (docs/performance.md).

When no waiting module is left for it, the last process ends; a module that computes never
goes to it. A waiting module still queued when the last process is busy goes to whichever
other process asks first, so that no module waits for a busy process while another is free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController


class WaitingModulesApart(LoadFileScheduling):
    def __init__(self, config: pytest.Config, waiting: frozenset[str], log: Producer | None = None) -> None:
        super().__init__(config, log)
        self.waiting = waiting
        self.waiting_node_id = f"gw{self.numnodes - 1}"  # the last test process

    def _next_module(self, node: WorkerController) -> str | None:
        """The first queued module for `node`: one of its kind; for a process that computes,
        a waiting one when no module that computes is left."""
        takes_waiting = node.gateway.id == self.waiting_node_id
        own_kind = (scope for scope in self.workqueue if (Path(scope).name in self.waiting) == takes_waiting)
        first = next(own_kind, None)
        if first is None and not takes_waiting:
            first = next(iter(self.workqueue), None)
        return first

    def _assign_work_unit(self, node: WorkerController) -> None:
        module = self._next_module(node)
        if module is None:
            return
        work_unit = self.workqueue.pop(module)
        self.assigned_work.setdefault(node, {})[module] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if self._next_module(node) is None:
            node.shutdown()  # it ends once what it was sent has run
            return
        if self._pending_of(self.assigned_work[node]) > 2:  # as xdist: the next module before the last tests
            return
        self._assign_work_unit(node)


def scheduler_for(config: pytest.Config, waiting: frozenset[str], log: Producer | None) -> WaitingModulesApart | None:
    """`WaitingModulesApart` for `--dist loadfile` with three test processes or more; None (xdist's
    own scheduling) otherwise."""
    if config.getoption("dist") != "loadfile" or int(config.getoption("numprocesses") or 0) < 3:
        return None
    return WaitingModulesApart(config, waiting, log)
