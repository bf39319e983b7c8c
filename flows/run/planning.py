"""`dlrm plan`: where each table of a model would go on a cluster, and what it would cost."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict

import torch

from flows.run.config import ClusterConfig, ConfigError, PipelineConfig
from flows.run.feature_files import TablesToPlan
from flows.run.reports import PlanReport
from training.loop.optimizers import attach_embedding_optimizer
from training.model.build import build_train_model, row_width, table_name
from training.model.managed_ids import state_bytes
from training.sharding.plan import (
    cluster_topology,
    describe_plan,
    format_plan,
    plan_as_json,
    plan_sharding,
)

HOST_MEMORY_KERNELS = {"fused_uvm", "fused_uvm_caching"}


def plan_report(config: PipelineConfig, cluster: ClusterConfig, tables: TablesToPlan) -> PlanReport:
    """Plan the config's model, over `tables` (`tables_to_plan`), for `cluster` on the meta
    device (nothing is allocated)."""
    started, sizes = time.perf_counter(), tables.sizes
    model = build_train_model(config.model, sizes, torch.device("meta"))
    attach_embedding_optimizer(model, config.training)  # as training does: its state takes memory
    try:
        per_rank_batch = cluster.workers.per_rank_batch(config.training.batch_size)
    except ValueError as error:
        raise ConfigError(f"{error} on {cluster.name}") from None
    managed = config.preprocess.managed if tables.categorical_mode == "managed" else None
    reserved = state_bytes(sizes, managed.policy) if managed else 0  # the remapper, on every process
    plan, estimates = plan_sharding(
        model, config.sharding, cluster_topology(cluster, reserved), per_rank_batch,
        pooling_factor=config.model.declared_tables.pooling_factor,
    )  # fmt: skip
    shapes = {table_name(f): (rows, row_width(config.model)) for f, rows in sizes.items()}
    rows = describe_plan(plan, shapes, cluster.workers.world_size)
    by_type = Counter(r.sharding_type for r in rows)
    by_kernel = Counter(r.compute_kernel for r in rows)
    in_host_memory = [r.table for r in rows if r.compute_kernel in HOST_MEMORY_KERNELS]
    row_wise = [r.table for r in rows if r.sharding_type in ("row_wise", "table_row_wise")]
    gib = 2**30
    total = sum(rows_ * row_width(config.model) * 4 for rows_, _ in shapes.values())
    lines = [
        (
            f"Sharding plan of '{config.name}' ({len(rows)} tables, {total / gib:,.1f} GiB of embeddings) "
            f"for {cluster.name}: {cluster.hosts} host(s) × {cluster.devices_per_host} {cluster.compute_device} devices"
        ),
        "",
        format_plan(rows),
        "",
        "sharding types: " + ", ".join(f"{k} {v}" for k, v in by_type.most_common()),
        "kernels:        " + ", ".join(f"{k} {v}" for k, v in by_kernel.most_common()),
        f"row-wise split ({len(row_wise)}): " + (", ".join(row_wise) or "none"),
        f"in host memory ({len(in_host_memory)}): " + (", ".join(in_host_memory) or "none"),
        "",
        "planner's estimate per rank:  device memory GiB | host memory GiB | cost (ms per step)",
    ]
    lines += [f"  rank {e.rank:>3}: {e.hbm_bytes / gib:>10.1f} | {e.ddr_bytes / gib:>10.1f} | {e.perf_ms:>8.2f}"
              for e in estimates]
    return PlanReport(
        tables=len(rows), embedding_gib=total / gib, sharding_types=dict(by_type), compute_kernels=dict(by_kernel),
        row_wise_tables=row_wise, host_memory_tables=in_host_memory, per_rank=[asdict(e) for e in estimates],
        plan=plan_as_json(rows), planner_seconds=round(time.perf_counter() - started, 2), text="\n".join(lines),
    )  # fmt: skip
