"""One process of a sharded training job. torchrun starts it through
`training.launch.rank`, which imports this module without the cyclic collector:

    python -m training.launch.agent --nproc-per-node=N -m training.launch.rank JOB.json
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torchrec.optim.keyed import CombinedOptimizer

from evaluation.calibration import served_calibrator
from training.job import CALIBRATION_PART, TrainJob, TrainSummary
from training.launch.device import backend_for, runtime_device
from training.launch.processes import die_with_parent
from training.loop.admission import AdmissionLedger
from training.loop.checkpoint import (
    RowLedger,
    TrainPosition,
    checkpoint_bytes,
    load_checkpoint,
    save_checkpoint,
)
from training.loop.checkpoint_chain import latest_checkpoint, refused_checkpoints
from training.loop.heldout import predict
from training.loop.optimizers import attach_embedding_optimizer, build_optimizer
from training.loop.progress import read_records, record_line
from training.loop.schedule import LRSchedule, build_schedule
from training.loop.steps import pipeline_kind
from training.model.build import (
    build_train_model,
    compile_dense_parts,
    dlrms_in,
    row_width,
    start_at_click_rate,
    table_name,
)
from training.model.cuda_graphs import graph_dense_parts
from training.model.dot_interaction import swap_dot_interaction
from training.model.managed_ids import ManagedIds, churn_advice
from training.model.objective import attach_managed_ids, managed_ids_of
from training.model.precision import allow_tf32, logit_in_float32, resolve_precision
from training.reference_cache import fitted_reference
from training.sharding.plan import describe_plan, format_plan, plan_as_json, shard_model
from training.sharding.start import WideStart, start_wide
from training.trainer import TrainStats, train


@dataclass
class BuiltModel:
    """A sharded model ready to train: its optimizer, schedule, the CPU kernels it runs, and
    whether its weights before the first step are a model worth keeping (a wide part
    started as the fitted regression)."""

    model: torch.nn.Module
    optimizer: CombinedOptimizer
    schedule: LRSchedule
    cpu: dict[str, str]
    started_as_regression: bool


def run(job: TrainJob, device: torch.device) -> None:
    """Build, shard and start the model; resume or warm-start it; train; save the last
    checkpoint; score the evaluation parts; rank 0 writes the summary. A run that chose its
    length on rows it did not train on, and keeps no calibrator fitted on them, trains on
    them too (`refit`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != job.workers.world_size:
        raise SystemExit(f"this job is for {job.workers.world_size} processes ({job.hosts} host(s) × "
                         f"{job.training.nproc}), but torchrun started {world}")  # fmt: skip
    precision, warning = resolve_precision(job.training.precision, device)
    if rank == 0 and warning:
        print(f"[train] warning: {warning}", flush=True)
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, precision=precision))
    config = job.training
    allow_tf32(device)
    torch.set_num_threads(config.threads_per_proc)
    built = build(job, device, write_plan=rank == 0)
    start, ledger = _restore(built.model, built.optimizer, job)
    if rank == 0:
        _keep_metrics_up_to(job.folder.metrics, start.step if start else 0)
        if config.chooses_epochs and not job.chooses_epochs:
            print("[train] training.epochs = \"auto\" has no held-out rows to choose on (the job has no "
                  "validation files): training one epoch; set training.epochs", flush=True)  # fmt: skip
    stats = train(built.model, built.optimizer, job, device, built.schedule, start, ledger,
                  started_from_model=bool(job.init_checkpoint) or built.started_as_regression)  # fmt: skip
    checkpoint = save_checkpoint(built.model, built.optimizer, job.checkpoint_root, stats.position, stats.ledger,
                                 config.keep_checkpoints, config.delta_every)  # fmt: skip
    chosen = stats.validation.summary() if stats.validation else {}
    scored_calibration = refit = False
    kept_regression = False
    if job.refit_files and stats.validation is not None:
        # the held-out rows chose the length; if they fit no calibrator worth serving, they
        # train the served model too (below)
        predict(built.model, dataclasses.replace(job, eval_files={}), device)
        kept_regression = built.started_as_regression and not stats.validation.scores.best_epochs
        scored_calibration, refit = True, kept_regression or not _calibrator_kept(job)
    if refit and stats.validation is not None and stats.validation.scores.best_epochs:
        # the kept model goes on over the rows that chose it: every row is trained, and the
        # served model is the validated one plus a tenth of an epoch, not a fresh draw
        built, stats, checkpoint = _train_on_the_held_out_rows(job, device, built, stats)
        chosen["run_length"] += ("; no calibrator was kept, so the kept model trained one more pass, over the held-out "
                                 "rows that chose it")  # fmt: skip
    elif refit:
        del built
        built, stats, checkpoint = _regression_on_every_row(job, device)
        start = None
        # A regression fitted with a free bias is calibrated on its rows by its own fit (its
        # predictions sum to its clicks); a calibrator of the few held-out rows adds only their
        # noise (Adult's first 10,000 rows: Platt on 761 rows served NE 0.5733, the regression
        # alone 0.5682), and those rows are better spent on the fit.
        why = ("the regression it kept is calibrated by its own fit (no calibrator is fitted)" if kept_regression
               else "no calibrator was kept")  # fmt: skip
        chosen["run_length"] += (f"; {why}, so the regression it started from was fitted again on every training row "
                                 "(the held-out ones included)")  # fmt: skip
    rows_trained, fingerprint = _all_reduce_ledger(stats.ledger, device)
    rows = predict(built.model, dataclasses.replace(job, calibration_files=()) if scored_calibration else job, device)
    if rank == 0 and stats.profile is not None:
        job.folder.write_profile(stats.profile)
    # Every rank's predictions are written before rank 0 reports: on several hosts, its
    # host's launcher reads them all once its own workers end.
    dist.barrier()
    if rank == 0:
        job.folder.write_summary(TrainSummary(
            steps=stats.steps, samples=stats.samples, seconds=stats.seconds, samples_per_s=stats.samples_per_s,
            first_step_seconds=stats.first_step_seconds, compiled=config.compile, precision=config.precision,
            cpu=built.cpu, rows_trained=rows_trained, rows_fingerprint=fingerprint,
            resumed_from_step=start.step if start else 0, world_size=world, global_batch_size=config.batch_size,
            device=device.type, backend=backend_for(device),
            pipeline=pipeline_kind(config, device, job.managed_ids is not None, world),
            checkpoint=str(checkpoint), checkpoint_bytes=checkpoint_bytes(checkpoint), eval_rows_rank0=rows,
            **_managed_figures(built.model, stats.admissions, job.table_sizes),
            refit=bool(refit), **chosen,
        ))  # fmt: skip
        print(f"[train] done: {stats.steps} steps, {rows_trained:,} rows trained, "
              f"{stats.samples_per_s:,.0f} samples/s", flush=True)


