"""tests/waiting_apart.py: the last of three test processes takes only the waiting modules, the
other two every other module in order; a waiting module still queued goes to whichever process
is free once no module that computes is left. xdist's test processes are stood in for by
objects that record what they are sent (the scheduler's whole view of a process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from waiting_apart import WaitingModulesApart, scheduler_for

WAITING = frozenset({"test_slurm.py", "test_outage.py"})
# the modules as queued (the longest first), three tests each
MODULES = ("test_slurm.py", "test_stops.py", "test_hosts.py", "test_outage.py", "test_units.py", "test_small.py")


@dataclass(eq=False)
class StandInProcess:
    """What the scheduler reads of a test process and what it sends it."""

    name: str
    sent: list[int] = field(default_factory=list)
    done: int = 0
    shutting_down: bool = False

    @property
    def gateway(self) -> SimpleNamespace:
        return SimpleNamespace(id=self.name)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


COLLECTION = [f"tests/{module}::test_{n}" for module in MODULES for n in range(3)]


def _config(processes: int) -> SimpleNamespace:
    options = {"tx": [f"{processes}*popen"], "dist": "loadfile", "numprocesses": processes}
    return SimpleNamespace(getvalue=options.get, getoption=options.get, option=SimpleNamespace(loadscopereorder=False))


def _started() -> tuple[WaitingModulesApart, list[StandInProcess]]:
    scheduler = WaitingModulesApart(_config(3), WAITING)  # type: ignore[arg-type]
    nodes = [StandInProcess(f"gw{n}") for n in range(3)]
    for node in nodes:
        scheduler.add_node(node)  # type: ignore[arg-type]
        scheduler.add_node_collection(node, COLLECTION)  # type: ignore[arg-type]
    scheduler.schedule()
    return scheduler, nodes


def _run(scheduler: WaitingModulesApart, nodes: list[StandInProcess]) -> None:
    """Each of `nodes` runs one test in turn until none of them has a test left."""
    while any(node.done < len(node.sent) for node in nodes):
        for node in nodes:
            if node.done < len(node.sent):
                node.done += 1
                scheduler.mark_test_complete(node, node.sent[node.done - 1])  # type: ignore[arg-type]


def _modules(node: StandInProcess) -> list[str]:
    return list(dict.fromkeys(COLLECTION[index].split("::")[0].removeprefix("tests/") for index in node.sent))


def test_the_last_process_takes_the_waiting_modules_and_the_others_the_rest_in_order() -> None:
    scheduler, (first, second, waiting) = _started()
    _run(scheduler, [first, second, waiting])
    assert _modules(waiting) == ["test_slurm.py", "test_outage.py"]
    assert _modules(first) == ["test_stops.py", "test_units.py"]
    assert _modules(second) == ["test_hosts.py", "test_small.py"]
    assert sorted(index for node in (first, second, waiting) for index in node.sent) == list(range(len(COLLECTION)))
    assert waiting.shutting_down and not scheduler.workqueue


def test_a_waiting_module_still_queued_goes_to_a_free_process_once_nothing_else_is_left() -> None:
    scheduler, (first, second, waiting) = _started()
    _run(scheduler, [first, second])  # the waiting process is still on its first module
    assert _modules(waiting) == ["test_slurm.py"]
    assert "test_outage.py" in _modules(first) + _modules(second)
    assert _modules(first)[:2] == ["test_stops.py", "test_units.py"], "the modules that compute first"
    assert not scheduler.workqueue


@pytest.mark.parametrize("processes", [1, 2])
def test_fewer_than_three_processes_keep_xdists_own_scheduling(processes: int) -> None:
    assert scheduler_for(_config(processes), WAITING, None) is None  # type: ignore[arg-type]
    assert isinstance(scheduler_for(_config(3), WAITING, None), WaitingModulesApart)  # type: ignore[arg-type]
