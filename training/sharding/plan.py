"""Sharding plans: TorchRec's planner over a topology, with constraints from the config.

The model is built on `meta`; `shard_model` asks the planner where each table goes and
hands model and plan to `DistributedModelParallel`, which materialises every shard on its
rank. On CPU with gloo TorchRec supports table-wise, column-wise and data-parallel tables;
row-wise and table-row-wise need CUDA, as do the host-memory (UVM) kernels.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.proposers import (
    GreedyProposer,
    GridSearchProposer,
    UniformProposer,
)
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import KernelConfig, PlannerError, Proposer, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from training.config import ClusterConfig, ShardingConfig
from training.launch.device import device_memory_bytes, host_memory_bytes

CUDA_ONLY_SHARDING = {"row_wise", "table_row_wise"}
CUDA_ONLY_KERNELS = {"fused_uvm", "fused_uvm_caching"}
SUPPORTED = {
    "cpu": (("table_wise", "column_wise", "data_parallel"), ("fused", "dense")),
    "cuda": (("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"),
             ("fused", "fused_uvm", "fused_uvm_caching", "dense")),
}  # fmt: skip


class ShardingError(RuntimeError):
    """No valid plan: a constraint this hardware cannot meet, or tables that do not fit."""


@dataclass(frozen=True)
class RankEstimate:
    """The planner's estimate for one rank: bytes in device (HBM) and host (DDR) memory, cost."""

    rank: int
    hbm_bytes: int
    ddr_bytes: int
    perf_ms: float


def check_supported(config: ShardingConfig, device_type: str, tables: list[str] | None = None) -> None:
    """Refuse, in one line, a choice that needs CUDA on a CPU topology."""
    if device_type == "cuda":
        return
    if quantized_comms(config):
        # measured: on CPU with gloo TorchRec runs the sharded modules without the codecs
        # (outputs bit-identical to fp32), so the setting would silently do nothing
        raise ShardingError(
            f"sharding.comm_forward_precision = '{config.comm_forward_precision}', comm_backward_precision = "
            f"'{config.comm_backward_precision}': quantized communication needs CUDA devices; set both to 'fp32' here"
        )
    for table in [None, *(tables or [])]:
        rule = config.for_table(table) if table else config
        where = f"sharding.tables.{table}." if table and table in config.tables else "sharding."
        if rule.sharding_type in CUDA_ONLY_SHARDING:
            raise ShardingError(
                f"{where}sharding_type = '{rule.sharding_type}' needs CUDA devices; on CPU use "
                "table_wise, column_wise or data_parallel"
            )
        if rule.compute_kernel in CUDA_ONLY_KERNELS:
            raise ShardingError(
                f"{where}compute_kernel = '{rule.compute_kernel}' places tables in host memory "
                "for a GPU and needs CUDA; on CPU use 'fused'"
            )


def table_names(model: nn.Module) -> list[str]:
    return [name.split(".")[-2] for name, _ in model.named_parameters() if "embedding_bags" in name]


PoolingFactors = float | Mapping[str, float]


def constraints_for(
    model: nn.Module, config: ShardingConfig, device_type: str, pooling_factor: PoolingFactors = 1.0
) -> dict[str, ParameterConstraints]:
    """Per table: the configured sharding type and kernel, or every one the device supports.

    `pooling_factor`: ids per example, for every table or per table name (others: 1), which
    the planner's cost model uses for lookup and communication costs.
    """
    sharding_types, kernels = SUPPORTED["cuda" if device_type == "cuda" else "cpu"]
    constraints = {}
    for name in table_names(model):
        factor = pooling_factor if isinstance(pooling_factor, float | int) else pooling_factor.get(name, 1.0)
        rule = config.for_table(name)
        constraints[name] = ParameterConstraints(
            sharding_types=list(sharding_types) if rule.sharding_type == "auto" else [rule.sharding_type],
            compute_kernels=list(kernels) if rule.compute_kernel == "auto" else [rule.compute_kernel],
            pooling_factors=[float(factor)],
        )
    return constraints


