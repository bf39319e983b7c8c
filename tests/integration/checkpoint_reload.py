"""Under torchrun: load a checkpoint (through its delta chain) into this world size as a run
does (the job's sharded model and optimizer), and write the state as one full checkpoint.

    torchrun --nproc-per-node N checkpoint_reload.py JOB CHECKPOINT OUT
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from training.job import TrainJob
from training.loop.checkpoint import RowLedger, TrainPosition, load_checkpoint, save_checkpoint
from training.worker import build, exit_skipping_teardown


def main(job_file: str, checkpoint: str, out: str) -> None:
    dist.init_process_group("gloo")
    job = TrainJob.load(Path(job_file))
    built = build(job, torch.device("cpu"), write_plan=False)
    load_checkpoint(built.model, built.optimizer, Path(checkpoint), same_run=False)
    save_checkpoint(built.model, built.optimizer, Path(out), TrainPosition(0, 0, 0), RowLedger(), keep=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_skipping_teardown()  # as the trainer's workers leave: gloo's threads outlive the destroy