def _regression_on_every_row(job: TrainJob, device: torch.device) -> tuple[BuiltModel, TrainStats, Path]:
    """A wide model kept at its start, the fitted regression, with no calibrator kept: the
    regression fitted again on every training row (`refit_files`), in the refit folder, and
    not trained. Returns the model, its figures (no step) and its checkpoint."""
    refit_job = job.refit_job(1)
    if dist.get_rank() == 0:
        refit_job.out.mkdir(parents=True, exist_ok=True)
        print("[train] no calibrator is kept: the regression the model kept is fitted again on every training row",
              flush=True)  # fmt: skip
    built = build(refit_job, device, write_plan=False)
    built.optimizer.init_state()  # type: ignore[attr-defined]  # a checkpoint carries the optimizer's state
    stats = TrainStats(steps=0, samples=0, seconds=0.0, first_step_seconds=0.0, ledger=RowLedger(),
                       position=TrainPosition(0, 0, 0))  # fmt: skip
    checkpoint = save_checkpoint(built.model, built.optimizer, refit_job.checkpoint_root, stats.position,
                                 stats.ledger, job.training.keep_checkpoints, job.training.delta_every)  # fmt: skip
    return built, stats, checkpoint


def _train_on_the_held_out_rows(job: TrainJob, device: torch.device, built: BuiltModel,
                                stats: TrainStats) -> tuple[BuiltModel, TrainStats, Path]:  # fmt: skip
    """The kept model (with its optimizer's state) trained one pass over the held-out rows
    that chose it (every training day's, `validation_files`), in the refit folder
    (`refit_job`): a relaunch resumes that pass from its own checkpoints, or starts it again
    from the kept model's. Returns the model, figures that count both parts' steps and rows,
    and the final checkpoint.

    Rather than a fresh model trained on every row for the chosen epochs: that model is a
    new draw that no row ever scored (on Avazu's first 10,000 rows one such draw served
    calibration 0.75), and it costs a second training (docs/run-length.md)."""
    rank = dist.get_rank()
    more = dataclasses.replace(job.refit_job(1), train_files=job.validation_files)
    if rank == 0:
        more.out.mkdir(parents=True, exist_ok=True)
        print("[train] no calibrator is kept: the kept model trains one more pass, over the held-out rows",
              flush=True)  # fmt: skip
    start, ledger = _restore(built.model, built.optimizer, more)
    if rank == 0:
        _keep_metrics_up_to(more.folder.metrics, start.step if start else 0)
    extra = train(built.model, built.optimizer, more, device, built.schedule, start, ledger)
    checkpoint = save_checkpoint(built.model, built.optimizer, more.checkpoint_root, extra.position, extra.ledger,
                                 job.training.keep_checkpoints, job.training.delta_every)  # fmt: skip
    both = RowLedger()
    for part in (stats.ledger, extra.ledger):
        both.add(part.rows, part.fingerprint)
    return built, dataclasses.replace(extra, steps=stats.steps + extra.steps, ledger=both), checkpoint


