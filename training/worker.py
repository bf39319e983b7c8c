"""The torchrun entry point: one process of a sharded training job.

    python -m torch.distributed.run --nproc-per-node=N -m training.worker JOB.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from training.checkpoint import save_checkpoint
from training.device import backend_for, runtime_device
from training.job import TrainJob
from training.model import build_train_model, table_name
from training.sharding import describe_plan, format_plan, plan_as_json, shard_model
from training.trainer import attach_embedding_optimizer, build_optimizer, predict, train


def run(job: TrainJob, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = job.training
    torch.set_num_threads(config.threads_per_proc)
    torch.manual_seed(config.seed)
    model = build_train_model(job.model, job.table_sizes, torch.device("meta"))
    attach_embedding_optimizer(model, config)
    sharded, plan = shard_model(model, job.sharding, device, config.batch_size_per_rank)
    if rank == 0:
        shapes = {table_name(f): (n, job.model.embedding_dim) for f, n in job.table_sizes.items()}
        rows = describe_plan(plan, shapes, world)
        (job.out / "plan.txt").write_text(format_plan(rows) + "\n")
        (job.out / "plan.json").write_text(json.dumps(plan_as_json(rows), indent=2))
        print(f"[train] {world} processes on {device.type} ({backend_for(device)}); sharding plan:", flush=True)
        for line in format_plan(rows).splitlines():
            print(f"[train]   {line}", flush=True)
    optimizer = build_optimizer(sharded, config)
    stats = train(sharded, optimizer, job, device)
    checkpoint = save_checkpoint(sharded, job.out / "checkpoints", stats.steps)
    rows = predict(sharded, job, device, job.out / "predictions")
    if rank == 0:
        summary = {
            "steps": stats.steps,
            "samples": stats.samples,
            "seconds": stats.seconds,
            "samples_per_s": stats.samples_per_s,
            "world_size": world,
            "device": device.type,
            "backend": backend_for(device),
            "checkpoint": str(checkpoint),
            "eval_rows_rank0": rows,
        }
        (job.out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"[train] done: {stats.steps} steps, {stats.samples:,} samples, "
              f"{stats.samples_per_s:,.0f} samples/s", flush=True)


@record
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m training.worker JOB.json")
    job = TrainJob.load(Path(args[0]))
    device = runtime_device(job.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_for(device))
    try:
        run(job, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
