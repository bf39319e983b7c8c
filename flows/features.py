"""Raw days to feature files: generate (synthetic source) → ingest → preprocess.

Shared by the `pipeline` and `retune` flows. Each stage skips a day whose inputs did not
change (by its manifest), so a second flow on the same days does no work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.config import PipelineConfig
from flows.sources import raw_sources
from flows.tasks import fit_task, generate_task, ingest_task, preprocess_task
from ingestion.preprocess import PreprocessState


class IngestError(RuntimeError):
    """No readable rows for a day the run needs."""


@dataclass(frozen=True)
class Features:
    state: PreprocessState
    files: dict[int, list[str]]  # day → feature files
    ingest: list[dict[str, Any]]  # one ingest report per day


def prepare_features(config: PipelineConfig) -> Features:
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    sources = raw_sources(config)
    days = list(config.data.all_days)
    if config.data.source == "synthetic":
        generate_task.map(config, days).result()
    ingest = ingest_task.map(config, days, [sources[d] for d in days]).result()
    _require_ingested(ingest)
    state = fit_task(config)
    files = dict(zip(days, preprocess_task.map(config, state, days).result(), strict=True))
    return Features(state, files, ingest)


def _require_ingested(ingest: list[dict[str, Any]]) -> None:
    empty = [r["day"] for r in ingest if r["rows_written"] == 0 and not r["skipped"]]
    if empty:
        errors = "; ".join(e for r in ingest for e in r["files_failed"]) or "no valid rows"
        raise IngestError(f"day(s) {empty} have no ingested rows: {errors}")
