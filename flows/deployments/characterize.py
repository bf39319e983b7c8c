"""The `characterize` flow: `dlrm characterize` from the dashboard (the served
`characterize/characterize` deployment), with the points as a Prefect table artifact."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.characterize.sweeps import parse_sweep, series_of
from flows.run.config import flow_config_path, load_flow_config, read_toml
from flows.stages import heartbeats
from flows.stages.features import run_logger
from flows.stages.stopped_runs import cancel_when_stopped
from training.codec import encode

heartbeats.install()  # this module's flow runs end when their work ends


@flow(name="characterize", log_prints=True, on_crashed=[cancel_when_stopped])
def characterize_flow(config_path: str = "configs/demo.toml", overrides: list[str] | None = None,
                      sweeps: list[str] | None = None, max_batch: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Measure this hardware with the config's model (`dlrm characterize`): the batch-size
    curve, where it saturates, and `sweeps` (`KEY=V1,V2`) as more series."""
    from flows.characterize.measure import characterize

    overrides = list(overrides or [])
    config = load_flow_config(config_path, overrides)  # only configs and data paths a flow may read
    path = flow_config_path(config_path)
    parsed = [parse_sweep(text) for text in sweeps or []]
    log = run_logger("flows.deployments.characterize")
    report = characterize(series_of(read_toml(path), overrides, parsed, path), parsed, last_batch=max_batch,
                          on_line=lambda line: log.info("%s", line))  # fmt: skip
    rows = [{k: v for k, v in p.items() if k not in ("breakdown_ms", "peak_memory_mb_per_rank")} for p in report.points]
    create_table_artifact(key="characterization", table=rows, description=f"Characterization of '{config.name}' "
                          f"on {report.device}: one row per measured point")  # fmt: skip
    chosen = "no point was measured" if report.hardware_batch_size is None else (
        f"**hardware batch: {report.hardware_batch_size:,}** ({'saturation' if report.saturated else 'largest measured'}, "
        f"series {report.hardware_series})")  # fmt: skip
    skipped = "".join(f"\n- skipped [{s['series']}] batch {s['batch_size']:,}: {s['reason']}" for s in report.skipped)
    create_markdown_artifact(key="characterization-summary", markdown=(
        f"## Characterization of '{config.name}' on {report.device}\n\n{chosen}\n\nMLflow run "
        f"`{report.mlflow_run_id}`: characterize/throughput_vs_batch.png, step_breakdown.png, "
        f"planner_vs_measured.png{skipped}\n"))  # fmt: skip
    return encode(report)
