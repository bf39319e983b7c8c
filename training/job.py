"""A training job: what the launcher hands every torchrun worker (`TrainJob`), what the job
reports when done (`TrainSummary`), and every file of its folder (`JobFolder`).

    <out>/job.json                 the job a launch hands its workers (job-node-R.json: one
                                   host's launch of a multi-host job; job-hosts.json: the job the
                                   pipeline hands its trainer hosts)
    <out>/plan.txt, plan.json      the sharding plan, for people and for programs (rank 0)
    <out>/metrics.jsonl            progress records as training goes (rank 0; loop/progress.py)
    <out>/summary.json             the job's report once done (rank 0)
    <out>/profile.json             where a step's time goes and each rank's peak memory
                                   (rank 0; only a job with `profile_steps`)
    <out>/predictions/day=P/       each rank's scores of evaluation part P (rank-R.parquet;
                                   P = "calibration": the rows the calibrator is fitted on)
    <out>/calibrator.json          the calibrator fitted on those scores (node 0, after training)
    <out>/checkpoints/<run id>/    the run's checkpoints (loop/checkpoint.py, launch/resume.py)
    <out>/logs/[node-R/]           torchrun's per-rank logs; failed-node-R.txt: a host's failure
    <out>/pids/rank-R.pid          rank R's process id in the latest launch (for py-spy, gdb, kill)
    <out>/serving/                 the exported model (serving/export.py)

`JobFolder` is the one module that names these files; both sides of torchrun (the
launcher and the flows; the workers) read and write them through it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from evaluation.calibration import Calibrator
from evaluation.config import EvaluationConfig
from evaluation.report import Scores
from ingestion.config import ManagedIdsConfig
from ingestion.count_bins import CountBins
from ingestion.cross_ids import Cross
from training.codec import dumps, loads
from training.config import ModelConfig, ShardingConfig, TrainingConfig, Workers
from training.loop.profile import StepProfile

CALIBRATION_PART = "calibration"


@dataclass(frozen=True)
class TrainJob:
    model: ModelConfig
    sharding: ShardingConfig
    training: TrainingConfig
    evaluation: EvaluationConfig
    table_sizes: dict[str, int]
    train_files: tuple[str, ...]
    # The parts the job scores when done (an evaluation day as the config shows it, or a
    # tuning holdout) → their feature files; each part's predictions: `JobFolder.predictions`.
    eval_files: dict[str, tuple[str, ...]]
    out_dir: str
    # Checkpoints of one run live under out_dir/checkpoints/<run_id>: a relaunch of the same
    # run (torchrun restart, task retry) resumes from them; a new run starts fresh.
    run_id: str = "default"
    # The hosts the job spans, `training.nproc` processes on each.
    hosts: int = 1
    # Start from this checkpoint's weights (any world size), e.g. to warm-start a new run.
    init_checkpoint: str = ""
    # ... and its optimizer state (a recurring run continuing the champion): no fresh
    # Adagrad accumulators, no second warm-up from zero.
    init_optimizer: bool = False
    # Mean ids per example of the multi-hot features (the planner's pooling factors).
    pooling_factors: dict[str, float] = field(default_factory=dict)
    # The dense features the bottom MLP takes (the preprocessing state's; Criteo: 13).
    dense_features: int = 13
    # A fresh model's logit starts at this click rate (the training days'); 0: PyTorch's init.
    initial_click_rate: float = 0.0
    # Training rows held out of training, scored when done (part CALIBRATION_PART) for the
    # calibrator (evaluation/calibration.py); never in the held-out NE during training.
    calibration_files: tuple[str, ...] = ()
    # The rows that choose the run's length when `training.epochs = "auto"`, scored after
    # each epoch (training/loop/validation.py): the calibration rows in a pipeline run, a
    # trial's validation rows in a study. None: the run trains one epoch and says why.
    validation_files: tuple[str, ...] = ()
    # Every training day's files, when the length is chosen on a day the run does not train
    # on (the newest of a dated warehouse, flows/run/rows.py): once it is chosen, a fresh
    # model trains on all of these for that many epochs (`refit_job`). Empty: no refit.
    refit_files: tuple[str, ...] = ()
    # Profile this many last steps (training/loop/profile.py) and write `profile.json`: where
    # a step's time goes, and each rank's peak memory (`dlrm characterize`). 0: none.
    profile_steps: int = 0
    # Stop after this many steps, before the epochs end (a characterization's short job). 0: none.
    max_steps: int = 0
    # Managed-collision ids (`preprocess.categorical_mode = "managed"`): the features hold raw
    # ids and these settings admit and evict them (training/model/managed_ids.py). None: rows.
    managed_ids: ManagedIdsConfig | None = None
    # Pairs of features crossed into tables of their own (ingestion/cross_ids.py), computed by
    # every reader of the job's files; their tables are among `table_sizes`.
    crosses: tuple[Cross, ...] = ()
    # Dense features also cut into bins, one table each (ingestion/count_bins.py), computed
    # alike; their tables are among `table_sizes`, after the crosses'.
    count_bins: tuple[CountBins, ...] = ()

    @property
    def scored_parts(self) -> dict[str, tuple[str, ...]]:
        """Every part the job scores when done: the evaluation parts, then the calibration rows."""
        return {**self.eval_files, **({CALIBRATION_PART: self.calibration_files} if self.calibration_files else {})}

    @property
    def starts_at_regression(self) -> bool:
        """A fresh wide model's own weights start as the fitted logistic regression
        (`model.wide_start`): not a run that continues a model, nor managed ids (their rows
        are admitted ids, not the regression's hashed ones)."""
        return (self.model.wide_start == "logistic_regression" and not self.init_checkpoint
                and self.managed_ids is None)  # fmt: skip

    @property
    def chooses_epochs(self) -> bool:
        """The run chooses its length: `training.epochs = "auto"` and rows to choose on."""
        return self.training.chooses_epochs and bool(self.validation_files)

    @property
    def most_epochs(self) -> int:
        """The epochs the run trains at most (one when it should choose but has no rows to)."""
        if self.training.chooses_epochs:
            return self.training.max_epochs if self.validation_files else 1
        return int(self.training.epochs)

    def refit_job(self, epochs: int) -> TrainJob:
        """The job that trains a fresh model on every training day (`refit_files`) for the
        `epochs` the validation chose: in its own folder under this one (its checkpoints,
        metrics and logs), scoring nothing itself."""
        training = dataclasses.replace(self.training, epochs=epochs)
        return dataclasses.replace(self, training=training, train_files=self.refit_files, validation_files=(),
                                   calibration_files=(), refit_files=(), init_checkpoint="", init_optimizer=False,
                                   out_dir=str(self.out / "refit"))  # fmt: skip

    @property
    def workers(self) -> Workers:
        return Workers(self.training.nproc, self.hosts)

    @property
    def folder(self) -> JobFolder:
        return JobFolder(Path(self.out_dir))

    @property
    def out(self) -> Path:
        return Path(self.out_dir)

    @property
    def checkpoint_root(self) -> Path:
        return self.folder.checkpoints(self.run_id)

    def save(self, path: Path) -> None:
        path.write_text(dumps(self, indent=2))

    @classmethod
    def load(cls, path: Path) -> TrainJob:
        return loads(cls, Path(path).read_text(), str(path))


@dataclass(frozen=True)
class TrainSummary:
    """What a finished job reports (rank 0 writes it, the flows read it, every field checked)."""

    steps: int  # the step training ended at (counting steps before a resume)
    samples: int  # samples trained by this launch after its first step (the timed ones)
    seconds: float  # their training time (first step, evaluations and checkpoints excluded)
    samples_per_s: float  # samples / seconds: this launch's training throughput
    first_step_seconds: float  # compilation, allocation and cache warm-up happen here
    compiled: bool  # training.compile: the dense parts ran as compiled graphs
    precision: str  # "fp32" or "bf16": what `training.precision` (e.g. "auto") resolved to here
    cpu: dict[str, str]  # which CPU kernel computed what (e.g. "interaction": "native"); empty on GPUs
    rows_trained: int  # by all ranks over the whole run, resumes included
    rows_fingerprint: int  # Σ of the trained rows' hashes mod 2**64: which rows, in any order
    resumed_from_step: int  # the checkpoint step this launch started from (0: a fresh start)
    world_size: int  # training processes
    global_batch_size: int  # the batch one step trains, over every rank
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    pipeline: str  # how steps ran: "plain" or "sparse_dist" (TorchRec's TrainPipelineSparseDist)
    checkpoint: str  # the final checkpoint's folder
    checkpoint_bytes: int = field(default=0, kw_only=True)  # what it holds on disk (every rank's files)
    eval_rows_rank0: int  # evaluation rows rank 0 scored into predictions/
    # managed ids (training/loop/admission.py): this launch's admission rounds, the rows they
    # restarted for new ids, and the ids with a row of their own at the end (0: not managed)
    managed_rounds: int = 0
    managed_restarted_rows: int = 0
    managed_resident_ids: int = 0
    # ... the ids those rounds admitted, how many of them had been evicted earlier in the launch,
    # the most distinct ids one feature saw, and the advice when the tables churn ("": they do not)
    managed_admitted_ids: int = 0
    managed_returned_ids: int = 0
    managed_live_ids: int = 0
    managed_churn: str = ""
    # a run that chose its length (`training.epochs = "auto"`): the epochs it trained, the
    # epochs of the model it kept (0: the model it started from), the validation NE after
    # each epoch (by epochs trained; None where it was undefined), and why, for people
    epochs_trained: int = 0
    epochs_kept: int = 0
    validation_ne: dict[str, float | None] = field(default_factory=dict)
    validation_rows: int = 0  # the held-out rows those NEs are of
    run_length: str = ""
    # ... and trained a fresh model on every training day for the epochs kept (the figures
    # above, steps and rows, are then that model's)
    refit: bool = False


@dataclass(frozen=True)
class JobFolder:
    """Every file of a job's output folder (see the module): paths, reads and writes."""

    root: Path

    def job_file(self, node_rank: int | None = None) -> Path:
        """The job one launch hands its workers: this host's, or (None) a single host's."""
        return self.root / ("job.json" if node_rank is None else f"job-node-{node_rank}.json")

    @property
    def hosts_job_file(self) -> Path:
        """The job the pipeline's training stage hands every trainer host."""
        return self.root / "job-hosts.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.root / "summary.json"

    @property
    def plan_files(self) -> tuple[Path, Path]:
        """The plan for people (text) and for programs (JSON rows)."""
        return self.root / "plan.txt", self.root / "plan.json"

    @property
    def serving(self) -> Path:
        return self.root / "serving"

    def checkpoints(self, run_id: str) -> Path:
        return self.root / "checkpoints" / run_id

    def logs(self, node_rank: int | None = None) -> Path:
        """torchrun's per-rank logs; each host of a multi-host job its own folder."""
        return self.root / "logs" / f"node-{node_rank}" if node_rank is not None else self.root / "logs"

    def pid_file(self, rank: int) -> Path:
        return self.root / "pids" / f"rank-{rank}.pid"

    def write_pid(self, rank: int, pid: int) -> None:
        """Written whole, at a rank's start: under torchrun or warm ranks alike, the one way to
        tell which process is which rank (a forked warm rank's command line is its server's)."""
        self.pid_file(rank).parent.mkdir(parents=True, exist_ok=True)
        _write_whole(self.pid_file(rank), f"{pid}\n")

    def read_pid(self, rank: int) -> int | None:
        """Rank `rank`'s process id in the latest launch, or None before it has started."""
        try:
            return int(self.pid_file(rank).read_text())
        except (OSError, ValueError):
            return None

    def rank_pids(self) -> dict[int, int]:
        """Every started rank's process id in the latest launch, by rank."""
        ranks = sorted(int(path.stem.removeprefix("rank-")) for path in self.pid_file(0).parent.glob("rank-*.pid"))
        return {rank: pid for rank in ranks if (pid := self.read_pid(rank)) is not None}

    # -- the summary, the plan ------------------------------------------------------------

    def write_summary(self, summary: TrainSummary) -> None:
        """Written whole: a reader never sees half of it."""
        _write_whole(self.summary_file, dumps(summary, indent=2) + "\n")

    def read_summary(self) -> TrainSummary:
        """The summary; `SchemaError` names any field missing or of the wrong type."""
        return loads(TrainSummary, self.summary_file.read_text(), str(self.summary_file))

    @property
    def profile_file(self) -> Path:
        return self.root / "profile.json"

    def write_profile(self, profile: StepProfile) -> None:
        self.profile_file.write_text(dumps(profile, indent=2) + "\n")

    def read_profile(self) -> StepProfile | None:
        """The step profile (None: the job profiled no steps)."""
        if not self.profile_file.is_file():
            return None
        return loads(StepProfile, self.profile_file.read_text(), str(self.profile_file))

    def write_plan(self, text: str, rows: list[dict[str, Any]]) -> None:
        text_file, json_file = self.plan_files
        text_file.write_text(text + "\n")
        json_file.write_text(json.dumps(rows, indent=2))

    def read_plan(self) -> list[dict[str, Any]]:
        """The plan's rows (table, sharding_type, compute_kernel, ranks, bytes_per_rank); none
        when the job wrote no plan."""
        json_file = self.plan_files[1]
        return json.loads(json_file.read_text()) if json_file.is_file() else []

    @property
    def calibrator_file(self) -> Path:
        return self.root / "calibrator.json"

    def write_calibrator(self, calibrator: Calibrator) -> None:
        self.calibrator_file.write_text(json.dumps(calibrator.as_dict(), indent=2) + "\n")

    def read_calibrator(self) -> Calibrator:
        """The job's calibrator (the identity when none was fitted)."""
        if not self.calibrator_file.is_file():
            return Calibrator()
        return Calibrator.from_dict(json.loads(self.calibrator_file.read_text()))

    # -- predictions ----------------------------------------------------------------------

    def predictions(self, part: str) -> Path:
        return self.root / "predictions" / f"day={part}"

    def write_predictions(self, part: str, rank: int, labels: np.ndarray, predictions: np.ndarray,
                          slices: np.ndarray) -> int:  # fmt: skip
        """One rank's scores of one part: label, prediction, and the row's slice value."""
        table = pa.table({"label": labels.astype(np.int8), "prediction": predictions,
                          "slice": slices.astype(np.int32)})  # fmt: skip
        path = self.predictions(part) / f"rank-{rank:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        return table.num_rows

    def read_predictions(self, *parts: str) -> Scores:
        """Every rank's scores of the parts, in part and rank order (all parts: none named)."""
        folders = [self.predictions(part) for part in parts] or sorted((self.root / "predictions").glob("day=*"))
        files = [file for folder in folders for file in sorted(folder.glob("*.parquet"))]
        table = pq.read_table(files, partitioning=None)
        return Scores(table["label"].to_numpy(), table["prediction"].to_numpy(), table["slice"].to_numpy())

    # -- a launch's housekeeping ----------------------------------------------------------

    def clear_for_launch(self, node_rank: int | None, leads: bool, fresh: bool) -> None:
        """Remove what an earlier launch left that this one rewrites: this host's logs; on
        the leading host also the predictions and the summary, and the metrics of a run
        that starts afresh (`fresh`: no checkpoint to resume; its records are another
        run's). Checkpoints stay: a relaunch resumes from them."""
        stale = [self.logs(node_rank)]
        if leads:
            stale += [self.root / "predictions", self.root / "pids", self.summary_file, self.profile_file] + \
                ([self.metrics] if fresh else [])  # fmt: skip
        for path in stale:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    # A host whose part of the job fails leaves a mark in the shared run folder: the other
    # hosts' workers would otherwise wait for it in a collective until their timeout
    # (torchrun's static rendezvous tells no host of another's failure). Each host clears its
    # own mark before it launches, and heeds the others' only once the rendezvous has
    # completed, that is once every host has launched (and cleared its own earlier mark).
    def failure_mark(self, node_rank: int) -> Path:
        return self.logs() / f"failed-node-{node_rank}.txt"

    def record_failure(self, node_rank: int, message: str) -> None:
        self.logs().mkdir(parents=True, exist_ok=True)
        self.failure_mark(node_rank).write_text(message)

    def clear_failure(self, node_rank: int) -> None:
        self.failure_mark(node_rank).unlink(missing_ok=True)

    def peer_failure(self, node_rank: int, nnodes: int) -> str | None:
        """Another host's failure, in its words (None while every other host runs)."""
        for node in range(nnodes):
            mark = self.failure_mark(node)
            if node != node_rank and mark.is_file():
                return f"node {node}: {mark.read_text(errors='replace').strip()}"
        return None


def _write_whole(path: Path, text: str) -> None:
    """`text` into `path` by a rename: a reader sees the old file or the new one, never half."""
    staged = path.with_name(path.name + ".staged")
    staged.write_text(text)
    staged.replace(path)
