"""A job's hosts from a Slurm allocation (training/launch/slurm.py): the environment Slurm
gives each task, as `sbatch` and `srun` write it, and the lines that refuse what cannot work."""

import argparse

import pytest

from flows.cli.commands import UserError, _with_slurm_hosts
from training.launch.slurm import SlurmError, first_host, slurm_allocation

# what `srun --ntasks-per-node=1` gives the task on the second of three nodes of job 51234
STEP = {"SLURM_JOB_ID": "51234", "SLURM_NNODES": "3", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-09]",
        "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NODELIST": "gpu[07-09]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_TASKS_PER_NODE": "8(x3)"}  # fmt: skip


@pytest.mark.parametrize(("nodelist", "first"), [
    ("gpu[07-09,12]", "gpu07"), ("node1", "node1"), ("a[3],b[1-2]", "a3"), ("rack[2-3]-n[01-04],login", "rack2-n01"),
    ("n[010-012]", "n010"), ("c1,c2", "c1"),
])  # fmt: skip
def test_the_first_host_of_a_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_outside_slurm_there_is_no_allocation():
    assert slurm_allocation({"PATH": "/bin"}) is None


def test_a_step_task_knows_its_node_and_node_0_and_a_port_of_its_own_job():
    allocation = slurm_allocation(STEP)
    assert (allocation.nnodes, allocation.node_rank, allocation.first_host) == (3, 1, "gpu07")
    assert allocation.endpoint == f"gpu07:{29_400 + 51234 % 1000}", "two jobs on one node meet at different ports"
    assert slurm_allocation({**STEP, "SLURM_JOB_ID": "51235"}).endpoint != allocation.endpoint
    fewer = {**STEP, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_NODEID": "0"}
    assert (slurm_allocation(fewer).nnodes, slurm_allocation(fewer).first_host) == (2, "gpu08"), "the step's nodes"


def test_what_cannot_run_is_refused_with_the_line_that_fixes_it():
    batch_script = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(SlurmError, match="srun --ntasks-per-node=1 dlrm train"):
        slurm_allocation(batch_script)
    assert slurm_allocation({**batch_script, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu07"}).nnodes == 1, (
        "one node: the batch script may train itself"
    )
    with pytest.raises(SlurmError, match="one `dlrm train` a node"):
        slurm_allocation({**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x3)"})
    with pytest.raises(SlurmError, match="not a host list"):
        first_host("gpu[07")


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"nnodes": None, "node_rank": None, "rdzv_endpoint": None, **given})


def test_dlrm_train_takes_its_hosts_from_slurm_and_refuses_flags_that_disagree(capsys):
    taken = _with_slurm_hosts(_args(), STEP)
    assert (taken.nnodes, taken.node_rank, taken.rdzv_endpoint) == (3, 1, "gpu07:29634")
    assert "Slurm job 51234: node 1 of 3, rendezvous at gpu07:29634" in capsys.readouterr().err
    assert _with_slurm_hosts(_args(rdzv_endpoint="10.0.0.1:29400"), STEP).rdzv_endpoint == "10.0.0.1:29400"
    assert _with_slurm_hosts(_args(nnodes=3, node_rank=1), STEP).node_rank == 1, "flags that agree are fine"
    with pytest.raises(UserError, match="--nnodes 2, but Slurm job 51234 puts this task at --nnodes 3"):
        _with_slurm_hosts(_args(nnodes=2), STEP)
    with pytest.raises(UserError, match="--node-rank 0"):
        _with_slurm_hosts(_args(node_rank=0), STEP)
    assert _with_slurm_hosts(_args(nnodes=2), {}).nnodes == 2, "outside Slurm the flags stand"
