"""In each of N forked ranks (tests/forked_ranks.py): load a managed-ids run's checkpoint into
this world size as a run does (sharded model, optimizer, remapper), write each rank's
remapper state, and optionally save the loaded state as a new checkpoint (the next run's
warm start).

    start_ranks(reshard_rank, (N, free_port(), JOB, CHECKPOINT, OUT, SAVE_TO or ""), N)
"""

from pathlib import Path

import torch
import torch.distributed as dist
from forked_ranks import as_one_host_rank

from training.job import TrainJob
from training.loop.checkpoint import RowLedger, TrainPosition, load_checkpoint, save_checkpoint
from training.loop.optimizers import attach_embedding_optimizer, build_optimizer
from training.model.build import build_train_model
from training.model.managed_ids import ManagedIds
from training.model.objective import attach_managed_ids
from training.sharding.plan import shard_model


def reshard_rank(rank: int, world: int, port: int, job_file: str, checkpoint: str, out: str, save_to: str) -> None:
    as_one_host_rank(rank, world, port)
    dist.init_process_group("gloo")
    job = TrainJob.load(Path(job_file))
    assert job.managed_ids is not None
    model = build_train_model(job.model, job.table_sizes, torch.device("meta"), job.dense_features)
    attach_embedding_optimizer(model, job.training)
    managed = ManagedIds(job.table_sizes, job.managed_ids.policy, job.managed_ids.admit_min_count)
    per_rank = job.training.batch_size // dist.get_world_size()
    sharded, _ = shard_model(model, job.sharding, torch.device("cpu"), per_rank, 1.0, managed.state_bytes())
    attach_managed_ids(sharded, managed)
    optimizer = build_optimizer(sharded, job.training)
    load_checkpoint(sharded, optimizer, Path(checkpoint), same_run=False)
    torch.save(managed.state_dict(), Path(out) / f"rank-{dist.get_rank()}.pt")
    if save_to:
        save_checkpoint(sharded, optimizer, Path(save_to), TrainPosition(0, 0, 0), RowLedger(), keep=1)
    dist.destroy_process_group()

