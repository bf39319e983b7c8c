"""A real one-node Slurm cluster for the tests: Debian's slurmctld and slurmd (22.05) with munge,
started as root with a configuration of their own in a temporary folder (`SLURM_CONF`), on
ports of their own, and stopped afterwards. Nothing of the machine's own Slurm setup is read
or changed, except that munged runs with Debian's key (created by its package)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from services import free_port


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    node: str
    folder: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process that talks to this cluster (sbatch, scontrol, dlrm submit)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def scontrol(self, *args: str) -> str:
        done = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=60, check=False)
        return done.stdout + done.stderr


def start_cluster(folder: Path, cpus: int) -> tuple[SlurmCluster, list[subprocess.Popen]]:
    """slurmctld and one slurmd of this host, the node idle and the partition up."""
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed: `make test` installs Debian's slurm-wlm and munge")
    _start_munge()
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dlrmtest", f"SlurmctldHost={node}", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "AuthType=auth/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SwitchType=switch/none", "SchedulerType=sched/builtin", "SelectType=select/linear", "ReturnToService=2",
        "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd.log'}",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none", "MinJobAge=3600", "KillWait=5", "SchedulerParameters=defer_batch",
        f"NodeName={node} CPUs={cpus} State=UNKNOWN", f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))  # fmt: skip
    cluster = SlurmCluster(conf, node, folder)
    env = cluster.env
    daemons = [
        subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=(folder / f"{daemon}.out").open("w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
        for daemon in ("slurmctld", "slurmd")
    ]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(d.poll() is not None for d in daemons):
            break
        shown = cluster.scontrol("show", "node", node)
        if "State=IDLE" in shown:
            return cluster, daemons
        if "DOWN" in shown or "DRAIN" in shown:
            cluster.scontrol("update", f"NodeName={node}", "State=RESUME")
        time.sleep(1)
    logs = "".join((folder / name).read_text()[-2000:] for name in ("slurmctld.out", "slurmd.out", "slurmctld.log",
                                                                     "slurmd.log") if (folder / name).is_file())  # fmt: skip
    stop_cluster(daemons)
    raise RuntimeError(f"the test Slurm cluster did not come up:\n{logs}")


def stop_cluster(daemons: list[subprocess.Popen]) -> None:
    for daemon in reversed(daemons):
        try:
            os.killpg(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_munge() -> None:
    """munged with Debian's key, unless it runs already."""
    if subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode == 0:
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    subprocess.run(["chown", "munge:munge", "/run/munge"], check=False)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=30)
    deadline = time.monotonic() + 20
    while subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode and time.monotonic() < deadline:
        time.sleep(0.5)
