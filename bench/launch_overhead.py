"""What a small training job's launch costs: torchrun against warm ranks (training/launch/warm_ranks.py).

    .venv/bin/python bench/launch_overhead.py [--rounds 5] [--nproc 2]

One tiny job (3 generated days of 6,000 rows, 26 tables, a DLRM of dim 8; two epochs: about
a second of training), launched three ways in turn, with a warm-rank server started once
before the rounds (its own start is reported apart):
- `torchrun`: `training.launch.launcher.launch` as a pipeline launches it, torchrun and a new
  interpreter for each rank;
- `warm`: the same with the server named: the server stands in for torchrun and forks the ranks;
- `forked`: torchrun itself (the launcher's command line, as on each host of a job across
  hosts), each rank forked by the server (`training.launch.rank`'s stand-in).
Per launch: the wall time, and the CPU time of every process the launch used (this process's
reaped children: torchrun, its ranks or their stand-ins, the client; and the server's reaped
children: its agents, watchers and ranks). The figures are the medians; the ratios are each
way ÷ torchrun of each round's pair, medianed. Every launch trains the same rows (checked on
their fingerprint here; tests/integration/test_warm_ranks.py checks every tensor). Prints one
JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaluation.config import EvaluationConfig
from ingestion.config import PreprocessConfig, SyntheticConfig
from ingestion.preprocess import apply_state, fit_state
from ingestion.synthetic import generate_day
from ingestion.warehouse import ingest_day
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.launcher import launch, torchrun_command
from training.launch.warm_ranks import ENVIRONMENT_KEY, start_server, stop_server

DAYS = (0, 1, 2)


def tiny_files(root: Path) -> tuple[dict[str, int], dict[int, list[str]]]:
    synthetic = SyntheticConfig(rows_per_day=6000, seed=11, cardinality_scale=0.001)
    preprocess = PreprocessConfig(hash_size=2000, duckdb_threads=1, row_group_size=2048)
    for day in DAYS:
        generate_day(synthetic, day, root / "raw")
        ingest_day([str(root / "raw" / f"day_{day}.tsv.gz")], day, root / "warehouse")
    state = fit_state(preprocess, root / "warehouse", root / "features", (0, 1))
    files = {}
    for day in DAYS:
        folder = apply_state(preprocess, state, root / "warehouse", root / "features", day)
        files[day] = sorted(str(path) for path in folder.glob("*.parquet"))
    return state.table_sizes, files


def job_in(out: Path, table_sizes: dict[str, int], files: dict[int, list[str]], nproc: int) -> TrainJob:
    return TrainJob(
        model=ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)),
        sharding=ShardingConfig(),
        training=TrainingConfig(nproc=nproc, batch_size=256, epochs=2, log_every=10, checkpoint_every=0),
        evaluation=EvaluationConfig(batch_size=1024, ne_window=2048),
        table_sizes=table_sizes,
        train_files=tuple(files[0] + files[1]),
        eval_files={"2": tuple(files[2])},
        out_dir=str(out),
        run_id="bench",
    )


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reaped_cpu_s(pid: int) -> float:
    """The CPU seconds of `pid`'s reaped children (the server's agents, with their ranks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def has_children(pid: int) -> bool:
    return bool(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


def torchrun_with_forked_ranks(job: TrainJob) -> None:
    """torchrun's own command line for `job`, run with the server named: each rank it starts is forked."""
    job.out.mkdir(parents=True, exist_ok=True)
    job.save(job.folder.job_file())
    env = {**os.environ, "OMP_NUM_THREADS": str(job.training.threads_per_proc)}
    subprocess.run(torchrun_command(job, job.folder.job_file()), env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip


def timed(job: TrainJob, server_pid: int | None, forked: bool = False) -> tuple[float, float]:
    before = children_cpu_s() + (reaped_cpu_s(server_pid) if server_pid else 0.0)
    began = time.perf_counter()
    if forked:
        torchrun_with_forked_ranks(job)
    else:
        launch(job, on_line=lambda line: None)
    wall = time.perf_counter() - began
    while server_pid and has_children(server_pid):  # the server reaps its agents within a second
        time.sleep(0.1)
    return wall, children_cpu_s() + (reaped_cpu_s(server_pid) if server_pid else 0.0) - before


def ratio(ours: list[float], torchrun: list[float]) -> float:
    """The median of each round's ratio."""
    return round(statistics.median(o / t for o, t in zip(ours, torchrun, strict=True)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="launch-bench-"))
    table_sizes, files = tiny_files(root)
    began = time.perf_counter()
    server = start_server(root / "warm.sock")
    server_start_s = time.perf_counter() - began
    modes = ("torchrun", "warm", "forked")
    figures: dict[str, list[float]] = {f"{mode}_{what}": [] for what in ("wall", "cpu") for mode in modes}
    fingerprints = set()
    try:
        for round_ in range(args.rounds):
            for mode in modes:
                job = job_in(root / f"{mode}-{round_}", table_sizes, files, args.nproc)
                if mode == "torchrun":
                    os.environ.pop(ENVIRONMENT_KEY, None)
                else:
                    os.environ[ENVIRONMENT_KEY] = str(root / "warm.sock")
                wall, cpu = timed(job, server.pid if mode != "torchrun" else None, forked=mode == "forked")
                figures[f"{mode}_wall"].append(wall)
                figures[f"{mode}_cpu"].append(cpu)
                fingerprints.add(job.folder.read_summary().rows_fingerprint)
                print(f"round {round_ + 1} {mode:>8}: {wall:5.2f} s wall, {cpu:5.2f} s CPU", file=sys.stderr, flush=True)
    finally:
        stop_server(server)
    result = {
        "nproc": args.nproc,
        "rounds": args.rounds,
        "server_start_s": round(server_start_s, 2),
        **{f"{key}_s": round(statistics.median(values), 2) for key, values in figures.items()},
        **{f"{mode}_{what}_ratio": ratio(figures[f"{mode}_{what}"], figures[f"torchrun_{what}"])
           for mode in modes[1:] for what in ("wall", "cpu")},
        "same_rows_trained": len(fingerprints) == 1,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
