"""What each `dlrm` command does: read its config once, run, and emit its typed report
(`flows/run/reports.py`) as JSON or for people. Heavy modules are imported by the command that
needs them, so `dlrm --help` and a bad config answer at once; the heaviest with the cyclic
collector paused (training/launch/interpreter.py)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flows.run.reports import for_people
from training.codec import encode
from training.launch.interpreter import imports_without_collection


class UserError(Exception):
    """A problem with the user's input, shown as one line."""


# Errors the user can act on (a bad config, path or file): the command prints their one line,
# and no traceback (matched by class name, so no heavy module loads to check)
USER_FACING_ERRORS = {"UserError", "ConfigError", "PreprocessError", "ShardingError", "MetricError", "FileNotFoundError",
                      "ServerStartError", "EmptyDayError", "HostNetworkError", "SchemaChangeError", "SourceReadError",
                      "IngestError", "DeviceError", "CatchUpError", "StaleChampionError",
                      "SchemaError"}  # fmt: skip


def _prefect_console_quiet() -> None:
    """Prefect's console shows no traceback of an error the command reports in one line."""
    from flows.stages.prefect_defaults import console_without_tracebacks_of

    console_without_tracebacks_of(USER_FACING_ERRORS)


# What a command that runs flows imports once its config has read well: imported while its
# temporary Prefect server starts (`import_while_the_server_starts`)
PIPELINE_MODULES = ("flows.deployments.pipeline", "flows.run.reports")
RETUNE_MODULES = ("flows.tuning.retune", "flows.run.reports")


def import_while_the_server_starts(modules: tuple[str, ...]) -> None:
    """Import `modules` with the collector paused (training/launch/interpreter.py), while the
    command's Prefect server starts beside them (`prefect_api`'s `while_starting`): on 2 cores
    a cold `dlrm run` reached its first flow 2.4 s sooner so (docs/performance.md)."""
    with imports_without_collection():
        for name in modules:
            importlib.import_module(name)


def emit(report: Any, as_json: bool, config: Any = None) -> None:
    """A command's report: one JSON object (`--json`), or text for people."""
    print(json.dumps(encode(report)) if as_json else for_people(report, config), flush=True)


def load(args: argparse.Namespace, extra: list[str] | None = None):
    """The command's config: its file read once, with `--set` (and `extra`) overrides."""
    from flows.run.config import load_config

    return load_config(args.config, [*args.overrides, *(extra or [])])


def run(args: argparse.Namespace) -> int:
    config = load(args)  # fail fast, before Prefect starts (and before the heavy imports)
    from flows.run.sources import raw_sources, resolve_as_of

    if resolve_as_of(config, args.as_of) is None:
        raw_sources(config)  # a recurring run's days are known once its champion is
    with imports_without_collection():
        from flows.stages.local_server import prefect_api

    _prefect_console_quiet()
    with prefect_api(while_starting=lambda: import_while_the_server_starts(PIPELINE_MODULES)):
        from flows.deployments.pipeline import run_pipeline
        from flows.run.reports import run_report

        summary = run_report(run_pipeline(args.config, args.overrides, args.as_of, config))
    emit(summary, args.json, config)
    return 0


def port(args: argparse.Namespace) -> int:
    """`dlrm run` under the port workflow's policy, on the declared trainer hardware if given."""
    args.overrides = [*args.overrides, 'tuning.policy="characterize_then_retune"',
                      *([f"orchestration.trainer_cluster={json.dumps(str(Path(args.cluster).resolve()))}"]
                        if args.cluster else [])]  # fmt: skip
    return run(args)