def _calibrator_kept(job: TrainJob) -> bool:
    """Whether the pipeline will serve a calibrator fitted on the scores of the calibration
    rows every rank has just written: rank 0 applies the pipeline's own rule to them
    (`served_calibrator`) and tells every rank."""
    dist.barrier()  # every rank's scores are written
    kept = [False]
    if dist.get_rank() == 0:
        held_out = job.folder.read_predictions(CALIBRATION_PART)
        calibrator, _ = served_calibrator(job.evaluation.calibration, held_out.labels, held_out.predictions)
        kept = [calibrator.method != "none"]
    dist.broadcast_object_list(kept, src=0)
    return bool(kept[0])


def build(job: TrainJob, device: torch.device, write_plan: bool) -> BuiltModel:
    """The job's model built, sharded and started (at the click rate; a wide part at the
    regression), with its optimizer and schedule; rank 0 writes the plan when asked."""
    config = job.training
    torch.manual_seed(config.seed)
    model = build_train_model(job.model, job.table_sizes, torch.device("meta"), job.dense_features)
    cpu = _cpu_kernels(model, job, device)
    _gpu_interaction(model, device)
    if config.precision == "bf16":
        logit_in_float32(model)
    attach_embedding_optimizer(model, config)
    pooling = {table_name(feature): factor for feature, factor in job.pooling_factors.items()}
    managed = None
    if job.managed_ids is not None:  # the same remapper on every process (training/loop/admission.py)
        settings = job.managed_ids
        managed = ManagedIds(job.table_sizes, settings.policy, settings.admit_min_count, device)
    sharded, plan = shard_model(model, job.sharding, device, job.workers.per_rank_batch(config.batch_size), pooling,
                                managed.state_bytes() if managed else 0)  # fmt: skip
    if managed is not None:
        attach_managed_ids(sharded, managed)
    # a resumed or warm-started run loads its own weights over these starting values
    start_at_click_rate(sharded, job.initial_click_rate)
    wide = _wide_start(job)
    start_wide(sharded, wide)
    if config.compile:
        compile_dense_parts(sharded, device)
    _gpu_graphs(sharded, job, device)
    if write_plan:
        _write_plan(job, plan, dist.get_world_size(), device)
    optimizer = build_optimizer(sharded, config)
    return BuiltModel(sharded, optimizer, build_schedule(sharded, optimizer, config), cpu, wide is not None)


