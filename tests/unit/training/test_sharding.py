"""Planning needs no processes: the planner plans for a topology this machine need not have."""

import pytest
import torch
from torchrec.distributed.planner import Topology

from training.config import ShardingConfig
from training.model import build_train_model, table_name
from training.sharding import (
    ShardingError,
    check_supported,
    describe_plan,
    format_plan,
    plan_sharding,
)

SIZES = {f"C{i}": 1000 + 100 * i for i in range(1, 27)}


def _model():
    from training.config import ModelConfig

    return build_train_model(ModelConfig(embedding_dim=16, bottom_mlp=(32, 16), top_mlp=(32, 1)), SIZES, torch.device("meta"))


def _shapes():
    return {table_name(f): (rows, 16) for f, rows in SIZES.items()}


def test_table_wise_plan_balances_tables_over_two_ranks() -> None:
    plan = plan_sharding(_model(), ShardingConfig(), Topology(world_size=2, compute_device="cpu"), 1024)
    rows = describe_plan(plan, _shapes(), 2)
    assert len(rows) == 26
    assert {r.sharding_type for r in rows} == {"table_wise"}
    assert all(len(r.ranks) == 1 for r in rows)
    per_rank = [sum(r.bytes_per_rank.get(rank, 0) for r in rows) for rank in (0, 1)]
    assert sum(per_rank) == sum(rows_ * 16 * 4 for rows_ in SIZES.values())
    assert min(per_rank) > 0.3 * sum(per_rank), "both ranks hold a fair share"
    text = format_plan(rows)
    assert "t_C1" in text and "rank 0:" in text and "rank 1:" in text


def test_data_parallel_tables_are_on_every_rank() -> None:
    config = ShardingConfig(sharding_type="data_parallel", compute_kernel="dense")
    plan = plan_sharding(_model(), config, Topology(world_size=2, compute_device="cpu"), 1024)
    rows = describe_plan(plan, _shapes(), 2)
    assert all(r.ranks == [0, 1] for r in rows)
    assert all(r.bytes_per_rank[0] == r.bytes_per_rank[1] > 0 for r in rows)


def test_row_wise_is_planned_for_a_gpu_cluster_that_is_not_here() -> None:
    config = ShardingConfig(sharding_type="row_wise")
    topology = Topology(world_size=8, compute_device="cuda", local_world_size=8, hbm_cap=80 * 2**30)
    rows = describe_plan(plan_sharding(_model(), config, topology, 4096), _shapes(), 8)
    assert {r.sharding_type for r in rows} == {"row_wise"}
    assert all(len(r.ranks) > 1 for r in rows), "row-wise tables are spread over several GPUs"


@pytest.mark.parametrize(
    "config, needle",
    [
        (ShardingConfig(sharding_type="row_wise"), "sharding.sharding_type = 'row_wise' needs CUDA"),
        (ShardingConfig(sharding_type="table_row_wise"), "needs CUDA"),
        (ShardingConfig(compute_kernel="fused_uvm"), "sharding.compute_kernel = 'fused_uvm'"),
        (ShardingConfig(compute_kernel="fused_uvm_caching"), "needs CUDA"),
    ],
)
def test_cuda_only_choices_fail_clearly_on_cpu(config: ShardingConfig, needle: str) -> None:
    with pytest.raises(ShardingError, match=needle.replace("(", r"\(")):
        check_supported(config, "cpu")
    check_supported(config, "cuda")  # accepted where they can run


def test_tables_that_cannot_fit_give_one_clear_error() -> None:
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=1024, hbm_cap=1024)
    with pytest.raises(ShardingError, match="no sharding plan fits"):
        plan_sharding(_model(), ShardingConfig(), topology, 1024)