def backfill(args: argparse.Namespace) -> int:
    """`dlrm run --as-of N` for each day N in order; stops at the first night that fails."""
    from flows.run.sources import complete_days
    from ingestion.days import DayError, parse_day

    config = load(args)
    try:
        first, last = parse_day(args.first), parse_day(args.last)
    except DayError as error:
        raise UserError(f"--from/--to: {error}") from None
    if last < first:
        raise UserError(f"--to {args.last} is before --from {args.first}")
    days = range(first, last + 1)
    if config.data.source != "synthetic":  # nights only for the days that have data
        days = [day for day in complete_days(config) if first <= day <= last]
    with imports_without_collection():
        from flows.stages.local_server import prefect_api

    nights = []
    _prefect_console_quiet()
    with prefect_api(while_starting=lambda: import_while_the_server_starts(PIPELINE_MODULES)):
        from flows.deployments.pipeline import run_pipeline
        from flows.run.reports import BackfillReport, night_line, run_report

        for day in days:
            nights.append(run_report(run_pipeline(args.config, args.overrides, config.data.day_label(day), config)))
            if not args.json:
                print(night_line(nights[-1]), flush=True)
    if args.json:
        emit(BackfillReport(nights), as_json=True)
    return 0


def train(args: argparse.Namespace) -> int:
    from flows.run.feature_files import prepared_features
    from training.launch.host_role import HostRole

    args = _with_slurm_hosts(args, os.environ)
    hosts = []  # the hosts are the config's (orchestration.*); the command line or Slurm may set them
    if args.nnodes is not None:
        hosts.append(f"orchestration.trainer_hosts={args.nnodes}")
        if args.nnodes > 1 and not args.rdzv_endpoint:
            raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    if args.rdzv_endpoint:
        hosts.append(f'orchestration.rdzv_endpoint="{args.rdzv_endpoint}"')
    config = load(args, hosts)
    orchestration = config.orchestration
    role = HostRole(orchestration.trainer_hosts, args.node_rank or 0, orchestration.rdzv_endpoint or "127.0.0.1:29400",
                    args.local_addr, args.socket_ifname, args.join_timeout)  # fmt: skip
    features = prepared_features(config)  # checked before torch and Prefect load
    with imports_without_collection():
        from flows.run.host_training import train_on_this_host
        from training.launch.launcher import TrainingFailed

    try:
        report = train_on_this_host(config, features, role, Path(args.out) if args.out else None)
    except TrainingFailed as failure:
        print(f"dlrm: {failure}", file=sys.stderr)
        return 1
    emit(report, args.json, config)
    return 0


def submit(args: argparse.Namespace) -> int:
    """`dlrm submit`: `dlrm train` as a Slurm batch job (training/launch/slurm_jobs.py)."""
    from flows.run.feature_files import prepared_features
    from flows.run.reports import SubmitReport
    from training.launch.slurm_jobs import BatchRequest, SlurmJobError, cancel, follow, submit, write_script

    config = load(args)
    if args.nodes < 1:
        raise UserError(f"--nodes: at least 1, got {args.nodes}")
    prepared_features(config)  # every node trains on the shared run folder's features: there before submitting
    folder = config.path("slurm")
    dlrm = [sys.executable, "-m", "flows.cli"]  # this installation's, on every node (a shared file system)
    sets = [part for override in args.overrides for part in ("--set", override)]
    command = (*dlrm, "train", "--config", str(Path(args.config).resolve()), *sets, "--json")
    request = BatchRequest(f"dlrm-{config.name}", command, str(Path.cwd()), args.nodes, args.partition, args.time_limit,
                           args.gpus_per_node, tuple(args.sbatch_args))  # fmt: skip
    script = write_script(request, folder)
    try:
        job_id = submit(script)
        report = SubmitReport(job_id, str(script), f"{folder}/{job_id}.out, {folder}/{job_id}-node*.out", "SUBMITTED")
        if not args.wait:
            emit(report, args.json)
            return 0
        print(f"[submit] Slurm job {job_id} submitted ({script}); following it, Ctrl-C cancels it", file=sys.stderr,
              flush=True)  # fmt: skip
        try:
            final = follow(job_id, lambda state: print(f"[submit] job {job_id}: {state.said()}", file=sys.stderr, flush=True))
        except KeyboardInterrupt:
            cancel(job_id)
            print(f"dlrm: stopped: Slurm job {job_id} cancelled (scancel)", file=sys.stderr, flush=True)
            return 130
    except SlurmJobError as error:
        raise UserError(str(error)) from None
    train = _last_json_line(folder / f"{job_id}-node0.out")
    emit(SubmitReport(job_id, str(script), report.logs, final.state, final.exit_code, final.reason, final.restarts,
                      train.get("eval_ne") if train else None, train), args.json)  # fmt: skip
    return 0 if final.state == "COMPLETED" else 1


