"""The host time this trainer adds to a step, against TorchRec's stock loop, and where it goes.

    .venv/bin/python bench/step_overhead.py [--batch 256] [--steps 400] [--rounds 7] [--decay none|cosine]

A model too small for its own arithmetic to matter (26 tables of 1,000 rows × 8, MLPs 13-16-8
and 16-1) on one process (gloo, this host's device), built once, the way the trainer builds it
(its CPU kernels on a CPU host, the row-wise Adagrad fused into the embeddings' backward, Adam
for the MLPs): every millisecond one loop spends beyond the other is that loop's own host work,
the time a GPU would wait for it.

- stock: TorchRec's loop on the same model and optimizer, as its examples write it: read a
  batch, move it to the device, forward, zero_grad, backward, step (TrainPipelineSparseDist on
  CUDA).
- trainer: `training.trainer.train` on the same batches (a job of the same files, seed and
  batch): the scheduled rates (`--decay`), the trained-rows ledger, the training NE, the
  checkpoint position, the managed-ids hook, progress records every 20 steps.

Each loop runs `--steps` steps per round, alternating for `--rounds` rounds; a round is timed
from its step 20 (the trainer's first progress record) to its last, by the trainer's records'
own clock and by the stock loop's: the same window, setup and teardown outside it. The
times are the medians; `ratio` is the median of each round's trainer ÷ stock (the two run
side by side in time, so the machine's drift moves their ratio least). Then one
more trainer round with each part of its host work timed (`parts_ms_per_step`): reading and
building the batch, the ledger's row hashes and sums, the rates, the metrics, the
checkpoint bookkeeping, managed ids, the clocks; `model_ms_per_step` is the rest.
Prints one JSON line last: trainer_ms_per_step, stock_ms_per_step, ratio (trainer ÷ stock),
parts_ms_per_step, and the setup.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu import sync, timed_stock_steps  # bench/gpu.py, beside this script

import ingestion.reader as reader_module
import training.loop.batches as batches_module
import training.trainer as trainer_module
from evaluation.config import EvaluationConfig
from ingestion.config import PreprocessConfig, SyntheticConfig
from ingestion.preprocess import apply_state, fit_state
from ingestion.reader import build_reader
from ingestion.synthetic import generate_day
from ingestion.warehouse import ingest_day
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.device import runtime_device
from training.loop.batches import reader_prefetch
from training.loop.checkpoint import RowLedger
from training.loop.meters import TrainingNE, TrainTimer
from training.loop.optimizers import attach_embedding_optimizer, build_optimizer
from training.loop.progress import read_records
from training.loop.schedule import LRSchedule, build_schedule
from training.model.build import build_train_model, start_at_click_rate
from training.sharding.plan import shard_model
from training.worker import exit_skipping_teardown

TABLE_ROWS = 1_000
MODEL = ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))
LOG_EVERY = 20  # the trainer's progress records: the timed window starts at the first
READING, HASHES = "reading and building the batch", "row ledger: hashes"
HASHES_AHEAD = "row ledger: hashes (reader thread, off the step)"


def prepare(folder: Path, rows: int) -> list[str]:
    config = SyntheticConfig(rows_per_day=rows, seed=7, cardinality_scale=0.001)
    generate_day(config, 0, folder / "raw")
    ingest_day([str(folder / "raw" / "day_0.tsv.gz")], 0, folder / "warehouse")
    preprocess = PreprocessConfig(hash_size=TABLE_ROWS, duckdb_threads=1)
    state = fit_state(preprocess, folder / "warehouse", folder / "features", (0,))
    written = apply_state(preprocess, state, folder / "warehouse", folder / "features", 0)
    return [str(p) for p in sorted(written.glob("*.parquet"))]


def build(job: TrainJob, device: torch.device):
    """The job's model, optimizer and schedule, as the worker builds them (training/worker.py)."""
    torch.manual_seed(job.training.seed)
    model = build_train_model(job.model, job.table_sizes, torch.device("meta"), job.dense_features)
    if device.type == "cpu":
        from training.cpu import accelerate

        accelerate(model, job.training.cpu, job.training.precision)
    attach_embedding_optimizer(model, job.training)
    sharded, _ = shard_model(model, job.sharding, device, job.training.batch_size)
    start_at_click_rate(sharded, 0.25)
    optimizer = build_optimizer(sharded, job.training)
    return sharded, optimizer, build_schedule(sharded, optimizer, job.training)


def stock_round(model, optimizer, job: TrainJob, device: torch.device, steps: int) -> float:
    """TorchRec's loop over the job's batches: ms per step from step LOG_EVERY to the last
    (the window the trainer's records time)."""
    # read ahead in a background thread where the trainer does (a spare core), as a DataLoader's worker would
    reader = build_reader(list(job.train_files), job.training.batch_size, 0, 1, shuffle_seed=job.training.seed,
                          drop_remainder=False, prefetch=reader_prefetch(job.training))  # fmt: skip
    seconds = timed_stock_steps(model, optimizer, iter(reader), device, LOG_EVERY, steps - LOG_EVERY)
    return 1000 * seconds / (steps - LOG_EVERY)


def trainer_round(model, optimizer, schedule, job: TrainJob, device: torch.device) -> float:
    """This trainer over the same batches: ms per step from its first progress record (step
    LOG_EVERY) to its last, by the records' own clock (each taken as its step was logged)."""
    before = len(read_records(job.folder.metrics)) if job.folder.metrics.is_file() else 0
    schedule.applied = None  # a round starts its schedule afresh, as a launch does
    trainer_module.train(model, optimizer, job, device, schedule)
    records = [r for r in read_records(job.folder.metrics)[before:] if r.kind == "train"]
    first, last = records[0], records[-1]
    return 1000 * (last.elapsed_s - first.elapsed_s) / (last.step - first.step)


