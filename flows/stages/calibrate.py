"""The calibration stage: the calibrator fitted on the trained model's predictions of the
held-out training rows (flows/run/rows.py chooses them).
"""

from __future__ import annotations

from prefect import get_run_logger, task

from evaluation.calibration import Calibrator
from flows.run.config import PipelineConfig
from flows.run.host_training import fit_served_calibrator
from flows.stages.features import STAGE
from training.job import JobFolder


@task(name="calibrate", **STAGE)
def calibrate_task(config: PipelineConfig, folder: JobFolder) -> Calibrator:
    """The pipeline's calibration stage (`fit_served_calibrator`)."""
    log = get_run_logger()
    return fit_served_calibrator(config.evaluation.calibration, folder, lambda line: log.info("calibration: %s", line))