def _last_json_line(path: Path) -> dict | None:
    """The last line of a log that is a JSON object (node 0's `dlrm train --json` report)."""
    if not path.is_file():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _with_slurm_hosts(args: argparse.Namespace, environ: Mapping[str, str]) -> argparse.Namespace:
    """Inside a Slurm allocation, the hosts it gives (training/launch/slurm.py) where the
    command line names none; flags that disagree with it are one line."""
    from training.launch.slurm import SlurmError, slurm_allocation

    try:
        allocation = slurm_allocation(environ)
    except SlurmError as error:
        raise UserError(str(error)) from None
    if allocation is None:
        return args
    for flag, given, slurm in (("--nnodes", args.nnodes, allocation.nnodes), ("--node-rank", args.node_rank,
                                                                                allocation.node_rank)):  # fmt: skip
        if given is not None and given != slurm:
            raise UserError(f"{flag} {given}, but Slurm job {allocation.job_id} puts this task at {flag} {slurm}: "
                            "inside an allocation leave --nnodes and --node-rank out (they come from Slurm)")  # fmt: skip
    endpoint = args.rdzv_endpoint or (allocation.endpoint if allocation.nnodes > 1 else None)
    print(f"[train] Slurm job {allocation.job_id}: node {allocation.node_rank} of {allocation.nnodes}"
          + (f", rendezvous at {endpoint}" if endpoint else ""), file=sys.stderr, flush=True)  # fmt: skip
    return argparse.Namespace(**{**vars(args), "nnodes": allocation.nnodes, "node_rank": allocation.node_rank,
                                 "rdzv_endpoint": endpoint})  # fmt: skip


def retune(args: argparse.Namespace) -> int:
    from flows.run.sources import raw_sources
    from training.tuning.config import budget_overrides

    config = load(args, budget_overrides(args.trials, args.timeout))
    raw_sources(config)  # fail fast, before Prefect starts
    with imports_without_collection():
        from flows.stages.local_server import prefect_api

    _prefect_console_quiet()
    with prefect_api(while_starting=lambda: import_while_the_server_starts(RETUNE_MODULES)):
        from flows.run.reports import RetuneReport
        from flows.tuning.retune import retune_of
        from training.codec import decode

        result = retune_of(config)
    emit(decode(RetuneReport, result, "the retune's result"), args.json)
    return 0


def serve(args: argparse.Namespace) -> int:
    config = load(args)  # fail fast, before Prefect starts
    if not args.with_server and not os.environ.get("PREFECT_API_URL"):
        raise UserError(
            "dlrm serve needs a Prefect server that stays, for the UI to list its deployments: add "
            f"--with-server, or start one with `dlrm server` and export PREFECT_API_URL=http://127.0.0.1:{args.port}/api"
        )
    with imports_without_collection():
        from flows.deployments.serve import serve_deployments
        from flows.stages.local_server import persistent_server, prefect_api
        from training.launch.processes import raise_if_stopped

    with prefect_api(persistent_server(args.port) if args.with_server else None):
        serve_deployments(config, args.config, args.overrides, args.limit, args.trainer_node)
    raise_if_stopped()  # Prefect's runner ends quietly on Ctrl-C: the exit code still says so
    return 0


