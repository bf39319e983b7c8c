"""`dlrm characterize`: measure this hardware with the config's model before training on it.

    sweeps (--sweep KEY=V1,V2 …)  →  series (one setting of the non-batch keys each)
        →  per series, the batch-size sweep (training/characterize/sweep.py), each point a
           real short training job on rows generated to the config's shape
        →  the hardware's batch (the knee of the curve), plots and a table in MLflow

Any config key can be swept (`sharding.compute_kernel`, `model.embedding_dim`,
`preprocess.hash_size`, `model.bottom_mlp`, `training.nproc`, …): each value is applied as a
`--set` override, so it is validated like one. `training.batch_size` among the sweeps gives
the batches to measure instead of the doubling rule.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flows.characterize.sweeps import BATCH_KEY, Series, Sweep
from flows.run.config import ConfigError, PipelineConfig, trainer_cluster
from flows.run.feature_files import prepared_features
from flows.run.ground_truth import ground_truth
from flows.run.reports import CharacterizeReport
from flows.run.rows import training_rows
from ingestion.config import SyntheticConfig
from ingestion.preprocess import apply_state, fit_state
from ingestion.synthetic import generate_day
from ingestion.warehouse import ingest_day
from training.characterize.measure import (
    MeasuredPoint,
    PointResult,
    PointSetup,
    SkippedPoint,
    Windows,
    measure_point,
)
from training.characterize.sweep import BatchRange, batch_sweep, hardware_batch
from training.launch.device import runtime_device
from training.tuning.key import TuningKey, cpu_model_name, tuning_key

# Rows generated for a characterization at most; a larger batch's job reads them again (epochs).
MAX_ROWS = 2_000_000


def batch_range(config: PipelineConfig, sweeps: list[Sweep], first: int | None, last: int | None,
                min_gain: float, patience: int = 2) -> BatchRange:  # fmt: skip
    """The batches: the sweep's list if it names `training.batch_size`, else doublings from
    `first` (default: 256 a process) to `last` (default: 4,096 a process on a CPU, 65,536 on a GPU)."""
    world = config.workers.world_size
    explicit = next((s.values for s in sweeps if s.key == BATCH_KEY), ())
    try:
        batches = tuple(int(value) for value in explicit)
    except ValueError:
        raise ConfigError(f"--sweep {BATCH_KEY}: batch sizes are integers, got {', '.join(explicit)}") from None
    gpu = config.training.device != "cpu" and torch.cuda.is_available()
    first = first or 256 * world
    last = last or (65_536 if gpu else 4_096) * world
    try:
        return BatchRange(first=min(batches, default=first), last=max(batches, default=last), explicit=batches,
                          min_gain=min_gain, patience=patience)  # fmt: skip
    except ValueError as error:
        raise ConfigError(f"characterize: {error}") from None


# -- the rows -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PointRows:
    """The rows a characterization's jobs train on, and the tables they imply."""

    files: tuple[str, ...]
    table_sizes: dict[str, int]
    rows: int
    dense_features: int = 13
    pooling_factors: dict[str, float] = field(default_factory=dict)


def generated_rows(config: PipelineConfig, rows: int, root: Path, on_line: Callable[[str], None]) -> PointRows:
    """One generated day of the config's shape (its generator settings where it has them,
    its preprocessing), reused by every characterization that asks for the same rows."""
    synthetic = replace(config.data.synthetic if config.data.source == "synthetic" else SyntheticConfig(),
                        rows_per_day=rows)  # fmt: skip
    digest = hashlib.sha256(json.dumps([asdict(synthetic), asdict(config.preprocess)], sort_keys=True,
                                       default=str).encode()).hexdigest()[:12]  # fmt: skip
    folder = root / f"rows-{digest}"
    manifest = folder / "rows.json"
    if manifest.is_file():
        known = json.loads(manifest.read_text())
        return PointRows(tuple(known["files"]), known["table_sizes"], known["rows"])
    shutil.rmtree(folder, ignore_errors=True)
    on_line(f"generating {rows:,} rows of '{config.name}''s shape into {folder}")
    generate_day(synthetic, 0, folder / "raw", ground_truth(synthetic))
    ingest_day([str(folder / "raw" / "day_0.tsv.gz")], 0, folder / "warehouse")
    state = fit_state(config.preprocess, folder / "warehouse", folder / "features", (0,))
    written = apply_state(config.preprocess, state, folder / "warehouse", folder / "features", 0)
    files = tuple(str(path) for path in sorted(written.glob("*.parquet")))
    shutil.rmtree(folder / "raw")
    manifest.write_text(json.dumps({"files": files, "table_sizes": state.table_sizes, "rows": rows}))
    return PointRows(files, state.table_sizes, rows)


