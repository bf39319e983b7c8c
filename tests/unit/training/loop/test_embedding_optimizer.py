"""The embeddings' fused optimizer reaches fbgemm's sharded tables with its settings."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)
from forked_ranks import start_ranks
from ports import free_port
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

from ingestion.schema import SPARSE_COLUMNS
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.loop.optimizers import attach_embedding_optimizer
from training.model.build import build_train_model
from training.sharding.plan import shard_model


def _worker(rank: int, port: int, decay: float, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        config = ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1))
        model = build_train_model(config, {name: 10 for name in SPARSE_COLUMNS}, torch.device("meta"))
        attach_embedding_optimizer(model, TrainingConfig(embedding_lr=0.2, embedding_eps=1e-6,
                                                         embedding_weight_decay=decay))  # fmt: skip
        sharded, _ = shard_model(model, ShardingConfig(), torch.device("cpu"), 16)
        # the sharded collection keeps its lookups in a plain list, outside `modules()`
        lookups = [lookup for ebc in sharded.modules() if isinstance(ebc, ShardedEmbeddingBagCollection)
                   for lookup in ebc._lookups]  # fmt: skip
        tables = [m for lookup in lookups for m in lookup.modules()
                  if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]  # fmt: skip
        results[decay] = [(t.optimizer, t.weight_decay_mode, t.optimizer_args.weight_decay, t.get_learning_rate(),
                           t.optimizer_args.eps) for t in tables]  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_embedding_weight_decay_reaches_the_sharded_tables_as_l2() -> None:
    results = mp.Manager().dict()
    for decay in (0.0, 0.01):
        start_ranks(_worker, (free_port(), decay, results), 1)
    assert results[0.0] and results[0.01]
    for optimizer, mode, decay, lr, eps in results[0.01]:
        assert (optimizer, mode) == (EmbOptimType.EXACT_ROWWISE_ADAGRAD, WeightDecayMode.L2)
        assert decay == 0.01 and abs(lr - 0.2) < 1e-7 and eps == 1e-6  # the rate is held in float32
    assert {(o, m) for o, m, *_ in results[0.0]} == {(EmbOptimType.EXACT_ROWWISE_ADAGRAD, WeightDecayMode.NONE)}


def _schedule_worker(rank: int, port: int, results) -> None:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from training.cpu import accelerate
    from training.loop.optimizers import build_optimizer
    from training.loop.schedule import build_schedule, lr_multiplier
    from training.loop.steps import PlainSteps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        training = TrainingConfig(embedding_lr=0.2, dense_lr=0.01, lr_decay="cosine", warmup_steps=2)
        model = build_train_model(ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1)),
                                  {name: 10 for name in SPARSE_COLUMNS}, torch.device("meta"))  # fmt: skip
        accelerate(model, training.cpu, "fp32")  # the CPU update kernel reads the same rate
        attach_embedding_optimizer(model, training)
        sharded, _ = shard_model(model, ShardingConfig(), torch.device("cpu"), 16)
        optimizer = build_optimizer(sharded, training)
        schedule, steps = build_schedule(sharded, optimizer, training), PlainSteps(sharded, optimizer, training,
                                                                                   torch.device("cpu"))  # fmt: skip
        lookups = [lookup for ebc in sharded.modules() if isinstance(ebc, ShardedEmbeddingBagCollection)
                   for lookup in ebc._lookups]  # fmt: skip
        tables = [m for lookup in lookups for m in lookup.modules() if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]
        generator = torch.Generator().manual_seed(0)
        seen = []
        for step in range(6):
            schedule.apply(step, 6)
            kjt = KeyedJaggedTensor(keys=list(SPARSE_COLUMNS), values=torch.randint(0, 10, (26 * 16,), generator=generator),
                                    lengths=torch.ones(26 * 16, dtype=torch.int32), stride=16)  # fmt: skip
            batch = Batch(torch.rand(16, 13, generator=generator), kjt, torch.randint(0, 2, (16,), generator=generator).float())
            steps.step(iter([batch]))
            expected = 0.2 * lr_multiplier(step, 6, 2, "cosine", 0.0)
            seen.append((expected, [t.get_learning_rate() for t in tables],
                         [group["lr"] for _, part in optimizer.optimizers for group in part.param_groups]))  # fmt: skip
        results["seen"] = seen
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_every_step_trains_the_tables_at_the_scheduled_rate() -> None:
    """Plain steps step only the dense optimizer: the schedule alone puts each step's rate
    into the fused kernels, before the backward that applies it."""
    results = mp.Manager().dict()
    start_ranks(_schedule_worker, (free_port(), results), 1)
    rates = [expected for expected, _, _ in results["seen"]]
    assert rates[0] < rates[1] == rates[2] > rates[3] > rates[4] > rates[5], "warm-up, then decay"
    for expected, kernels, groups in results["seen"]:
        assert kernels and all(abs(rate - expected) < 1e-7 for rate in kernels), (expected, kernels)
        assert abs(groups[0] - expected) < 1e-7
