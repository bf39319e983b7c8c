"""What each command reports: one dataclass per result, one JSON form (`training.codec`),
and one formatter for people (`for_people`).

The `--json` output of a command is `encode(report)`; the flows return the same JSON form
(what Prefect stores and shows), and the command reads it back with `decode`. Each report
checks its fields' types when it is built (`Checked`), so a producer cannot hand the
command a report that it would fail to read back. Days are
shown as the config writes them (ISO dates for a dated warehouse, else integers).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evaluation.promotion import reference_line
from training.codec import FLATTENED, NOT_IN_JSON, Checked, decode

Day = int | str  # as the config writes it


@dataclass(frozen=True)
class IngestDay(Checked):
    """One day of the ingest stage (each file: read = written + quarantined)."""

    day: int
    rows_read: int
    rows_written: int
    rows_quarantined: int
    files_failed: list[str]
    skipped: bool  # already ingested from the same files: nothing redone
    files: list[dict[str, Any]] = field(default_factory=list)  # source, rows_read, rows_written, rows_quarantined


@dataclass(frozen=True)
class IngestTotals(Checked):
    """`dlrm ingest`: every day's rows together."""

    rows_read: int = 0
    rows_written: int = 0
    rows_quarantined: int = 0
    files_failed: list[str] = field(default_factory=list)
    partial: bool = False  # a file failed: its day holds the other files' rows only


@dataclass(frozen=True)
class RunSummary(Checked):
    """`dlrm run`: a pipeline run that trained."""

    as_of: Day | None  # a recurring run's day; None for a run of the configured days
    eval_days: list[Day]
    days_trained: list[Day]
    lineage_days: list[Day]  # every day the model has seen, this run's included
    warm_start_version: str | None  # the registered version it continued
    rows_ingested: int
    rows_quarantined: int
    files_failed: list[str]
    days_already_ingested: list[Day]
    # eval_ne, eval_auc, eval_calibration, eval_log_loss, eval_ne_day_<day>,
    # eval_ne_slice_rank_<k>, <reference>_ne, ne_gain_vs_<reference>_pct; of the served
    # (calibrated) model, and eval_ne_uncalibrated, eval_calibration_uncalibrated, ... before
    metrics: dict[str, float] = field(default_factory=dict, metadata=FLATTENED)
    train_samples_per_s: float = 0.0  # the pipeline's name for samples_per_s, kept for scripts
    samples_per_s: float = 0.0  # the name `dlrm train --json` reports it by
    rows_trained: int = 0
    checkpoint_bytes: int = 0  # the served model's final checkpoint on disk (every rank's files)
    # a night that continued a version: its table rows that differ from that version's (the
    # registered model's rows_changed.parquet says which); None for a fresh model
    rows_changed: int | None = None
    table_rows: int = 0  # every table's rows together
    # the pairs of features the model crosses (`model.crosses`; a night: its champion's), "A_x_B"
    crosses: list[str] = field(default_factory=list)
    # the counts cut into bins (`model.count_bins`; a night: its champion's): feature → bins
    count_bins: dict[str, int] = field(default_factory=dict)
    resumed_from_step: int = 0
    steps: int = 0
    world_size: int = 0
    global_batch_size: int = 0  # the batch the run trained at (after the run-length rule)
    mlflow_run_id: str = ""
    mlflow_run_url: str | None = None
    model_version: str | None = None
    promoted: bool = False
    promotion_reason: str = ""
    champion_ne_same_days: float | None = None
    tuning_key: str = ""  # the key of the batch and hardware the run trained at
    tuning_decision: str = ""
    tuning_reason: str = ""
    # the seeds' spread, (max − min) / min NE, of the trial whose parameters the run trains
    # with, where that trial trained several seeds (`tuning.seeds_per_trial`); None: not measured
    seed_spread: float | None = None
    seed_spread_seeds: int = 0
    skipped: bool = False
    calibrator: str = ""  # how the served probabilities are calibrated ("none": not)
    calibration_rows: int = 0  # training rows held out of training to fit it
    # managed ids whose tables churn: how much, and the table size that would hold the live ids
    managed_churn: str = ""
    # a run that chose its length (`training.epochs = "auto"`): the epochs trained and kept, and why
    epochs_trained: int = 0
    epochs_kept: int = 0
    run_length: str = ""
    refit: bool = False  # no calibrator was kept: the held-out rows trained the served model too
    # the port workflow's figures (training/tuning/port.py): the hardware's batch, the NE gap
    # against the nearest tuned key at its own batch, the time to reach that key's NE
    port: dict[str, Any] | None = None

    def __getitem__(self, key: str) -> Any:
        """`summary["eval_ne"]`: a field, or a metric."""
        return getattr(self, key) if key in self.__dataclass_fields__ else self.metrics[key]