def own_rows(config: PipelineConfig) -> PointRows:
    """The config's own training features, as an earlier `dlrm run` or `dlrm preprocess`
    left them (its tables, dense features and multi-hot bags: the model it will train), and
    the rows its training trains (`training_rows`: less the calibrator's)."""
    features = prepared_features(config)
    state = features.state
    return PointRows(training_rows(config, features).train_files, state.table_sizes, state.train_rows,
                     len(state.dense), dict(state.multi_hot))  # fmt: skip


# -- the sweep ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesResult:
    label: str
    values: dict[str, str]
    points: list[MeasuredPoint]
    skipped: list[SkippedPoint]
    hardware_batch_size: int | None
    saturated: bool


def characterize_series(series: Series, batches: BatchRange, windows: Windows, out: Path,
                        on_line: Callable[[str], None], own_features: bool = False) -> SeriesResult:  # fmt: skip
    """The batch sweep of one series; each point's checkpoints are removed once it is read
    (its folder keeps the measurements: metrics, profile, plan, logs)."""
    config = series.config
    device = runtime_device(config.training.device, 0)
    rows = own_rows(config) if own_features else generated_rows(
        config, min(MAX_ROWS, windows.rows_needed(batches.last)), out.parent / "rows", on_line)  # fmt: skip

    def measure(batch: int) -> PointResult:
        training = replace(config.training, batch_size=batch)
        setup = PointSetup(values={**series.values, BATCH_KEY: batch}, model=config.model, sharding=config.sharding,
                           training=training, table_sizes=rows.table_sizes, files=rows.files, rows=rows.rows,
                           dense_features=rows.dense_features, pooling_factors=rows.pooling_factors)  # fmt: skip
        folder = out / _slug(series.label) / f"batch-{batch}"
        started = time.perf_counter()
        result = measure_point(setup, windows, folder, device)
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        on_line(_point_line(series.label, result, time.perf_counter() - started))
        return result

    results = list(batch_sweep(measure, batches))
    measured = [r for r in results if isinstance(r, MeasuredPoint)]
    chosen, saturated = hardware_batch(measured, batches.min_gain, batches.patience)
    return SeriesResult(series.label, series.values, measured, [r for r in results if isinstance(r, SkippedPoint)],
                        chosen.batch_size if chosen else None, saturated)  # fmt: skip


def _point_line(label: str, result: PointResult, seconds: float) -> str:
    if isinstance(result, SkippedPoint):
        return f"[{label}] batch {result.batch_size:,}: skipped: {result.reason}"
    parts = ", ".join(f"{k} {v:.2f}" for k, v in result.breakdown_ms.items())
    return (f"[{label}] batch {result.batch_size:,}: {result.samples_per_s:,.0f} samples/s "
            f"(windows {result.samples_per_s_min:,.0f}–{result.samples_per_s_max:,.0f}), step {result.measured_step_ms:.2f} ms "
            f"(planner {result.estimated_step_ms:.2f} ms; {parts}), peak {result.peak_memory_mb:,.0f} MB "
            f"({seconds:.0f} s)")  # fmt: skip


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_=." else "_" for c in text)[:80] or "series"