def server(args: argparse.Namespace) -> int:
    import time

    if os.environ.get("PREFECT_API_URL"):
        raise UserError(f"PREFECT_API_URL is set ({os.environ['PREFECT_API_URL']}): that server is the dashboard; "
                        "unset it to start one here")  # fmt: skip
    from flows.stages.local_server import persistent_server, prefect_api, server_answers

    with prefect_api(persistent_server(args.port)) as url:
        print(f"Prefect UI: {url.removesuffix('/api')}   (state in {os.environ['PREFECT_HOME']})\n"
              f"In another shell: export PREFECT_API_URL={url}; then dlrm serve, dlrm run, … show here. "
              "Ctrl-C stops the server.", flush=True)  # fmt: skip
        while server_answers(url):
            time.sleep(5)
    raise UserError(f"the Prefect server on {url} stopped answering")


def generate(args: argparse.Namespace) -> int:
    from flows.run.ground_truth import ground_truth
    from ingestion.synthetic import generate_day

    config = load(args)
    out = Path(args.out) if args.out else config.path(config.data.raw_dir)
    truth = ground_truth(config.data.synthetic, config.data.multi_hot)
    for day in args.days if args.days is not None else config.data.all_days:
        stats = generate_day(config.data.synthetic, day, out, truth)
        print(f"day {day}: {stats.rows:,} rows, click rate {stats.click_rate:.3f}, "
              f"Bayes-optimal NE {stats.bayes_ne:.4f} → {out / f'day_{day}.tsv.gz'}")
    return 0


def preprocess(args: argparse.Namespace) -> int:
    from flows.run.reports import PreprocessReport
    from ingestion.days import DayError, parse_day
    from ingestion.preprocess import apply_state, fit_state

    config = load(args)
    data = config.data
    warehouse, features = config.path(data.warehouse_dir), config.path(config.preprocess.features_dir)
    try:
        days = [parse_day(day) for day in args.days] if args.days is not None else list(data.all_days)
    except DayError as error:
        raise UserError(f"--days: {error}") from None
    state = fit_state(config.preprocess, warehouse, features, data.train_days)
    written = {data.day_label(day): str(apply_state(config.preprocess, state, warehouse, features, day)) for day in days}
    emit(PreprocessReport(state.state_id, state.table_sizes, state.train_rows, written,
                          data.shown_days(state.train_days), state.train_click_rate), args.json)  # fmt: skip
    return 0


def plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from flows.run.config import load_cluster
    from flows.run.feature_files import tables_to_plan

    config = load(args)
    cluster = load_cluster(args.cluster) if args.cluster else None
    tables = tables_to_plan(config)  # checked before torch loads
    with imports_without_collection():
        from flows.run.planning import plan_report
        from training.launch.device import runtime_device
        from training.sharding.plan import this_job_cluster

    if cluster is None:
        device = runtime_device(config.training.device, 0)  # as the workers will choose it
        cluster = replace(this_job_cluster(device, config.training.nproc, config.training.nproc), name="this machine")
    emit(plan_report(config, cluster, tables), args.json)
    return 0


def characterize(args: argparse.Namespace) -> int:
    from flows.characterize.sweeps import parse_sweep, series_of
    from flows.run.config import read_toml

    path = Path(args.config)
    raw = read_toml(path)  # the one read: each series' config is built from it
    sweeps = [parse_sweep(text) for text in args.sweeps]
    series = series_of(raw, args.overrides, sweeps, path)  # a bad config or value fails before torch loads
    with imports_without_collection():
        from flows.characterize.measure import characterize as run_characterization

    report = run_characterization(series, sweeps, first_batch=args.first_batch,
                                  last_batch=args.max_batch, min_gain=args.min_gain, patience=args.patience,
                                  track=not args.no_tracking,
                                  own_features=args.own_features,
                                  on_line=lambda line: print(line, file=sys.stderr if args.json else sys.stdout,
                                                             flush=True))  # fmt: skip
    emit(report, args.json)
    return 0


