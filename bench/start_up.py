"""What the cyclic garbage collector costs a process's start: its imports as they run today
(with `training.launch.interpreter.imports_without_collection`) against the same imports with
the collector left on.

    .venv/bin/python bench/start_up.py [--rounds 5] [--only pipeline_run,retune_run]

Six start-ups, each in a new interpreter, which imports what that process imports and ends
as it ends:
- command: what `dlrm run` imports before its pipeline starts (the pipeline, its reports, the
  local Prefect server's control), then a normal exit;
- rank: what torchrun's rank imports (`training.worker`), then `os._exit` as a rank leaves;
- agent: what torchrun's agent imports (`torch.distributed.run`), then a normal exit;
- server: what the temporary Prefect server's app imports, then a normal exit;
- pipeline_run, retune_run: a deployment's flow run (`python -m prefect.engine`, which `dlrm
  serve` starts for the nightly, retrain and retune deployments): Prefect's engine (its own
  start, collected either way), then the flow's file, then `os._exit` (timed to its imports).

The collected way replaces `imports_without_collection` with a block that does nothing before
anything imports it, so a module that pauses the collector itself (the deployments' files) is
timed both ways too.

Per start-up and way: the wall time and the CPU time (user + system) of the interpreter,
medians over alternating rounds; each ratio is paused ÷ collected of a round's pair,
medianed. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (what runs first, as it does in that process; the modules imported; how it ends)
START_UPS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "command": ("", ("flows.deployments.pipeline", "flows.run.reports", "flows.stages.local_server"), ""),
    "rank": ("", ("training.worker",), "import os; os._exit(0)"),
    "agent": ("", ("torch.distributed.run",), ""),
    "server": ("", ("prefect.server.api.server", "flows.stages.prefect_database"), ""),
    "pipeline_run": ("import prefect.engine", ("flows.deployments.pipeline",), "import os; os._exit(0)"),
    "retune_run": ("import prefect.engine", ("flows.tuning.retune",), "import os; os._exit(0)"),
}
# the collected way: the pause a module asks for does nothing
NO_PAUSE = "import contextlib, training.launch.interpreter as i; i.imports_without_collection = contextlib.nullcontext"


def code_of(first: str, modules: tuple[str, ...], ending: str, paused: bool) -> str:
    imports = "; ".join(f"importlib.import_module({name!r})" for name in modules)
    if paused:
        body = ("from training.launch.interpreter import imports_without_collection\n"
                f"with imports_without_collection():\n    {imports}\n")  # fmt: skip
    else:
        body = f"{NO_PAUSE}\n{imports}\n"
    return f"import importlib\n{first}\n{body}{ending}\n"


def timed(code: str) -> tuple[float, float]:
    """(wall, CPU) seconds of a new interpreter running `code` in the repository."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help=f"comma-separated, of {', '.join(START_UPS)}")
    args = parser.parse_args()
    figures: dict[str, float | int] = {"rounds": args.rounds}
    chosen = args.only.split(",") if args.only else list(START_UPS)
    for name in chosen:
        first, modules, ending = START_UPS[name]
        timed(code_of(first, modules, ending, paused=True))  # the bytecode caches written before the rounds
        rounds = []
        for _ in range(args.rounds):
            collected = timed(code_of(first, modules, ending, paused=False))
            paused = timed(code_of(first, modules, ending, paused=True))
            rounds.append((collected, paused))
        for way, index in (("collected", 0), ("paused", 1)):
            figures[f"{name}_{way}_wall_s"] = round(statistics.median(r[index][0] for r in rounds), 3)
            figures[f"{name}_{way}_cpu_s"] = round(statistics.median(r[index][1] for r in rounds), 3)
        figures[f"{name}_wall_ratio"] = round(statistics.median(p[0] / c[0] for c, p in rounds), 3)
        figures[f"{name}_cpu_ratio"] = round(statistics.median(p[1] / c[1] for c, p in rounds), 3)
        print(f"{name}: {figures[f'{name}_collected_wall_s']} s → {figures[f'{name}_paused_wall_s']} s "
              f"(CPU ratio {figures[f'{name}_cpu_ratio']})", file=sys.stderr, flush=True)  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