@dataclass(frozen=True)
class SkippedNight(Checked):
    """`dlrm run --as-of N` for a night already covered: nothing trained."""

    as_of: Day
    skip_reason: str
    lineage_days: list[Day]
    eval_ne: float | None  # the covering version's NE on this day, when judged on it
    model_version: str | None  # the version that covers the night
    promotion_reason: str
    champion_version: str | None
    skipped: bool = True
    days_trained: list[Day] = field(default_factory=list)
    warm_start_version: str | None = None
    rows_trained: int = 0
    promoted: bool = False


def run_report(data: dict[str, Any]) -> RunSummary | SkippedNight:
    """A flow's returned summary, typed again."""
    return decode(SkippedNight if data.get("skipped") else RunSummary, data, "the pipeline's summary")


@dataclass(frozen=True)
class BackfillReport(Checked):
    """`dlrm backfill`: each night's summary, in order."""

    nights: list[Any]  # RunSummary | SkippedNight


@dataclass(frozen=True)
class TrainReport(Checked):
    """`dlrm train` on node 0 (or one host): the job's figures and its NE on the eval days,
    with the keys `dlrm run` reports them by."""

    world_size: int
    global_batch_size: int
    steps: int
    rows_trained: int
    samples_per_s: float
    eval_ne: float  # of the served probabilities (calibrated, where a calibrator was kept)
    eval_ne_uncalibrated: float  # of the model's own probabilities
    eval_calibration: float  # Σ served predictions / Σ clicks
    eval_days: list[Day]
    resumed_from_step: int
    device: str
    checkpoint: str
    out_dir: str
    calibrator: str  # how the served probabilities are calibrated ("none": not)
    calibration_rows: int  # training rows held out of training to fit it
    # a run that chose its length (`training.epochs = "auto"`): the epochs trained and kept, and why
    epochs_trained: int = 0
    epochs_kept: int = 0
    run_length: str = ""
    refit: bool = False  # no calibrator was kept: the held-out rows trained the served model too


@dataclass(frozen=True)
class NodeReport(Checked):
    """`dlrm train` on another node: its part is done; node 0 reports the job."""

    node_rank: int
    nnodes: int
    out_dir: str
    report: str = "node 0 prints the job's summary"


@dataclass(frozen=True)
class SubmitReport(Checked):
    """`dlrm submit`: the Slurm job of `dlrm train`; with `--wait`, how it ended."""

    job_id: str
    script: str  # the batch script, kept beside its logs
    logs: str  # `<job>.out` (the batch script's) and `<job>-node<N>.out` (each node's)
    state: str  # "SUBMITTED", or Slurm's last state (COMPLETED, FAILED, CANCELLED, TIMEOUT, …)
    exit_code: str = ""  # Slurm's "status:signal"
    reason: str = ""  # Slurm's reason, when it gives one
    restarts: int = 0  # times Slurm requeued it
    eval_ne: float | None = None  # node 0's report (`dlrm train --json`), once completed
    train: dict | None = None  # that whole report


@dataclass(frozen=True)
class PreprocessReport(Checked):
    """`dlrm preprocess`: the fitted state and each day's feature folder."""

    state_id: str
    table_sizes: dict[str, int]
    train_rows: int
    days: dict[str, str]  # day as written → its feature folder
    train_days: list[Day] = field(default_factory=list)
    click_rate: float = 0.0


@dataclass(frozen=True)
class RetuneReport(Checked):
    """`dlrm retune`: the study's best trial so far."""

    study: str
    tuning_key: str
    best_ne: float | None
    best_params: dict[str, Any] | None
    best_trial: int | None
    trials_run_here: list[int]
    stopped_by: str
    warm_start_trials: int
    mlflow_parent_run_id: str
    # the best trial against the configured values: "kept the configured values: …" (best_trial
    # -1, best_params the configured ones) or "trial #N replaces the configured values: …"
    decision: str = ""


@dataclass(frozen=True)
class CharacterizeReport(Checked):
    """`dlrm characterize`: the measured points, the hardware's batch, the MLflow run."""

    config: str
    device: str
    hardware_batch_size: int | None  # the saturation point of the fastest series (one of the points)
    saturated: bool  # False: the curve still rose at the largest batch measured (which is then the choice)
    hardware_series: str  # the series it was found in
    points: list[dict[str, Any]]  # one per measured point (flows/characterize/measure.point_row)
    skipped: list[dict[str, Any]]  # points the device could not run, each with its reason
    series: list[dict[str, Any]]  # each series' values, saturation point and whether it saturated
    tuning_key: dict[str, Any]  # the key at the hardware's batch: its hardware fields and fingerprint
    min_gain: float
    patience: int  # doublings in a row that each gained less than min_gain: saturated
    seconds: float
    out_dir: str
    mlflow_run_id: str = ""


