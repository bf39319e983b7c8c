"""In each of N forked ranks (tests/forked_ranks.py): load a checkpoint (through its delta
chain) into this world size as a run does (the job's sharded model and optimizer), and write
the state as one full checkpoint.

    start_ranks(reload_rank, (N, free_port(), JOB, CHECKPOINT, OUT), N)
"""

from pathlib import Path

import torch
import torch.distributed as dist
from forked_ranks import as_one_host_rank

from training.job import TrainJob
from training.loop.checkpoint import RowLedger, TrainPosition, load_checkpoint, save_checkpoint
from training.worker import build


def reload_rank(rank: int, world: int, port: int, job_file: str, checkpoint: str, out: str) -> None:
    as_one_host_rank(rank, world, port)
    dist.init_process_group("gloo")
    job = TrainJob.load(Path(job_file))
    built = build(job, torch.device("cpu"), write_plan=False)
    load_checkpoint(built.model, built.optimizer, Path(checkpoint), same_run=False)
    save_checkpoint(built.model, built.optimizer, Path(out), TrainPosition(0, 0, 0), RowLedger(), keep=1)
    dist.destroy_process_group()

