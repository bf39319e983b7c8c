"""The torchrun entry point: one process of a sharded training job.

    python -m torch.distributed.run --nproc-per-node=N -m training.worker JOB.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from training import cpu_linear, cpu_memory, embedding_update, native_build, native_interaction
from training.checkpoint import (
    RowLedger,
    TrainPosition,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from training.config import TrainingConfig
from training.device import backend_for, runtime_device
from training.job import TrainJob
from training.model import build_train_model, compile_dense_parts, table_name
from training.precision import resolve_precision
from training.sharding import describe_plan, format_plan, plan_as_json, shard_model
from training.steps import pipeline_kind
from training.trainer import (
    attach_embedding_optimizer,
    build_optimizer,
    build_schedule,
    predict,
    train,
)


def run(job: TrainJob, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    precision, warning = resolve_precision(job.training.precision, device)
    if rank == 0 and warning:
        print(f"[train] warning: {warning}", flush=True)
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, precision=precision))
    config = job.training
    torch.set_num_threads(config.threads_per_proc)
    malloc = "retain" if device.type == "cpu" and config.cpu_malloc == "retain" and cpu_memory.retain() else "system"
    update = _embedding_update(job, device) if device.type == "cpu" else None
    if device.type == "cpu" and config.cpu_matmul == "onednn":
        cpu_linear.enable()
    interaction = _interaction(job, device)
    torch.manual_seed(config.seed)
    model = build_train_model(job.model, job.table_sizes, torch.device("meta"))
    attach_embedding_optimizer(model, config)
    pooling = {table_name(feature): factor for feature, factor in job.pooling_factors.items()}
    sharded, plan = shard_model(model, job.sharding, device, config.batch_size_per_rank, pooling)
    if config.compile:
        compile_dense_parts(sharded, device)
    if rank == 0:
        _write_plan(job, plan, world, device)
    optimizer = build_optimizer(sharded, config)
    schedule = build_schedule(sharded, optimizer, config)
    start, ledger = _restore(sharded, optimizer, job)
    if rank == 0:
        _keep_metrics_up_to(job.out / "metrics.jsonl", start.step if start else 0)
    stats = train(sharded, optimizer, job, device, schedule, start, ledger)
    checkpoint = save_checkpoint(sharded, optimizer, job.checkpoint_root, stats.position, stats.ledger,
                                 config.keep_checkpoints)  # fmt: skip
    rows_trained, fingerprint = _all_reduce_ledger(stats.ledger, device)
    rows = predict(sharded, job, device, job.out / "predictions")
    if rank == 0:
        summary = {
            "steps": stats.steps,
            "samples": stats.samples,
            "seconds": stats.seconds,
            "samples_per_s": stats.samples_per_s,
            "first_step_seconds": stats.first_step_seconds,
            "compiled": config.compile,
            "precision": config.precision,
            "embedding_update": f"cpu-{update.kernel}" if update else "fbgemm",
            "embedding_update_probe_ms": update.probe_ms if update else {},
            "matmul": _matmul(config, device),
            "interaction": interaction,
            "malloc": malloc,
            "rows_trained": rows_trained,
            "rows_fingerprint": fingerprint,
            "resumed_from_step": start.step if start else 0,
            "world_size": world,
            "device": device.type,
            "backend": backend_for(device),
            "pipeline": pipeline_kind(config, device),
            "checkpoint": str(checkpoint),
            "eval_rows_rank0": rows,
        }
        (job.out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"[train] done: {stats.steps} steps, {rows_trained:,} rows trained, "
              f"{stats.samples_per_s:,.0f} samples/s", flush=True)


def _embedding_update(job: TrainJob, device: torch.device) -> embedding_update.UpdateChoice:
    """Install the configured CPU embedding update; for `auto`, the faster on this machine,
    the same on every rank. A resumed run keeps the kernel it started with, so it continues
    exactly as an uninterrupted run would (the two agree only to float rounding)."""
    setting = job.training.cpu_embedding_update
    recorded = job.checkpoint_root / "cpu_embedding_update"
    kept = recorded.read_text().strip() if recorded.is_file() else None
    if setting == "auto" and kept in embedding_update.KERNELS and latest_checkpoint(job.checkpoint_root) is not None:
        choice = embedding_update.UpdateChoice(kept, {})  # type: ignore[arg-type]
    elif setting == "auto":
        times = embedding_update.probe_ms(job.model.embedding_dim, job.training.batch_size_per_rank)
        # every rank decides on the same sums; a kernel that some rank cannot run (no C
        # compiler on one host) sums to infinity there and is left out everywhere
        summed = torch.tensor([times.get(k, float("inf")) for k in embedding_update.KERNELS],
                              dtype=torch.float64, device=device)  # fmt: skip
        dist.all_reduce(summed)
        times = {k: round(float(t) / dist.get_world_size(), 3)
                 for k, t in zip(embedding_update.KERNELS, summed.tolist()) if t != float("inf")}  # fmt: skip
        choice = embedding_update.UpdateChoice(embedding_update.faster(times), times)
    else:
        choice = embedding_update.UpdateChoice(setting, {})
    embedding_update.use(choice.kernel)
    if dist.get_rank() == 0:
        if kept != choice.kernel:  # replaced whole: another rank may be reading it
            recorded.parent.mkdir(parents=True, exist_ok=True)
            staged = recorded.with_suffix(".staged")
            staged.write_text(choice.kernel + "\n")
            staged.replace(recorded)
        timed = ", ".join(f"{k} {v:.2f} ms" for k, v in choice.probe_ms.items())
        print(f"[train] embedding update on CPU: {choice.kernel}" + (f" (probe step: {timed})" if timed else ""), flush=True)
    return choice


def _interaction(job: TrainJob, device: torch.device) -> str:
    """Route the fp32 CPU dot interaction to the configured kernel; returns whose kernel
    computes it ("native", or "aten" for torch's: bf16, GPUs, or no C compiler), or
    "dcn-v2" for the DCN model, which has no dot interaction."""
    config = job.training
    if job.model.arch == "dlrm_dcn":
        native_interaction.use("aten")
        return "dcn-v2"
    if device.type != "cpu" or config.precision != "fp32" or config.cpu_interaction == "aten":
        native_interaction.use("aten")
        return "aten"
    try:
        native_interaction.use("native")
    except native_build.NativeUnavailable as error:
        if config.cpu_interaction == "native":
            raise RuntimeError(f"training.cpu_interaction = 'native': {error}; install a C compiler or set "
                             "training.cpu_interaction = 'aten'") from None
        native_interaction.use("aten")
        if dist.get_rank() == 0:
            print(f"[train] dot interaction on CPU: aten ({error})", flush=True)
        return "aten"
    return "native"


def _matmul(config: TrainingConfig, device: torch.device) -> str:
    """Whose kernels multiplied the MLPs' matrices: oneDNN's fused layers (fp32 on CPU with
    `cpu_matmul = 'onednn'`), or PyTorch's (MKL, or oneDNN for bf16, on CPU; cuBLAS on GPUs)."""
    if device.type != "cpu":
        return "aten"
    return "onednn" if config.precision == "fp32" and cpu_linear.enabled() else "aten"


def _restore(model, optimizer, job: TrainJob) -> tuple[TrainPosition | None, RowLedger | None]:
    """Resume this run from its newest checkpoint, or start from `init_checkpoint`'s weights."""
    latest = latest_checkpoint(job.checkpoint_root)
    if latest is not None:
        position, ledger = load_checkpoint(model, optimizer, latest)
        if dist.get_rank() == 0:
            print(f"[train] resuming from {latest} (step {position.step})", flush=True)
        return position, ledger
    if job.init_checkpoint:
        load_checkpoint(model, None, Path(job.init_checkpoint))
        if dist.get_rank() == 0:
            print(f"[train] starting from the weights of {job.init_checkpoint}", flush=True)
    return None, None


def _keep_metrics_up_to(path: Path, step: int) -> None:
    """Drop metric records past the resumed step: those steps are trained (and logged) again."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _all_reduce_ledger(ledger: RowLedger, device: torch.device) -> tuple[int, int]:
    """Rows trained by all ranks, and the sum of their fingerprints (mod 2**64)."""
    signed = ledger.fingerprint - 2**64 if ledger.fingerprint >= 2**63 else ledger.fingerprint
    values = torch.tensor([ledger.rows, signed], dtype=torch.int64, device=device)
    dist.all_reduce(values)  # int64 addition wraps, which is the mod 2**64 we want
    rows, total = (int(v) for v in values.cpu())
    return rows, total % 2**64


def _write_plan(job: TrainJob, plan, world: int, device: torch.device) -> None:
    shapes = {table_name(f): (n, job.model.embedding_dim) for f, n in job.table_sizes.items()}
    rows = describe_plan(plan, shapes, world)
    (job.out / "plan.txt").write_text(format_plan(rows) + "\n")
    (job.out / "plan.json").write_text(json.dumps(plan_as_json(rows), indent=2))
    print(f"[train] {world} processes on {device.type} ({backend_for(device)}); sharding plan:", flush=True)
    for line in format_plan(rows).splitlines():
        print(f"[train]   {line}", flush=True)


@record
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m training.worker JOB.json")
    job = TrainJob.load(Path(args[0]))
    device = runtime_device(job.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_for(device))
    try:
        run(job, device)
    finally:
        dist.destroy_process_group()


def exit_skipping_teardown() -> None:
    """End a finished worker here, without the interpreter's teardown.

    The gloo process group's C++ threads are still running after `destroy_process_group`
    and a garbage collection (two `pt_gloo_runloop` threads and `gloo_tcp_loop`, seen in
    /proc), so they are stopped during the interpreter's teardown, and a worker rarely died
    there with SIGABRT ("terminate called without an active exception") after it had
    written everything: the launcher then reported a failed rank. Nothing is left to run at
    this point (no Python thread but the main one; summary, checkpoint and predictions
    written and closed), so the output is flushed and the process leaves with status 0.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