def hardware_key(config: PipelineConfig, batch: int) -> TuningKey:
    """The tuning key of the config's run at the hardware's batch, as the pipeline keys it
    (the declared trainer hardware, `orchestration.trainer_cluster`, if any: a
    characterization is taken to run on the trainers' kind of host)."""
    return tuning_key(replace(config.training, batch_size=batch), config.workers, trainer_cluster(config))


# -- the whole characterization -----------------------------------------------------------


def point_row(series: str, point: MeasuredPoint) -> dict[str, Any]:
    """One measured point as the report's JSON (`points`) and the MLflow table show it."""
    return {
        **point.values, "series": series, "batch_size": point.batch_size, "samples_per_s": point.samples_per_s,
        "samples_per_s_min": point.samples_per_s_min, "samples_per_s_max": point.samples_per_s_max,
        "spread": round(point.spread, 4), "peak_memory_mb": point.peak_memory_mb,
        "peak_memory_mb_per_rank": point.peak_memory_mb_per_rank, "measured_step_ms": point.measured_step_ms,
        "estimated_step_ms": point.estimated_step_ms, "measured_embedding_ms": round(point.measured_embedding_ms, 4),
        "estimated_vs_measured_embedding": round(point.estimated_step_ms / point.measured_embedding_ms, 4)
        if point.measured_embedding_ms > 0 else None,
        "breakdown_ms": point.breakdown_ms, "profiled_step_ms": point.profiled_step_ms,
        "breakdown_timing": point.breakdown_timing, "device": point.device,
        "world_size": point.world_size,
    }  # fmt: skip


def chosen_series(results: list[SeriesResult]) -> SeriesResult | None:
    """The series whose saturation point trains fastest: its batch is the hardware's."""
    def rate(result: SeriesResult) -> float:
        return next((p.samples_per_s for p in result.points if p.batch_size == result.hardware_batch_size), 0.0)

    candidates = [r for r in results if r.hardware_batch_size is not None]
    return max(candidates, key=rate) if candidates else None


def characterize(all_series: list[Series], sweeps: list[Sweep], *,
                 first_batch: int | None = None, last_batch: int | None = None, min_gain: float = 0.05, patience: int = 2,
                 windows: Windows | None = None, track: bool = True, own_features: bool = False,
                 on_line: Callable[[str], None] = print) -> CharacterizeReport:  # fmt: skip
    """Every series' batch sweep; the hardware batch; MLflow's run with the plots and table
    (`track`). `all_series`: `flows.characterize.sweeps.series_of` the sweeps."""
    started = time.perf_counter()
    base = all_series[0].config
    batches = batch_range(base, sweeps, first_batch, last_batch, min_gain, patience)
    out = base.path("characterize") / time.strftime("%Y%m%d-%H%M%S")
    windows = windows or Windows()
    results = [characterize_series(series, batches, windows, out, on_line, own_features) for series in all_series]
    chosen = chosen_series(results)
    batch = chosen.hardware_batch_size if chosen else None
    key = hardware_key(base, batch or base.training.batch_size)
    report = CharacterizeReport(
        config=base.name, device=_device_name(base), hardware_batch_size=batch,
        saturated=bool(chosen and chosen.saturated), hardware_series=chosen.label if chosen else "",
        points=[point_row(r.label, p) for r in results for p in r.points],
        skipped=[{**s.values, "series": r.label, "batch_size": s.batch_size, "reason": s.reason}
                 for r in results for s in r.skipped],
        series=[{"series": r.label, "values": r.values, "hardware_batch_size": r.hardware_batch_size,
                 "saturated": r.saturated} for r in results],
        tuning_key={"fingerprint": key.fingerprint, **asdict(key)}, min_gain=min_gain, patience=patience,
        seconds=round(time.perf_counter() - started, 1), out_dir=str(out),
    )  # fmt: skip
    if track:
        from flows.tracking.characterization import log_characterization

        report = replace(report, mlflow_run_id=log_characterization(base, report, results, key))
    return report


def _device_name(config: PipelineConfig) -> str:
    device = runtime_device(config.training.device, 0)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model_name()})"