def _managed_figures(model: torch.nn.Module, admissions: AdmissionLedger | None, table_sizes: dict[str, int]) -> dict:
    """The summary's figures of managed ids: rounds, restarted rows, resident ids, and how much
    the tables churn (said in one line when they do)."""
    managed = managed_ids_of(model)
    if managed is None or admissions is None:
        return {}
    churn = managed.churn
    advice = churn_advice(churn, table_sizes)
    if advice:
        print(f"[train] {advice}", flush=True)
    return {"managed_rounds": admissions.rounds, "managed_restarted_rows": sum(admissions.restarted_rows.values()),
            "managed_resident_ids": sum(len(managed.id_rows(feature)) for feature in managed.tables),
            "managed_admitted_ids": sum(c.admitted for c in churn.values()),
            "managed_returned_ids": sum(c.returned for c in churn.values()),
            "managed_live_ids": max((c.live_ids for c in churn.values()), default=0), "managed_churn": advice}  # fmt: skip


def _cpu_kernels(model: torch.nn.Module, job: TrainJob, device: torch.device) -> dict[str, str]:
    """On a CPU host, swap this project's CPU kernels into the model (training/cpu); on a
    GPU host, nothing: TorchRec's own modules and fbgemm's CUDA kernels train there, and
    the CPU kernels are not even imported. Returns which kernel computes what."""
    if device.type != "cpu":
        return {}
    from training.cpu import accelerate

    training = job.training
    kernels = accelerate(model, training.cpu, training.precision, training.embedding_weight_decay).as_dict()
    if dist.get_rank() == 0:
        print("[train] CPU kernels: " + ", ".join(f"{part} {kernel}" for part, kernel in kernels.items()), flush=True)
    return kernels


def _gpu_interaction(model: torch.nn.Module, device: torch.device) -> None:
    """On a GPU, the dot interaction that gathers and scatters (training/model/dot_interaction.py)
    instead of TorchRec's, whose backward sorts: before sharding, which moves it to the GPU."""
    if device.type == "cuda":
        for dlrm in dlrms_in(model):
            swap_dot_interaction(dlrm)


def _gpu_graphs(model: torch.nn.Module, job: TrainJob, device: torch.device) -> None:
    """`training.cuda_graphs = "auto"`: the dense part as CUDA graphs (training/model/cuda_graphs.py)
    in a one-process GPU job that does not compile it. Several processes' dense parts train
    under DDP, whose gradient hooks are not captured here."""
    config = job.training
    if config.cuda_graphs != "auto" or device.type != "cuda" or config.compile or dist.get_world_size() > 1:
        return
    batch = job.workers.per_rank_batch(config.batch_size)
    graphed = graph_dense_parts(model, batch, job.dense_features, job.model.embedding_dim, device,
                                config.precision == "bf16")  # fmt: skip
    if graphed and dist.get_rank() == 0:
        print(f"[train] the dense part replays as CUDA graphs at batch {batch:,}", flush=True)


def _wide_start(job: TrainJob) -> WideStart | None:
    """The logistic regression a fresh wide model starts from (`model.wide_start`): fitted on
    rank 0, as the pipeline's reference is (same rows, folds and sample), and sent to every
    rank, since replicated weights must start equal. None: the own weights start at zero
    (so does a run that will load a checkpoint over them)."""
    if not job.starts_at_regression or latest_checkpoint(job.checkpoint_root):
        return None
    fitted: list[WideStart | None] = [None]
    if dist.get_rank() == 0:
        evaluation = job.evaluation
        reference = fitted_reference(job.table_sizes, job.train_files,
                                     max_rows=evaluation.reference_max_rows, folds=evaluation.reference_folds,
                                     crosses=job.crosses, per_feature_l2=job.model.wide_start_l2 == "per_feature",
                                     count_bins=job.count_bins)  # fmt: skip
        derived = [*([f"{len(job.crosses)} crossed pair(s)"] if job.crosses else []),
                   *([f"{len(job.count_bins)} count(s) cut into bins"] if job.count_bins else [])]
        crossed = f" with its {' and '.join(derived)}" if derived else ""
        print(f"[train] the wide part starts as the logistic regression{crossed} fitted on {reference.fit.train_rows:,} "
              f"rows ({reference.how_chosen})", flush=True)  # fmt: skip
        fitted = [WideStart.of_regression(reference.fit.model)]
    dist.broadcast_object_list(fitted, src=0)
    return fitted[0]