def this_job_cluster(device: torch.device, world_size: int, local_world_size: int) -> ClusterConfig:
    """The job's own hosts as a declared cluster, with the memory this host has: the GPU's
    HBM, and the host's memory shared by its processes. TorchRec's `Topology` would
    otherwise assume 32 GiB a GPU and 128 GiB of host memory a rank, whatever the hardware."""
    gib = 2**30
    return ClusterConfig(name="this job", hosts=max(1, world_size // local_world_size),
                         devices_per_host=local_world_size, compute_device="cuda" if device.type == "cuda" else "cpu",
                         device_memory_gb=device_memory_bytes(device) / gib,
                         host_memory_gb=host_memory_bytes() / gib)  # fmt: skip


def cluster_topology(cluster: ClusterConfig, reserved_bytes: int = 0) -> Topology:
    """A topology for a declared cluster (or this job's, `this_job_cluster`); host memory is
    shared by the devices of a host. `reserved_bytes`: each process's memory the tables may
    not use (managed ids' remapper, on the device the process computes on)."""
    cuda = cluster.compute_device == "cuda"
    # TorchRec's factory (its direct constructor warns, on every plan, that it is not the factory)
    trainer = TrainerConfig(
        world_size=cluster.workers.world_size,
        local_world_size=cluster.devices_per_host,
        hbm_cap_bytes=int(cluster.device_memory_gb * 2**30) - reserved_bytes if cuda else None,
        ddr_cap_bytes=int(cluster.host_memory_gb * 2**30 / cluster.devices_per_host) - (0 if cuda else reserved_bytes),
    )
    return TopologyFactory.create_topology(trainer, kernel_config=KernelConfig(compute_device=cluster.compute_device))


def plan_sharding(
    model: nn.Module,
    config: ShardingConfig,
    topology: Topology,
    batch_size_per_rank: int,
    group: dist.ProcessGroup | None = None,
    pooling_factor: PoolingFactors = 1.0,
) -> tuple[ShardingPlan, list[RankEstimate]]:
    """Plan with the planner (collectively when `group` is given); also its per-rank estimates."""
    check_supported(config, topology.compute_device, table_names(model))
    chosen: list = []

    def keep_best(options: list) -> list:
        chosen[:] = options
        return options

    sharders = sharders_for(config)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size_per_rank,
        constraints=constraints_for(model, config, topology.compute_device, pooling_factor),
        proposer=proposers(config.search_patience),
        storage_reservation=dense_reservation(model, sharders),
        debug=False,
        callbacks=[keep_best],
    )
    try:
        if group is not None:
            plan = planner.collective_plan(model, sharders, group)
        else:
            plan = planner.plan(model, sharders)
    except PlannerError:
        raise ShardingError(_no_fit_message(model, topology)) from None
    return plan, _rank_estimates(chosen, topology.world_size)


# TorchRec's heuristic: the dense parameters take 6 times their size (the weights, the
# optimizer's state, DDP's buckets), its buffers once; and 15 % of each device is kept free.
DENSE_PARAMETER_MULTIPLIER = 6.0
RESERVED_FRACTION = 0.15


def dense_bytes_estimate(model: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> int:
    """What TorchRec's heuristic reserves on each rank for the model's dense part (every
    parameter and buffer outside the modules the sharders shard), computed from the shapes,
    which a model on the meta device has too."""
    sharded_types = {sharder.module_type for sharder in sharders}
    sharded = {id(t) for m in model.modules() if type(m) in sharded_types for t in [*m.parameters(), *m.buffers()]}
    parameters = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in sharded)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers() if id(b) not in sharded)
    return round(DENSE_PARAMETER_MULTIPLIER * parameters + buffers)


