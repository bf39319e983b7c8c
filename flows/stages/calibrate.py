"""The calibration stage: the calibrator fitted on the trained model's predictions of the
held-out training rows (flows/run/rows.py chooses them).
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import get_run_logger, task

from evaluation.calibration import Calibrator, served_calibrator
from flows.run.config import PipelineConfig
from flows.stages.features import STAGE
from training.job import CALIBRATION_PART, JobFolder


@task(name="calibrate", **STAGE)
def calibrate_task(config: PipelineConfig, folder: JobFolder) -> Calibrator:
    """The pipeline's calibration stage (`fit_served_calibrator`)."""
    log = get_run_logger()
    return fit_served_calibrator(config.evaluation.calibration, folder, lambda line: log.info("calibration: %s", line))


def fit_served_calibrator(method: str, folder: JobFolder, say: Callable[[str], None]) -> Calibrator:
    """The calibrator of the trained model in `folder`, fitted on its predictions of the
    held-out training rows and written beside them; the identity when calibration is off or
    those rows cannot fit one (`served_calibrator`: the rule the training job also applies
    when it decides to train again on every row). The pipeline and `dlrm train` (node 0)
    both fit it here."""
    if method == "none":
        calibrator = Calibrator()
    else:
        held_out = folder.read_predictions(CALIBRATION_PART)
        calibrator, line = served_calibrator(method, held_out.labels, held_out.predictions)
        say(line)
    folder.write_calibrator(calibrator)
    return calibrator