def ingest(args: argparse.Namespace) -> int:
    from flows.run.reports import IngestTotals
    from ingestion.schema import check_multi_hot
    from ingestion.warehouse import day_of, ingest_day
    from ingestion.warehouse import log as ingest_log

    # a failed file is reported below as one "dlrm: error:" line: not also as its log record
    ingest_log.addFilter(lambda record: record.levelno < logging.ERROR)
    _check_ingest_paths(args.sources, args.warehouse)
    try:
        multi_hot = check_multi_hot([name.strip() for name in args.multi_hot.split(",") if name.strip()])
    except ValueError as error:
        raise UserError(f"--multi-hot: {str(error).removeprefix('multi_hot: ')}") from None
    by_day: dict[int, list[str]] = {}
    for index, source in enumerate(args.sources):
        by_day.setdefault(args.day if args.day is not None else day_of(source, index), []).append(source)
    read = written = quarantined = 0
    failed: list[str] = []
    for day, sources in sorted(by_day.items()):
        report = ingest_day(sources, day, Path(args.warehouse), force=args.force, multi_hot=multi_hot,
                            allow_empty=args.allow_empty)  # fmt: skip
        read, written, quarantined = read + report.rows_read, written + report.rows_written, quarantined + report.rows_quarantined
        failed += [f.error for f in report.files_failed]
        if not args.json:
            print(f"day {day}: {report.rows_read:,} read, {report.rows_written:,} written, "
                  f"{report.rows_quarantined:,} quarantined" + (" (unchanged, skipped)" if report.skipped else ""))
    for error in failed:
        print(f"dlrm: error: {error}", file=sys.stderr)
    if args.json:
        emit(IngestTotals(read, written, quarantined, failed, partial=bool(failed)), as_json=True)
    return 1 if failed else 0


def _check_ingest_paths(sources: list[str], warehouse: str) -> None:
    for source in sources:
        if "://" not in source and not Path(source).exists():
            raise UserError(f"{source}: no such file; pass existing Criteo files (plain or .gz)")
        if "://" not in source and Path(source).is_dir():
            raise UserError(f"{source}: a folder; pass Criteo files (plain or .gz), e.g. {source.rstrip('/')}/day_*.gz")
    if Path(warehouse).exists() and not Path(warehouse).is_dir():
        raise UserError(f"--warehouse {warehouse}: a file, not a folder; pass the warehouse folder (created if missing)")


def evaluate(args: argparse.Namespace) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from evaluation.metrics import summarize
    from flows.run.reports import EvaluateReport
    from training.job import JobFolder

    path = Path(args.predictions)
    if not path.exists():
        raise UserError(f"{path}: no such file; pass a Parquet file with label and prediction columns")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as error:
        example = JobFolder(Path("runs/demo/train")).predictions("2")
        raise UserError(f"{path}: not a readable Parquet file or folder ({str(error).splitlines()[0]}); pass the "
                        f"predictions Parquet a run wrote, e.g. {example}/") from None
    missing = {"label", "prediction"} - set(table.column_names)
    if missing:
        raise UserError(f"{path}: missing column(s) {sorted(missing)}; needs label, prediction[, weight]")
    weights = table["weight"].to_numpy() if "weight" in table.column_names else None
    emit(EvaluateReport(**summarize(table["label"].to_numpy(), table["prediction"].to_numpy(), weights)), args.json)
    return 0


def export_delta(args: argparse.Namespace) -> int:
    with imports_without_collection():
        from flows.tracking.model_delta import export_version_delta
        from training.serving.model_delta import DeltaRefused

    config = load(args)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: not empty; pass a new folder for the delta")
    try:
        emit(export_version_delta(config, args.from_version, args.to_version, out), args.json)
    except DeltaRefused as why:
        raise UserError(f"versions {args.from_version} → {args.to_version}: {why}") from None
    return 0
