"""Where the test suite's CPU goes: every process it starts, by kind, and how busy the machine was.

    .venv/bin/python bench/suite_cpu.py [--workers 2] [--interval 0.5] [-- PYTEST ARGS...]

Runs pytest as `make test` does (`-n WORKERS --dist loadfile --no-loadscope-reorder`; the
arguments after `--` replace the test paths) while it reads every process's CPU time from
/proc each `--interval` seconds. A process is charged what it used between its first and
its last reading, so one that lives less than an interval is missed or undercounted (the
machine's own busy time, read from /proc/stat, is the check: the table says how much of it
the processes account for). Kinds are told apart by the command line (`process_kind`).

The suite is bound by the CPU on 2 cores (docs/performance.md), so its wall time moves with
the CPU it spends: this says which processes spend it. Prints a table, then one JSON line:
wall seconds, the machine's busy and idle core-seconds, and core-seconds and process counts
by kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")

# (kind, any of these in the command line): the first that matches names the process
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("this bench (its readings of /proc)", ("suite_cpu.py",)),
    ("temporary Prefect server", ("prefect_app:create_app",)),
    ("persistent Prefect server", ("prefect server start",)),
    ("Prefect deployment run", ("prefect.engine",)),
    ("MLflow server", ("mlflow/server", "mlflow server", "mlflow.server")),
    ("test process (xdist worker)", ("exec(eval(sys.stdin.readline()))",)),
    # before the ranks: the forkserver's command line names the trainer it preloads
    ("multiprocessing forkserver or spawned process", ("multiprocessing.forkserver", "multiprocessing.spawn")),
    ("torchrun agent", ("training.launch.agent", "torch.distributed.run", "bin/torchrun")),
    ("torchrun rank", ("training.launch.rank", "training.worker")),
    ("warm rank", ("training.launch.warm_ranks",)),
    ("warm dlrm command", ("warm_commands.py",)),
    ("dlrm command", ("flows.cli", "bin/dlrm ")),
    ("model scored in a clean venv", ("score.py",)),
    ("xz (bundle parts)", ("xz ",)),
    ("pip", ("pip install", "pip download", "-m pip")),
    ("Slurm and munge", ("slurmctld", "slurmd", "slurmstepd", "srun", "munged")),
    ("PostgreSQL", ("postgres: ", "bin/postgres")),
    ("Chromium (UI test)", ("chrom",)),
    ("pytest (controller)", ("-m pytest",)),
)


# what a process may be first seen as, before it execs the command it starts (a node's
# `sh -c 'mount … && exec "$@"'`): read again until it is something else
EXEC_WRAPPERS = frozenset({"sh", "nsenter", "unshare"})


def process_kind(command_line: str) -> str:
    """The kind of a process, from its command line (arguments joined by spaces)."""
    for kind, marks in KINDS:
        if any(mark in command_line for mark in marks):
            return kind
    executable = command_line.split(" ", 1)[0]
    return "other Python" if "python" in Path(executable).name else f"other: {Path(executable).name or '?'}"


@dataclasses.dataclass
class Sampler:
    """Each process's CPU ticks at its first and latest reading, keyed by (pid, start time)."""

    interval: float
    first: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    latest: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    command: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def read(self, count_from_zero: bool) -> None:
        """One reading of /proc; a process seen for the first time counts from 0 ticks when
        `count_from_zero` (it started after the sampling began), else from now."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                key, ticks = (pid, fields[19]), int(fields[11]) + int(fields[12])
                if key not in self.command or Path(self.command[key].split(" ", 1)[0]).name in EXEC_WRAPPERS:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                    self.command[key] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
                    self.first.setdefault(key, 0 if count_from_zero else ticks)
                self.latest[key] = ticks
            except (OSError, IndexError, ValueError):  # ended between the listing and the read
                continue

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.read(count_from_zero=True)

    def marked(self, mark: str) -> float:
        """Core-seconds of the processes whose command line holds `mark`."""
        return sum((self.latest[key] - self.first[key]) / TICKS_PER_SECOND for key in self.latest
                   if mark in self.command[key])  # fmt: skip

    def largest(self, count: int) -> list[tuple[float, str, str]]:
        """The `count` processes that used the most CPU: (core-seconds, kind, command line)."""
        used = sorted(((self.latest[key] - self.first[key]) / TICKS_PER_SECOND, key) for key in self.latest)[::-1]
        return [(round(seconds, 1), process_kind(self.command[key]), self.command[key]) for seconds, key in used[:count]]

    def by_kind(self) -> tuple[Counter[str], Counter[str]]:
        seconds: Counter[str] = Counter()
        processes: Counter[str] = Counter()
        for key, ticks in self.latest.items():
            used = (ticks - self.first[key]) / TICKS_PER_SECOND
            if used >= 0.05:  # what rounds to 0.0 in the table is left out
                kind = process_kind(self.command[key])
                seconds[kind] += used
                processes[kind] += 1
        return seconds, processes


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) ticks of every core since boot: /proc/stat's first line."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle and waiting for I/O
    return sum(values[:8]) - idle, idle


def measure(pytest_args: list[str], workers: int, interval: float, mark: str | None = None, largest: int = 0) -> dict:
    """Runs pytest and charges each process on the machine (the suite's own, and the
    servers it talks to, such as PostgreSQL) the CPU it used meanwhile; with `mark`, also
    the core-seconds of the processes whose command line holds it (`marked_core_s`)."""
    sampler = Sampler(interval)
    sampler.read(count_from_zero=False)  # what runs already is charged only what it uses from now
    thread = threading.Thread(target=sampler.run, daemon=True)
    busy_before, idle_before = machine_ticks()
    began = time.monotonic()
    thread.start()
    distribution = ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"] if workers > 0 else []
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *distribution, *pytest_args]
    env = {**os.environ, "PREFECT_HOME": os.environ.get("PREFECT_HOME", str(ROOT / ".pytest-prefect"))}
    done = subprocess.run(command, cwd=ROOT, env=env, check=False)
    wall = time.monotonic() - began
    sampler.stop.set()
    thread.join()
    sampler.read(count_from_zero=True)
    busy_after, idle_after = machine_ticks()
    seconds, processes = sampler.by_kind()
    return {
        "pytest_exit_code": done.returncode, "wall_s": round(wall, 1), "cores": os.cpu_count(),
        "machine_busy_core_s": round((busy_after - busy_before) / TICKS_PER_SECOND, 1),
        "machine_idle_core_s": round((idle_after - idle_before) / TICKS_PER_SECOND, 1),
        "processes_core_s": round(sum(seconds.values()), 1),
        "core_s_by_kind": {kind: round(value, 1) for kind, value in seconds.most_common()},
        "processes_by_kind": dict(processes.most_common()),
        **({"marked_core_s": round(sampler.marked(mark), 2)} if mark else {}),
        **({"largest": sampler.largest(largest)} if largest else {}),
    }  # fmt: skip


def show(result: dict) -> None:
    busy, idle = result["machine_busy_core_s"], result["machine_idle_core_s"]
    print(f"\npytest exit {result['pytest_exit_code']}, {result['wall_s']} s of wall time on {result['cores']} cores: "
          f"busy {busy} core-s, idle {idle} ({100 * idle / max(busy + idle, 1e-9):.1f} %); "
          f"the processes seen account for {result['processes_core_s']} core-s")  # fmt: skip
    print(f"{'core-s':>8} {'processes':>9}  kind")
    for kind, value in result["core_s_by_kind"].items():
        print(f"{value:8.1f} {result['processes_by_kind'][kind]:9d}  {kind}")
    if result.get("largest"):
        print(f"\nthe {len(result['largest'])} processes that used the most CPU:")
        for seconds, kind, command in result["largest"]:
            print(f"{seconds:8.1f}  {kind}: {command[:240]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist processes (0: none)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between readings of /proc")
    parser.add_argument("--largest", type=int, default=0, help="also list the N processes that used the most CPU")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the whole suite)")
    args = parser.parse_args()
    result = measure(args.pytest_args, args.workers, args.interval, largest=args.largest)
    show(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