@dataclass(frozen=True)
class PlanReport(Checked):
    """`dlrm plan`: where each table goes on a cluster, and the planner's estimates."""

    tables: int
    embedding_gib: float
    sharding_types: dict[str, int]
    compute_kernels: dict[str, int]
    row_wise_tables: list[str]
    host_memory_tables: list[str]
    per_rank: list[dict[str, Any]]  # rank, hbm_bytes, ddr_bytes, perf_ms
    plan: list[dict[str, Any]]  # a row per table: sharding_type, compute_kernel, ranks, bytes_per_rank
    planner_seconds: float = 0.0
    text: str = field(default="", metadata=NOT_IN_JSON)  # the plan as a table, for people


@dataclass(frozen=True)
class EvaluateReport(Checked):
    """`dlrm evaluate`: every metric of a predictions file."""

    ne: float
    auc: float
    calibration: float
    log_loss: float
    ctr: float
    count: float


@dataclass(frozen=True)
class DeltaReport(Checked):
    """`dlrm export-delta`: what takes one version's served model to another's."""

    model: str
    from_version: str
    to_version: str
    out: str
    rows_changed: int  # table rows whose floats differ
    table_rows: int  # every table's rows
    dense_tensors: int  # tensors written whole (the MLPs)
    bytes: int  # the delta's files


# -- for people ---------------------------------------------------------------------------


@functools.singledispatch
def for_people(report: Any, config: Any = None) -> str:
    """The report as a person reads it on the console (`config`: the run's, where the text
    names its folders and UIs)."""
    raise TypeError(f"no text form for {type(report).__name__}")


@for_people.register
def _(report: CharacterizeReport, config: Any = None) -> str:
    header = f"{'series':<28} {'batch':>8} {'samples/s':>12} {'range':>19} {'step ms':>9} {'planner ms':>10} {'peak MB':>9}"
    lines = [f"Characterization of '{report.config}' on {report.device} ({report.seconds:,.0f} s)", "", header,
             "-" * len(header)]
    for point in report.points:
        spread = f"{point['samples_per_s_min']:,.0f}–{point['samples_per_s_max']:,.0f}"
        lines.append(f"{point['series'][:28]:<28} {point['batch_size']:>8,} {point['samples_per_s']:>12,.0f} {spread:>19} "
                     f"{point['measured_step_ms']:>9.2f} {point['estimated_step_ms']:>10.3f} {point['peak_memory_mb']:>9,.0f}")
    lines += [f"skipped: [{s['series']}] batch {s['batch_size']:,}: {s['reason']}" for s in report.skipped]
    if report.hardware_batch_size is None:
        lines.append("\nno point was measured: no hardware batch")
    else:
        how = "where throughput saturates" if report.saturated else "the largest measured: throughput still rose"
        lines.append(f"\nhardware batch: {report.hardware_batch_size:,} ({how}: the next {report.patience} doublings "
                     f"each gain < {report.min_gain:.0%}; series {report.hardware_series})")
    if report.mlflow_run_id:
        lines.append(f"MLflow run {report.mlflow_run_id}: plots and the table under characterize/")
    return "\n".join(lines)


@for_people.register
def _(report: DeltaReport, config: Any = None) -> str:
    share = 100.0 * report.rows_changed / report.table_rows if report.table_rows else 0.0
    return (f"{report.model} version {report.from_version} → {report.to_version}: {report.rows_changed:,} of "
            f"{report.table_rows:,} table rows changed ({share:.2f} %), {report.dense_tensors} dense tensors; "
            f"{report.bytes / 2**20:,.2f} MiB in {report.out}\n"
            f"apply it to the served version {report.from_version}: "
            f"mlflow.pyfunc.load_model(uri).unwrap_python_model().apply_delta(\"{report.out}\")")


@for_people.register
def _(report: SubmitReport, config: Any = None) -> str:
    lines = [f"Slurm job {report.job_id}: {report.state}" + (f" (exit {report.exit_code})" if report.exit_code else "")
             + (f", requeued {report.restarts}×" if report.restarts else "")
             + (f": {report.reason}" if report.reason not in ("", "None") else "")]  # fmt: skip
    if report.eval_ne is not None:
        lines.append(f"eval NE {report.eval_ne:.5f}")
    lines += [f"script: {report.script}", f"logs:   {report.logs}"]
    return "\n".join(lines)


