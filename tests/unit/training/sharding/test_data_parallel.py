"""Dense modules are wrapped in DDP only when there are gradients to all-reduce."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from forked_ranks import start_ranks
from ports import free_port
from torch.nn.parallel import DistributedDataParallel

from ingestion.schema import SPARSE_COLUMNS
from training.config import ModelConfig, ShardingConfig
from training.model.build import build_train_model
from training.sharding.plan import shard_model


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        config = ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1))
        model = build_train_model(config, {name: 10 for name in SPARSE_COLUMNS}, torch.device("meta"))
        sharded, _ = shard_model(model, ShardingConfig(), torch.device("cpu"), 16)
        results[(world, rank)] = (
            isinstance(sharded._dmp_wrapped_module, DistributedDataParallel),
            sorted(name for name, _ in sharded.named_parameters() if "embedding_bags" not in name),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_one_process_trains_without_ddp_and_two_with_it_under_the_same_names() -> None:
    results = mp.Manager().dict()
    for world in (1, 2):
        start_ranks(_worker, (world, free_port(), results), world)
    assert results[(1, 0)][0] is False
    assert results[(2, 0)][0] is True and results[(2, 1)][0] is True
    assert results[(1, 0)][1] == results[(2, 0)][1] != []  # checkpoints name parameters alike


def test_one_process_moves_its_dense_buffers_to_the_device_mocked_device() -> None:
    """The interaction's index buffers are built on the CPU; alone, as under DDP, they must
    follow the model to its device. 'meta' stands in for a GPU here."""
    from types import SimpleNamespace

    from training.cpu.interaction import DotInteraction
    from training.sharding.plan import AloneDataParallelWrapper

    dmp = SimpleNamespace(_dmp_wrapped_module=torch.nn.Sequential(DotInteraction(3)))
    AloneDataParallelWrapper().wrap(dmp, env=None, device=torch.device("meta"))
    assert {buffer.device.type for buffer in dmp._dmp_wrapped_module.buffers()} == {"meta"}