def dense_reservation(model: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> HeuristicalStorageReservation:
    """TorchRec's default reservation, given the dense part's size. Without it the planner
    measures the dense part itself and warns, on every plan (in `dlrm plan`'s output and in
    every rank's log), that the measure may be wrong where tensors are not materialised, and
    asks for this estimate; the estimate is the same measure, so the plan is the same. The
    reservation's own notice (it may be retired) is TorchRec's to its developers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="HeuristicalStorageReservation is known", category=FutureWarning)
        return HeuristicalStorageReservation(percentage=RESERVED_FRACTION, parameter_multiplier=DENSE_PARAMETER_MULTIPLIER,
                                             dense_tensor_estimate=dense_bytes_estimate(model, sharders))  # fmt: skip


def quantized_comms(config: ShardingConfig) -> bool:
    return (config.comm_forward_precision, config.comm_backward_precision) != ("fp32", "fp32")


def sharders_for(config: ShardingConfig) -> list[ModuleSharder[nn.Module]]:
    """TorchRec's default sharders; the embedding-bag one with the configured communication
    codecs (fp16/bf16 all-to-alls) when any is set."""
    sharders = get_default_sharders()
    if not quantized_comms(config):
        return sharders
    forward, backward = CommType[config.comm_forward_precision.upper()], CommType[config.comm_backward_precision.upper()]
    registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=forward, backward_precision=backward))
    return [EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry) if type(s) is EmbeddingBagCollectionSharder
            else s for s in sharders]  # fmt: skip


def proposers(patience: int) -> list[Proposer]:
    """TorchRec's default proposers, its two greedy searches stopping after `patience` plans
    in a row that do not beat their best (0: never)."""
    threshold = patience or None
    return [GridSearchProposer(), GreedyProposer(threshold=threshold), GreedyProposer(use_depth=False, threshold=threshold),
            UniformProposer()]  # fmt: skip


def _rank_estimates(options: list, world_size: int) -> list[RankEstimate]:
    totals = {rank: [0, 0, 0.0] for rank in range(world_size)}
    for option in options:
        for shard in option.shards:
            if shard.rank is None or shard.storage is None:
                continue
            totals[shard.rank][0] += shard.storage.hbm
            totals[shard.rank][1] += shard.storage.ddr
            totals[shard.rank][2] += shard.perf.total if shard.perf is not None else 0.0
    return [RankEstimate(rank, int(h), int(d), float(p)) for rank, (h, d, p) in sorted(totals.items())]


def _no_fit_message(model: nn.Module, topology: Topology) -> str:
    """Name the table and the memory that is missing (weights plus row-wise optimizer state)."""
    need = {
        name.split(".")[-2]: param.numel() * 4 + param.shape[0] * 4
        for name, param in model.named_parameters() if "embedding_bags" in name
    }  # fmt: skip
    device = topology.devices[0].storage
    per_device = device.hbm if topology.compute_device == "cuda" else device.ddr
    total_capacity = sum(
        (d.storage.hbm + d.storage.ddr) if topology.compute_device == "cuda" else d.storage.ddr for d in topology.devices
    )
    largest = max(need, key=need.get)
    gib = 2**30
    if sum(need.values()) > total_capacity:
        return (
            f"no sharding plan fits: the tables need {sum(need.values()) / gib:.1f} GiB and the "
            f"{topology.world_size} devices hold {total_capacity / gib:.1f} GiB "
            f"({(sum(need.values()) - total_capacity) / gib:.1f} GiB missing; largest table {largest}, "
            f"{need[largest] / gib:.1f} GiB); add devices or lower preprocess.hash_size"
        )
    return (
        f"no sharding plan fits: table {largest} needs {need[largest] / gib:.2f} GiB and one device holds "
        f"{per_device / gib:.2f} GiB ({max(0, need[largest] - per_device) / gib:.2f} GiB missing); allow row_wise or "
        "column_wise sharding, or a host-memory kernel (fused_uvm_caching) for it"
    )


def shard_model(
    model: nn.Module,
    config: ShardingConfig,
    device: torch.device,
    batch_size_per_rank: int,
    pooling_factor: PoolingFactors = 1.0,
    reserved_bytes: int = 0,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Plan over the live process group and apply the plan with DistributedModelParallel;
    `reserved_bytes` of each process's memory are kept from the tables (`cluster_topology`)."""
    world_size = dist.get_world_size()
    topology = cluster_topology(this_job_cluster(device, world_size, _local_world_size(world_size)), reserved_bytes)
    plan, _ = plan_sharding(model, config, topology, batch_size_per_rank, dist.GroupMember.WORLD, pooling_factor)
    wrapper = DefaultDataParallelWrapper() if world_size > 1 else AloneDataParallelWrapper()
    return DistributedModelParallel(model, device=device, plan=plan, sharders=sharders_for(config),
                                    data_parallel_wrapper=wrapper), plan  # fmt: skip


class AloneDataParallelWrapper(DataParallelWrapper):
    """Leaves the dense modules unwrapped: a single process has no gradients to all-reduce,
    and DDP's per-step bookkeeping (bucket views, reducer hooks) costs it about 2.5 % of a
    bf16 step at batch 2048 on 2 cores. Parameter names are the same either way, so
    checkpoints move between world sizes."""

    def wrap(self, dmp: DistributedModelParallel, env: Any, device: torch.device) -> None:
        # What TorchRec's DDP wrapper does first: buffers built off the meta device (the
        # interaction's pair indices) move to the device, a GPU included.
        dmp._dmp_wrapped_module.to(device)


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