def _restore(model, optimizer, job: TrainJob) -> tuple[TrainPosition | None, RowLedger | None]:
    """Resume this run from its newest checkpoint, or start from `init_checkpoint` (a warm start)."""
    latest = latest_checkpoint(job.checkpoint_root)
    track = job.training.checkpoint_mode == "delta"
    if dist.get_rank() == 0:
        for refused in refused_checkpoints(job.checkpoint_root):
            print(f"[train] {refused}; {'resuming from ' + str(latest) if latest else 'starting afresh'}", flush=True)
    if latest is not None:
        position, ledger = load_checkpoint(model, optimizer, latest, track=track)
        if dist.get_rank() == 0:
            print(f"[train] resuming from {latest} (step {position.step})", flush=True)
        return position, ledger
    if job.init_checkpoint:
        load_checkpoint(model, optimizer if job.init_optimizer else None, Path(job.init_checkpoint), same_run=False,
                        track=track)  # fmt: skip
        if dist.get_rank() == 0:
            what = "weights and optimizer state" if job.init_optimizer else "weights"
            print(f"[train] starting from the {what} of {job.init_checkpoint}", flush=True)
    return None, None


def _keep_metrics_up_to(path: Path, step: int) -> None:
    """Drop metric records past the resumed step: those steps are trained (and logged) again.

    The file is replaced, not rewritten in place, so a `MetricsFollower` sees a new file
    and reads it from its beginning."""
    if not path.is_file():
        return
    kept = [record for record in read_records(path) if record.step <= step]
    staged = path.with_name(path.name + ".staged")
    staged.write_text("".join(record_line(record) for record in kept))
    staged.replace(path)


def _all_reduce_ledger(ledger: RowLedger, device: torch.device) -> tuple[int, int]:
    """Rows trained by all ranks, and the sum of their fingerprints (mod 2**64)."""
    signed = ledger.fingerprint - 2**64 if ledger.fingerprint >= 2**63 else ledger.fingerprint
    values = torch.tensor([ledger.rows, signed], dtype=torch.int64, device=device)
    dist.all_reduce(values)  # int64 addition wraps, which is the mod 2**64 we want
    rows, total = (int(v) for v in values.cpu())
    return rows, total % 2**64


def _write_plan(job: TrainJob, plan, world: int, device: torch.device) -> None:
    shapes = {table_name(f): (n, row_width(job.model)) for f, n in job.table_sizes.items()}
    rows = describe_plan(plan, shapes, world)
    job.folder.write_plan(format_plan(rows), plan_as_json(rows))
    print(f"[train] {world} processes on {device.type} ({backend_for(device)}); sharding plan:", flush=True)
    for line in format_plan(rows).splitlines():
        print(f"[train]   {line}", flush=True)


@record
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m training.launch.rank JOB.json")
    die_with_parent()  # a torchrun killed outright takes its workers with it
    job = TrainJob.load(Path(args[0]))
    job.folder.write_pid(int(os.environ.get("RANK", "0")), os.getpid())
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

    A barrier before `destroy_process_group` is no cure: the threads outlive it because the
    process group is still referenced from C++ (no Python object holds it after the destroy;
    in a bare gloo script, where nothing else does, the destroy does stop them), and a
    barrier changes when ranks leave, not what keeps those threads alive.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
