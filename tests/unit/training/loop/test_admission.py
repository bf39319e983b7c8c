"""Admission rounds in a sharded model (training/loop/admission.py): a row that changes owner
restarts its embedding and its optimizer state on the process that holds it, with fbgemm's
update and with this project's CPU kernel alike, and nothing else moves."""

import math
import os
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from forked_ranks import start_ranks
from ports import free_port

from training.config import CpuConfig, ModelConfig, ShardingConfig, TrainingConfig
from training.loop.admission import restart_rows, restart_targets
from training.loop.optimizers import attach_embedding_optimizer, build_optimizer
from training.model.build import build_train_model
from training.sharding.plan import shard_model

SIZES = {"C1": 12, "C2": 20}


def _tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {f: state[next(k for k in state if k.endswith(f"embedding_bags.t_{f}.weight"))].local_shards()[0].tensor.clone()
            for f in SIZES}  # fmt: skip


def _momenta(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.fused_optimizer.state_dict()["state"]
    return {f: next(iter(state[next(k for k in state if k.endswith(f"t_{f}.weight"))].values())).local_shards()[0]
            .tensor.clone() for f in SIZES}  # fmt: skip


def _worker(rank: int, port: int, update: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        training = TrainingConfig(nproc=1, embedding_lr=0.2, cpu=CpuConfig(embedding_update=update))
        model = build_train_model(ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1)), SIZES,
                                  torch.device("meta"), dense_features=13)  # fmt: skip
        if update != "fbgemm":
            from training.cpu import accelerate

            accelerate(model, training.cpu, "fp32")
        attach_embedding_optimizer(model, training)
        sharded, _ = shard_model(model, ShardingConfig(), torch.device("cpu"), 8)
        build_optimizer(sharded, training)
        with torch.no_grad():  # a state to restart: every row's momentum at 3
            for momentum in (t for state in sharded.fused_optimizer.state_dict()["state"].values() for t in state.values()):
                momentum.local_shards()[0].tensor.fill_(3.0)
        before, momenta_before = _tables(sharded), _momenta(sharded)
        changed = {"C1": torch.tensor([0, 7]), "C2": torch.tensor([19])}
        restart_rows(restart_targets(sharded), changed, seed=5, step=40)
        results[update] = (before, momenta_before, _tables(sharded), _momenta(sharded))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("update", ["fbgemm", "vectorized"])
def test_a_restarted_row_draws_afresh_and_its_momentum_starts_at_zero(update: str) -> None:
    results = mp.Manager().dict()
    start_ranks(_worker, (free_port(), update, results), 1)
    before, momenta_before, after, momenta_after = results[update]
    for feature, rows in {"C1": [0, 7], "C2": [19]}.items():
        generator = torch.Generator().manual_seed(5 * 1_000_003 + 40 * 7_919 + zlib.crc32(feature.encode()))
        bound = 1.0 / math.sqrt(SIZES[feature])
        fresh = torch.empty(len(rows), 4).uniform_(-bound, bound, generator=generator)
        assert torch.equal(after[feature][rows], fresh), feature
        kept = [r for r in range(SIZES[feature]) if r not in rows]
        assert torch.equal(after[feature][kept], before[feature][kept]), "no other row moves"
        assert torch.all(momenta_after[feature][rows] == 0) and torch.all(momenta_before[feature][rows] == 3)
        assert torch.all(momenta_after[feature][kept] == 3)
