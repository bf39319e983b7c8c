"""`dlrm train`: this host's part of a run's job, launched here, and the report node 0
prints; and the served calibrator, fitted on the trained model's held-out rows (the pipeline's
calibration stage fits it here too).

Neither Prefect nor MLflow: a host that only trains pays for neither at its start (about 3 s
of imports a `dlrm train`, on every host of every job).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from evaluation.calibration import Calibrator, served_calibrator
from evaluation.metrics import binary_state, compute_calibration, compute_ne
from flows.run.config import PipelineConfig
from flows.run.crosses import with_run_crosses
from flows.run.feature_files import Features
from flows.run.job import build_job
from flows.run.reports import NodeReport, TrainReport
from flows.run.resolve import ResolvedRun, resolve_run
from flows.run.rows import training_rows
from training.job import CALIBRATION_PART, JobFolder, TrainSummary
from training.launch.host_role import HostRole
from training.launch.launcher import launch


def train_on_this_host(config: PipelineConfig, features: Features, role: HostRole, out: Path | None,
                       say: Callable[[str], None] = print) -> TrainReport | NodeReport:  # fmt: skip
    """`dlrm train`: this host's part of the config's job (`orchestration.trainer_hosts`
    hosts, this one `role.node_rank`), on the features the run folder holds
    (`prepared_features`). Node 0 returns the job's report, the others their part's."""
    run = resolve_run(config, state=features.state)
    for line in run.change_lines():
        say(f"[train] {line}")
    features, crossed = with_run_crosses(run, features)  # the pairs the pipeline crosses
    if crossed:
        say(f"[train] {crossed}")
    rows = training_rows(run.config, features)  # the pipeline's rows: less its calibration rows
    job = build_job(run.config, features, rows=rows)
    if out is not None:
        job = dataclasses.replace(job, out_dir=str(out))
    several = role.nnodes > 1
    role = role.resolved() if several else role
    if several:
        say(f"[train] node {role.node_rank} of {role.nnodes}: rendezvous at {role.endpoint}, this host as "
            f"{role.local_addr} on {role.socket_ifname}; writing into {job.out}")  # fmt: skip
    launch(job, on_line=say, role=role if several else None)
    if not role.leads:
        return NodeReport(role.node_rank, role.nnodes, str(job.out))
    # node 0 fits the calibrator the pipeline would, on every host's scores of the same rows
    calibrator = fit_served_calibrator(run.config.evaluation.calibration, job.folder,
                                       lambda line: say(f"[train] calibration: {line}"))  # fmt: skip
    return job_report(run, job.folder.read_summary(), job.folder, calibrator, rows.calibration_rows)


def job_report(run: ResolvedRun, summary: TrainSummary, folder: JobFolder, calibrator: Calibrator,
               calibration_rows: int) -> TrainReport:  # fmt: skip
    """What `dlrm train --json` prints: the job's figures and its NE as `dlrm run` reports it
    (`eval_ne` of the served, calibrated probabilities; `eval_ne_uncalibrated` of the model's)."""
    data = run.config.data
    scores = folder.read_predictions(*(data.day_label(day) for day in data.eval_days))
    served = binary_state(scores.labels, calibrator.apply(scores.predictions))
    return TrainReport(
        world_size=summary.world_size, global_batch_size=summary.global_batch_size, steps=summary.steps,
        rows_trained=summary.rows_trained, samples_per_s=summary.samples_per_s,
        eval_ne=compute_ne(served), eval_ne_uncalibrated=compute_ne(binary_state(scores.labels, scores.predictions)),
        eval_calibration=compute_calibration(served), eval_days=data.shown_days(data.eval_days),
        resumed_from_step=summary.resumed_from_step, device=summary.device, checkpoint=summary.checkpoint,
        out_dir=str(folder.root), calibrator=calibrator.describe(), calibration_rows=calibration_rows,
        epochs_trained=summary.epochs_trained, epochs_kept=summary.epochs_kept, run_length=summary.run_length,
        refit=summary.refit,
    )  # fmt: skip


def fit_served_calibrator(method: str, folder: JobFolder, say: Callable[[str], None]) -> Calibrator:
    """The calibrator of the trained model in `folder`, fitted on its predictions of the
    held-out training rows and written beside them; the identity when calibration is off or
    those rows cannot fit one (`served_calibrator`: the rule the training job also applies
    when it decides to train again on every row). The pipeline and `dlrm train` (node 0)
    both fit it here."""
    if method == "none":
        calibrator = Calibrator()
    elif folder.read_summary().refit:
        # the held-out rows trained the served model (training/worker.py decided so, by this
        # rule or because the regression it kept needs none): a calibrator of them would be fitted
        # on another model's scores
        note = "the served model trained on the held-out rows too: the model's own probabilities are served"
        calibrator = Calibrator(rows=0, note=note)
        say(note)
    else:
        held_out = folder.read_predictions(CALIBRATION_PART)
        calibrator, line = served_calibrator(method, held_out.labels, held_out.predictions)
        say(line)
    folder.write_calibrator(calibrator)
    return calibrator