@for_people.register
def _(report: IngestTotals, config: Any = None) -> str:
    return (f"{report.rows_read:,} read, {report.rows_written:,} written, {report.rows_quarantined:,} quarantined"
            + (f"; {len(report.files_failed)} file(s) failed" if report.partial else ""))  # fmt: skip


@for_people.register
def _(report: SkippedNight, config: Any = None) -> str:
    return "\n".join(["", night_line(report), (f"  champion             version {report.champion_version}, lineage days "
                      f"{report.lineage_days}")])  # fmt: skip


@for_people.register
def _(report: BackfillReport, config: Any = None) -> str:
    return "\n".join(night_line(night) for night in report.nights)


def night_line(summary: RunSummary | SkippedNight) -> str:
    """One line per night of a backfill."""
    if isinstance(summary, SkippedNight):
        return f"as of day {summary.as_of}: skipped: {summary.skip_reason}"
    start = f"from version {summary.warm_start_version}" if summary.warm_start_version else "from scratch"
    return (f"as of day {summary.as_of}: trained days {summary.days_trained} {start} "
            f"({summary.rows_trained:,} rows), NE {summary['eval_ne']:.4f}, calibration {summary['eval_calibration']:.3f}, "
            f"version {summary.model_version} "
            f"{'promoted' if summary.promoted else 'not promoted'}")  # fmt: skip


@for_people.register
def _(report: RunSummary, config: Any = None) -> str:
    metrics, ne = report.metrics, report["eval_ne"]

    def reference(name: str, label: str) -> list[str]:
        if f"{name}_ne" not in metrics:
            return []
        # no "% better" against a reference that is itself no better than the constant
        constant = metrics.get("baseline_constant_ne") if name != "baseline_constant" else None
        return ["  " + reference_line(label, ne, metrics[f"{name}_ne"], constant)]

    bayes = ([(f"  Bayes-optimal NE     {metrics['bayes_ne']:.4f}   (the best reachable; the model is "
              f"{-metrics['ne_gain_vs_bayes_pct']:.1f} % above it)")] if "bayes_ne" in metrics else [])  # fmt: skip
    champion = report.champion_ne_same_days
    lineage = ("from version " + str(report.warm_start_version)) if report.warm_start_version else "from scratch"
    lines = [
        "",
        f"DLRM pipeline '{config.name}' finished",
        f"  rows ingested        {report.rows_ingested:,}  (quarantined: {report.rows_quarantined:,})",
        *([f"  PARTIAL: {len(report.files_failed)} file(s) failed: " + "; ".join(report.files_failed)]
          if report.files_failed else []),
        f"  held-out days        {report.eval_days}  ({int(metrics['eval_count']):,} examples)",
        *([(f"  lineage              trained days {report.days_trained} {lineage}; the model has seen days "
           f"{report.lineage_days}")] if report.as_of is not None else []),
        *([(f"  rows changed         {report.rows_changed:,} of {report.table_rows:,} table rows differ from version "
            f"{report.warm_start_version}'s (rows_changed.parquet in the registered model)")]
          if report.rows_changed is not None and report.table_rows else []),
        f"  NE                   {ne:.4f}",
        *bayes, *reference("logistic_regression", "logistic regression"), *reference("baseline_constant", "constant click rate"),
        f"  AUC                  {metrics['eval_auc']:.4f}",
        f"  calibration          {metrics['eval_calibration']:.3f}"
        + (f"  (before calibration {metrics['eval_calibration_uncalibrated']:.3f}, NE {metrics['eval_ne_uncalibrated']:.4f}; "
           f"{report.calibrator})" if "eval_calibration_uncalibrated" in metrics else ""),
        f"  log loss             {metrics['eval_log_loss']:.4f}",
        (f"  training throughput  {report.samples_per_s:,.0f} samples/s ({report.world_size} processes, "
        f"{config.sharding.sharding_type})"),
        f"  hyperparameters      {report.tuning_decision}: {report.tuning_reason}",
        *([(f"  seed spread          {100 * report.seed_spread:.2f} % of validation NE over {report.seed_spread_seeds} seeds "
            "of the trial these parameters come from (a smaller gap to a reference or champion is within the seed's reach)")]
          if report.seed_spread is not None else []),
        *([port_line(report.port)] if report.port else []),
        *([f"  run length           {report.run_length}"] if report.run_length else []),
        *([(f"  crossed pairs        {len(report.crosses)}: {', '.join(name.replace('_x_', ' × ') for name in report.crosses)} "
            "(model.crosses)")] if report.crosses else []),
        *([(f"  counts cut into bins {len(report.count_bins)}: "
            f"{', '.join(f'{name} ({bins})' for name, bins in report.count_bins.items())} (model.count_bins)")]
          if report.count_bins else []),
        *([f"  tables churn         {report.managed_churn}"] if report.managed_churn else []),
        f"  MLflow run           {report.mlflow_run_url or report.mlflow_run_id}  (model version {report.model_version})",
        f"  champion             {'promoted: ' if report.promoted else 'not promoted: '}{report.promotion_reason}"
        + (f" (champion NE on these days {champion:.4f})" if champion is not None and not report.promoted else ""),
        "",
        "Open the UIs on this run's data:",
        f"  MLflow:  .venv/bin/mlflow ui --backend-store-uri {config.tracking_uri} --port 5000",
        "           then http://127.0.0.1:5000",
        f"  Prefect: PREFECT_HOME={os.environ.get('PREFECT_HOME', '~/.prefect')} .venv/bin/dlrm server",
        "           then http://127.0.0.1:4200",
        f"  Files:   {Path(config.run_dir).resolve()}",
    ]  # fmt: skip
    return "\n".join(lines)


