"""A real two-node Slurm cluster for the tests: Debian's slurmctld and two slurmd (22.05) with
munge, each node a Linux network namespace of its own joined to the other by a veth pair (as
tests/integration/test_multi_host.py simulates hosts), started as root with a configuration of
their own in a temporary folder (`SLURM_CONF`) and stopped afterwards.

Node 0's namespace holds the controller too: it is the head node, where `dlrm submit` and the
Slurm commands run (`SlurmCluster.command`). A node's processes enter only its network
namespace (`nsenter --net`: `ip netns exec` would mount a fresh /sys, without the cgroup
hierarchy slurmd needs) and a mount namespace of their own, where a hosts file resolving both
node names, as a cluster's DNS would, is bound over /etc/hosts. Nothing of the machine's own
Slurm setup is read or changed, except that munged runs with Debian's key (created by its
package); munge's socket is a file, shared by the namespaces."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NODES = {"dlrm-sn0": "10.201.9.1", "dlrm-sn1": "10.201.9.2"}  # node name: its address
NAMESPACES = {"dlrm-sn0": "dlrm-slurm-h0", "dlrm-sn1": "dlrm-slurm-h1"}
VETH = ("dlrms-h0", "dlrms-h1")
SLURMCTLD_PORT, SLURMD_PORT = 6917, 6918  # each namespace has ports of its own


class ClusterUnavailable(RuntimeError):
    """This machine cannot run the test cluster (not root, no `ip netns`); the tests skip."""


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    nodes: tuple[str, ...]
    folder: Path

    @property
    def head(self) -> str:
        """The namespace of node 0, where the controller runs and jobs are submitted from."""
        return NAMESPACES[self.nodes[0]]

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process that talks to this cluster (sbatch, scontrol, dlrm submit)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, *args: str) -> list[str]:
        """`args` run on the head node."""
        return on_node(self.nodes[0], args)

    def scontrol(self, *args: str) -> str:
        done = subprocess.run(self.command("scontrol", *args), env=self.env, capture_output=True, text=True, timeout=60,
                              check=False)  # fmt: skip
        return done.stdout + done.stderr

    def job_state(self, job_id: str) -> str:
        shown = self.scontrol("show", "job", "--oneliner", job_id)
        return shown.split("JobState=")[1].split()[0] if "JobState=" in shown else ""

    def pending_rpcs(self) -> str:
        """The messages the controller still has to deliver to a node it could not reach, as
        `sdiag` lists them ("" when none): slurmctld queues them and retries once a minute."""
        done = subprocess.run(self.command("sdiag"), env=self.env, capture_output=True, text=True, timeout=60, check=False)
        listed = done.stdout.split("Pending RPC statistics", 1)[-1] if done.returncode == 0 else done.stderr or "sdiag failed"
        return "" if "No pending RPCs" in listed else listed.strip()


def start_cluster(folder: Path, cpus: int) -> tuple[SlurmCluster, list[subprocess.Popen]]:
    """The namespaces, slurmctld and both slurmd; every node idle and the partition up."""
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed: `make test` installs Debian's slurm-wlm and munge")
    _make_namespaces()
    _start_munge()
    for sub in ("state", "spool-dlrm-sn0", "spool-dlrm-sn1"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    controller = socket.gethostname().split(".")[0]  # slurmctld runs only where its host name is configured
    names = list(NODES)
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dlrmtest", f"SlurmctldHost={controller}({NODES[names[0]]})", f"SlurmctldPort={SLURMCTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}", "AuthType=auth/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "MpiDefault=none", "SwitchType=switch/none", "SchedulerType=sched/builtin", "SelectType=select/linear",
        "ReturnToService=2", "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool-%n'}", f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd-%n.pid'}", f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd-%n.log'}", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "JobCompType=jobcomp/none", "MinJobAge=3600", "KillWait=5",
        # A lost node is down in about 15 s, not 300: slurmctld retries each message to it for
        # MessageTimeout (the job's signal, then a ping) before SlurmdTimeout may lapse; at the
        # default 10 s, 26–30 s went by from the node's loss to the job's requeue.
        "SchedulerParameters=defer_batch", "SlurmdTimeout=10", "MessageTimeout=5",
        *(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN" for name, address in NODES.items()),
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))  # fmt: skip
    cluster = SlurmCluster(conf, tuple(names), folder)
    daemons = [_daemon(cluster, names[0], ["slurmctld", "-D", "-f", str(conf)], "slurmctld")]
    daemons += [_daemon(cluster, name, ["slurmd", "-D", "-f", str(conf), "-N", name], f"slurmd-{name}") for name in names]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and all(d.poll() is None for d in daemons):
        shown = {name: cluster.scontrol("show", "node", name) for name in names}
        if all("State=IDLE" in text for text in shown.values()):
            return cluster, daemons
        for name, text in shown.items():
            if "DOWN" in text or "DRAIN" in text:
                cluster.scontrol("update", f"NodeName={name}", "State=RESUME")
        time.sleep(1)
    logs = "".join(p.read_text()[-2000:] for p in sorted(folder.glob("*.log")) + sorted(folder.glob("*.out")))
    stop_cluster(daemons)
    raise RuntimeError(f"the test Slurm cluster did not come up:\n{logs}")


def on_node(node: str, command: Sequence[str]) -> list[str]:
    """`command` as run on `node`: in its network namespace, with its hosts file. Each tool
    execs the next, so the returned command's process is `command`'s, and signals reach it."""
    namespace = NAMESPACES[node]
    bind_hosts = f'mount --bind /etc/netns/{namespace}/hosts /etc/hosts && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--mount", "--propagation", "private",
            "sh", "-c", bind_hosts, "sh", *command]  # fmt: skip


def _daemon(cluster: SlurmCluster, node: str, command: Sequence[str], name: str) -> subprocess.Popen:
    return subprocess.Popen(on_node(node, command), env=cluster.env,
                            stdout=(cluster.folder / f"{name}.out").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def kill_node(node: str) -> int:
    """The node lost at once: every process in its namespace (its slurmd, the job's step
    daemons and training processes) killed outright. How many there were."""
    pids = _pids_in(NAMESPACES[node])
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def restart_node(cluster: SlurmCluster, node: str) -> subprocess.Popen:
    """The node back: a fresh slurmd, which registers and returns to service (ReturnToService=2)."""
    return _daemon(cluster, node, ["slurmd", "-D", "-f", str(cluster.conf), "-N", node], f"slurmd-{node}-again")


def stop_cluster(daemons: list[subprocess.Popen]) -> None:
    for daemon in reversed(daemons):
        try:
            os.killpg(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for node in NODES:  # a restarted slurmd, or anything a test left on a node
        kill_node(node)
    _remove_namespaces()


def _pids_in(namespace: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False).stdout
    return [int(pid) for pid in listed.split()]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _make_namespaces() -> None:
    """One namespace a node, joined by a veth pair, each resolving both node names."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise ClusterUnavailable("a two-node Slurm cluster needs root and iproute2 (`ip netns`)")
    _remove_namespaces()
    hosts = "127.0.0.1 localhost\n" + "".join(f"{address} {name}\n" for name, address in NODES.items())
    try:
        for node, namespace in NAMESPACES.items():
            _ip("netns", "add", namespace)
            Path("/etc/netns", namespace).mkdir(parents=True, exist_ok=True)
            Path("/etc/netns", namespace, "hosts").write_text(hosts)
        _ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for veth, (node, namespace) in zip(VETH, NAMESPACES.items(), strict=True):
            _ip("link", "set", veth, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{NODES[node]}/24", "dev", veth)
            _ip("-n", namespace, "link", "set", veth, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as error:
        _remove_namespaces()
        raise ClusterUnavailable(f"this machine cannot create network namespaces: {error.stderr.strip()}") from None


def _remove_namespaces() -> None:
    for namespace in NAMESPACES.values():
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        shutil.rmtree(Path("/etc/netns", namespace), ignore_errors=True)
    # a pair left in this namespace by a run stopped between making it and moving its ends
    subprocess.run(["ip", "link", "del", VETH[0]], capture_output=True, check=False)


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
