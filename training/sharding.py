"""Sharding plans: TorchRec's planner over a topology, with constraints from the config.

The model is built on `meta`; `shard_model` asks the planner where each table goes and
hands model and plan to `DistributedModelParallel`, which materialises every shard on its
rank. On CPU with gloo TorchRec supports table-wise, column-wise and data-parallel tables;
row-wise and table-row-wise need CUDA, as do the host-memory (UVM) kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ShardingPlan

from training.config import ShardingConfig

CUDA_ONLY_SHARDING = {"row_wise", "table_row_wise"}
CUDA_ONLY_KERNELS = {"fused_uvm", "fused_uvm_caching"}


class ShardingError(RuntimeError):
    """No valid plan: a constraint this hardware cannot meet, or tables that do not fit."""


def check_supported(config: ShardingConfig, device_type: str) -> None:
    if device_type != "cuda" and config.sharding_type in CUDA_ONLY_SHARDING:
        raise ShardingError(
            f"sharding.sharding_type = '{config.sharding_type}' needs CUDA devices; on CPU use "
            "table_wise, column_wise or data_parallel"
        )
    if device_type != "cuda" and config.compute_kernel in CUDA_ONLY_KERNELS:
        raise ShardingError(
            f"sharding.compute_kernel = '{config.compute_kernel}' places tables in host memory "
            "for a GPU and needs CUDA; on CPU use 'fused'"
        )


def constraints_for(model: nn.Module, config: ShardingConfig) -> dict[str, ParameterConstraints]:
    """The same sharding type and kernel for every embedding table of `model`."""
    names = [name.split(".")[-2] for name, _ in model.named_parameters() if "embedding_bags" in name]
    return {
        name: ParameterConstraints(
            sharding_types=[config.sharding_type], compute_kernels=[config.compute_kernel]
        )
        for name in names
    }


def plan_sharding(
    model: nn.Module,
    config: ShardingConfig,
    topology: Topology,
    batch_size_per_rank: int,
    group: dist.ProcessGroup | None = None,
) -> ShardingPlan:
    """Plan with the planner; collectively (same plan on every rank) when `group` is given."""
    check_supported(config, topology.compute_device)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size_per_rank,
        constraints=constraints_for(model, config),
        debug=False,
    )
    try:
        if group is not None:
            return planner.collective_plan(model, get_default_sharders(), group)
        return planner.plan(model, get_default_sharders())
    except PlannerError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ShardingError(f"no sharding plan fits: {first_line}") from None


def shard_model(
    model: nn.Module, config: ShardingConfig, device: torch.device, batch_size_per_rank: int
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Plan over the live process group and apply the plan with DistributedModelParallel."""
    world_size = dist.get_world_size()
    topology = Topology(
        world_size=world_size,
        compute_device=device.type,
        local_world_size=_local_world_size(world_size),
    )
    plan = plan_sharding(model, config, topology, batch_size_per_rank, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=device, plan=plan), plan


def _local_world_size(world_size: int) -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


@dataclass(frozen=True)
class ShardRow:
    table: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]
    shard_shapes: list[list[int]]
    bytes_per_rank: dict[int, int]


def describe_plan(
    plan: ShardingPlan, table_shapes: dict[str, tuple[int, int]], world_size: int, bytes_per_element: int = 4
) -> list[ShardRow]:
    """Each table's placement: sharding type, kernel, ranks and parameter bytes per rank.

    Data-parallel tables have no shards in the plan: every rank holds the whole table.
    """
    rows = []
    for module_plan in plan.plan.values():
        for table, option in module_plan.items():  # type: ignore[union-attr]
            shards = option.sharding_spec.shards if option.sharding_spec is not None else []
            per_rank: dict[int, int] = {}
            shapes = []
            for shard in shards:
                rank = shard.placement.rank()
                size = 1
                for dim in shard.shard_sizes:
                    size *= dim
                per_rank[rank] = per_rank.get(rank, 0) + size * bytes_per_element
                shapes.append(list(shard.shard_sizes))
            if not shards and table in table_shapes:
                rows_, dim = table_shapes[table]
                per_rank = {rank: rows_ * dim * bytes_per_element for rank in range(world_size)}
                shapes = [[rows_, dim]] * world_size
            rows.append(
                ShardRow(
                    table=table,
                    sharding_type=option.sharding_type,
                    compute_kernel=option.compute_kernel,
                    ranks=sorted(per_rank) if per_rank else list(option.ranks or []),
                    shard_shapes=shapes,
                    bytes_per_rank=per_rank,
                )
            )
    return rows


def format_plan(rows: list[ShardRow]) -> str:
    """A plain-text table of the plan, and the total parameter bytes on each rank."""
    header = f"{'table':<10} {'sharding':<14} {'kernel':<18} {'ranks':<10} {'MiB per rank'}"
    lines = [header, "-" * len(header)]
    totals: dict[int, int] = {}
    for row in rows:
        per_rank = ", ".join(f"{r}:{b / 2**20:.2f}" for r, b in sorted(row.bytes_per_rank.items()))
        ranks = ",".join(map(str, row.ranks))
        lines.append(f"{row.table:<10} {row.sharding_type:<14} {row.compute_kernel:<18} {ranks:<10} {per_rank}")
        for rank, size in row.bytes_per_rank.items():
            totals[rank] = totals.get(rank, 0) + size
    lines.append("")
    lines += [f"rank {rank}: {size / 2**20:.2f} MiB of embedding parameters" for rank, size in sorted(totals.items())]
    return "\n".join(lines)


def plan_as_json(rows: list[ShardRow]) -> list[dict[str, Any]]:
    return [
        {**row.__dict__, "bytes_per_rank": {str(k): v for k, v in row.bytes_per_rank.items()}}
        for row in rows
    ]