def port_line(port: dict[str, Any]) -> str:
    """The port workflow's figures in one line (training/tuning/port.py)."""
    how = "saturation" if port["saturated"] else "largest measured"
    text = (f"  port                 hardware batch {port['hardware_batch_size']:,} "
            f"({how}, {port['hardware_samples_per_s']:,.0f} samples/s)")
    if port.get("ne_gap") is not None:
        text += (f"; NE gap {port['ne_gap']:+.5f} ({port['ne_gap_percent']:+.2f} %) against key {port['nearest_key']} "
                 f"at batch {port['nearest_batch']:,}")  # fmt: skip
    if port.get("old_run_heldout_ne") is not None:
        reached = port["seconds_to_old_ne"]
        text += (f"; its run's NE {port['old_run_heldout_ne']:.4f} after {port['old_run_seconds']:.1f} s of training, "
                 + (f"reached here after {reached:.1f} s" if reached is not None else "not reached here"))  # fmt: skip
    return text


@for_people.register
def _(report: TrainReport, config: Any = None) -> str:
    return (f"trained {report.steps} steps on {report.world_size} processes (global batch "
            f"{report.global_batch_size:,}): {report.rows_trained:,} rows, {report.samples_per_s:,.0f} samples/s; "
            f"NE on days {report.eval_days}: {report.eval_ne:.4f} (before calibration {report.eval_ne_uncalibrated:.4f}; "
            f"calibrator: {report.calibrator}) → {report.out_dir}"
            + (f"\nrun length: {report.run_length}" if report.run_length else ""))  # fmt: skip


@for_people.register
def _(report: NodeReport, config: Any = None) -> str:
    return f"node {report.node_rank} of {report.nnodes} done; node 0 prints the job's summary"


@for_people.register
def _(report: PreprocessReport, config: Any = None) -> str:
    lines = [(f"preprocessing state {report.state_id}: fitted on days {report.train_days} "
             f"({report.train_rows:,} rows, click rate {report.click_rate:.4f})")]  # fmt: skip
    return "\n".join([*lines, *(f"day {day} → {folder}" for day, folder in report.days.items())])


@for_people.register
def _(report: RetuneReport, config: Any = None) -> str:
    if report.best_ne is None:
        return f"study {report.study}: no finished trial yet"
    which = "the configured values" if report.best_trial is not None and report.best_trial < 0 else f"trial #{report.best_trial}"
    lines = [f"study {report.study}: best NE {report.best_ne:.5f} ({which})", *([report.decision] if report.decision else [])]
    for name, value in (report.best_params or {}).items():
        lines.append(f"  --set {name}={value!r}" if isinstance(value, str) else f"  --set {name}={value}")
    return "\n".join(lines)


@for_people.register
def _(report: PlanReport, config: Any = None) -> str:
    return f"{report.text}\n\nplanned in {report.planner_seconds:.1f} s"


@for_people.register
def _(report: EvaluateReport, config: Any = None) -> str:
    values = {"ne": report.ne, "auc": report.auc, "calibration": report.calibration, "log_loss": report.log_loss,
              "ctr": report.ctr, "count": report.count}  # fmt: skip
    return "\n".join(f"{key:<12} {value:.6f}" if key != "count" else f"{key:<12} {value:,.0f}"
                     for key, value in values.items())  # fmt: skip
