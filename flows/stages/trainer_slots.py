"""Training jobs take turns on the trainers: a Prefect global concurrency limit held by the
pipeline's training stage and by each retune trial while their torchrun runs.

A retrain under `scale_and_schedule` creates a retune flow run at once; without a limit
the retune's trials would start on the same cores while the retrain still trains, and
both would slow to a crawl (and time their steps wrongly). With it, the retune waits for
the retrain's training to end, then its trials take the slot one at a time, so a
retrain started meanwhile waits at most one trial.

A slot is a lease that its holder renews while it trains (`orchestration.trainer_slot_lease_s`):
when the holder is gone without giving it back (SIGKILL, a lost host, a cancelled Slurm job,
a Ctrl-C that cut the release short), the Prefect server revokes the lease once it expires,
so no later training waits for a slot that nobody holds. A renewal that fails (the server
restarting) does not stop the training that holds the slot: the worst it costs is a second
job on the trainers, where stopping would lose the first one's work.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import httpx
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists

from flows.run.config import PipelineConfig

LIMIT_NAME = "dlrm-training"


def waits_for(config: PipelineConfig) -> str:
    """How a job of this config waits for the trainers, for a person to read."""
    slots = config.orchestration.trainer_slots
    if slots == 0:
        return "it starts at once (orchestration.trainer_slots = 0)"
    return (f"it trains when a slot of the '{LIMIT_NAME}' concurrency limit ({slots} at once) is free, "
            "that is after this run's training")  # fmt: skip


@contextlib.contextmanager
def trainer_slot(config: PipelineConfig, log: logging.Logger | logging.LoggerAdapter) -> Iterator[None]:
    """Hold one slot of the trainers for the block (nothing with `trainer_slots` = 0)."""
    slots = config.orchestration.trainer_slots
    if slots == 0:
        yield
        return
    _ensure_limit(slots)
    log.info("waiting for a free trainer slot ('%s' concurrency limit, %d at once)", LIMIT_NAME, slots)
    with concurrency(LIMIT_NAME, occupy=1, strict=True, lease_duration=config.orchestration.trainer_slot_lease_s,
                     raise_on_lease_renewal_failure=False):  # fmt: skip
        yield


def _ensure_limit(slots: int) -> None:
    """Create (or resize) the limit. Prefect's upsert reads, then creates: two jobs starting
    together may both create, and the second is refused (a conflict, ObjectAlreadyExists);
    it then finds the first's."""
    with get_client(sync_client=True) as client:
        for attempt in range(3):
            try:
                client.upsert_global_concurrency_limit_by_name(LIMIT_NAME, slots)
                return
            except (httpx.HTTPStatusError, ObjectAlreadyExists):
                if attempt == 2:
                    raise