class PartTimes:
    """Seconds spent in each named part of the trainer's host work."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - started

        return timed

    def generator(self, part: str, function: Callable[..., Iterator]) -> Callable[..., Iterator]:
        """Time each `next` of the generator `function` returns (the reading happens there)."""

        def timed(*args, **kwargs) -> Iterator:
            inner = function(*args, **kwargs)
            while True:
                started = time.perf_counter()
                try:
                    item = next(inner)
                except StopIteration:
                    return
                finally:
                    self.seconds[part] += time.perf_counter() - started
                yield item

        return timed


@contextlib.contextmanager
def instrumented(times: PartTimes) -> Iterator[None]:
    """The trainer's host work, each part wrapped in a timer (restored afterwards)."""
    patches = [
        (reader_module, "row_hashes", HASHES),  # called while reading: subtracted from it
        (RowLedger, "add", "row ledger: sums"),
        (LRSchedule, "apply", "rates"),
        (TrainingNE, "add", "metrics"),
        (TrainingNE, "maybe_log", "metrics"),
        (trainer_module, "maybe_evaluate", "metrics"),
        (trainer_module, "maybe_checkpoint", "checkpoint bookkeeping"),
        (batches_module.TrainBatches, "pop_trained", "checkpoint bookkeeping"),
        (trainer_module, "maybe_admit", "managed ids"),
        (TrainTimer, "stepped", "clocks"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    # what the training thread waits for the next batch (reading, or a reader thread's queue)
    waiting = batches_module.TrainBatches._batches
    try:
        for owner, name, part in patches:
            setattr(owner, name, times.wrap(part, getattr(owner, name)))
        batches_module.TrainBatches._batches = times.generator(READING, waiting)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        batches_module.TrainBatches._batches = waiting


def parts_round(model, optimizer, schedule, job: TrainJob, device: torch.device) -> tuple[dict[str, float], float]:
    """One instrumented trainer round: each part's ms per step, and the round's ms per step."""
    times = PartTimes()
    with instrumented(times):
        started = time.perf_counter()
        schedule.applied = None
        stats = trainer_module.train(model, optimizer, job, device, schedule)
        sync(device)
        total = time.perf_counter() - started
    seconds = dict(times.seconds)
    if not batches_module.reader_prefetch(job.training):  # read in the training thread: the hashing is in the wait
        seconds[READING] = seconds.get(READING, 0.0) - seconds.get(HASHES, 0.0)
    else:  # in the reader thread: not on the step's path
        seconds[HASHES_AHEAD] = seconds.pop(HASHES, 0.0)
    return {part: round(1000 * s / stats.steps, 4) for part, s in sorted(seconds.items())}, 1000 * total / stats.steps


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decay", default=TrainingConfig().lr_decay, choices=["none", "linear", "cosine"],
                        help="the trainer's rate schedule (default: the project's; cosine: a new rate every step)")
    args = parser.parse_args()
    device = runtime_device("auto", 0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29519"), RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="step-overhead-") as scratch:
            files = prepare(Path(scratch), args.batch * (args.steps + 10))
            job = TrainJob(
                model=MODEL, sharding=ShardingConfig(),
                training=TrainingConfig(nproc=1, batch_size=args.batch, min_steps=0, log_every=LOG_EVERY, lr_decay=args.decay,
                                        device=device.type),
                evaluation=EvaluationConfig(heldout_every_steps=0), table_sizes={f"C{i}": TABLE_ROWS for i in range(1, 27)},
                train_files=tuple(files), eval_files={}, out_dir=str(Path(scratch) / "job"), max_steps=args.steps,
            )  # fmt: skip
            job.folder.root.mkdir(parents=True)
            model, optimizer, schedule = build(job, device)
            stock_round(model, optimizer, job, device, 2 * LOG_EVERY)  # warm both up
            trainer_round(model, optimizer, schedule, dataclasses.replace(job, max_steps=2 * LOG_EVERY), device)
            trainer, stock = [], []
            for _ in range(args.rounds):
                stock.append(stock_round(model, optimizer, job, device, args.steps))
                trainer.append(trainer_round(model, optimizer, schedule, job, device))
            parts, instrumented_ms = parts_round(model, optimizer, schedule, job, device)
    finally:
        dist.destroy_process_group()
    trainer_ms, stock_ms = statistics.median(trainer), statistics.median(stock)
    # each round's pair side by side in time: the median of their ratios is what drift moves least
    ratio = statistics.median(t / s for t, s in zip(trainer, stock, strict=True))
    host = sum(ms for part, ms in parts.items() if part != HASHES_AHEAD)
    figures = {
        "trainer_ms_per_step": round(trainer_ms, 4), "stock_ms_per_step": round(stock_ms, 4),
        "ratio": round(ratio, 4), "parts_ms_per_step": parts,
        "model_ms_per_step": round(instrumented_ms - host, 4), "trainer_rounds_ms": [round(t, 4) for t in trainer],
        "stock_rounds_ms": [round(s, 4) for s in stock], "device": device.type, "batch": args.batch,
        "steps": args.steps, "decay": args.decay,
    }  # fmt: skip
    print(f"this trainer {trainer_ms:.3f} ms a step, TorchRec's stock loop {stock_ms:.3f} ms (medians of "
          f"{args.rounds} rounds): ratio {ratio:.3f} (the median of the rounds' ratios)")  # fmt: skip
    for part, ms in parts.items():
        print(f"  {part:<32} {ms:.4f} ms a step")
    return figures


if __name__ == "__main__":
    print(json.dumps(main()))
    exit_skipping_teardown()  # as the trainer's workers leave: gloo's threads outlive the destroy
