"""The `dlrm` command.

    dlrm run --config configs/demo.toml [--set section.key=value ...]
    dlrm retune --config FILE [--trials N] [--timeout S] [--json]
    dlrm serve --config FILE [--limit N] [--with-server [--port 4200]]
    dlrm server [--port 4200]
    dlrm generate --config FILE [--days 0 1 2]
    dlrm ingest SOURCE... --warehouse DIR [--day N] [--multi-hot C3,C12] [--allow-empty] [--json]
    dlrm preprocess --config FILE [--days 0 1 2] [--json]
    dlrm plan --config FILE [--cluster CLUSTER.toml] [--json]
    dlrm evaluate --predictions FILE.parquet [--json]

A problem the user can fix (a bad config, a missing file) ends with one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evaluation.promotion import reference_line
from flows.prefect_defaults import DASHBOARD_PORT, apply_prefect_defaults
from training.processes import Stopped, raise_if_stopped, stop_on_signals

DEFAULT_CONFIG = "configs/demo.toml"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Each checkout's Prefect state is its own (deployments, runs, the local server's database):
# with the shared ~/.prefect, two checkouts' `dlrm serve` would pick up each other's runs.
os.environ.setdefault("PREFECT_HOME", str(PROJECT_ROOT / ".prefect"))
# Our packages log through the standard library; Prefect shows those records in the UI too.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "ingestion,training,evaluation,flows")
apply_prefect_defaults()
# Prefect keeps its local server's database in PREFECT_HOME but does not create the folder.
Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)


class UserError(Exception):
    """A problem with the user's input, shown as one line."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) == DEFAULT_CONFIG and not Path(DEFAULT_CONFIG).exists():
        args.config = str(PROJECT_ROOT / DEFAULT_CONFIG)  # the embedded default, from any folder
    if getattr(args, "config", None):
        _trust_config_folder(args.config)
        _trust_override_paths(getattr(args, "overrides", []))
    try:
        with stop_on_signals(_say):
            return args.handler(args)
    except Stopped as stopped:
        # every started process is ended and the runs are marked; one line, no traceback
        print(f"dlrm: stopped by {stopped}", file=sys.stderr)
        return stopped.exit_code
    except UserError as error:
        print(f"dlrm: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if _is_user_facing(error):
            print(f"dlrm: error: {error}", file=sys.stderr)
            return 2
        raise


def _say(line: str) -> None:
    print(f"dlrm: {line}", file=sys.stderr, flush=True)


def _trust_config_folder(config: str) -> None:
    """A config named on this command line may be read by the flows it starts here."""
    folder = str(Path(config).expanduser().resolve().parent)
    known = os.environ.get("DLRM_CONFIG_DIRS", "")
    os.environ["DLRM_CONFIG_DIRS"] = os.pathsep.join(filter(None, [known, folder]))


def _trust_override_paths(overrides: list[str]) -> None:
    """Paths set with --set here are the user's own choice: the flows may use them."""
    folders = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip() in {"run_dir", "data.raw_dir", "data.warehouse_dir", "preprocess.features_dir", "data.path"}:
            folders.append(str(Path(value.strip().strip("'\"")).expanduser().resolve()))
        elif key.strip() == "data.files":
            folders.append("/")  # files named on the command line: the user's own
    if folders:
        known = os.environ.get("DLRM_DATA_DIRS", "")
        os.environ["DLRM_DATA_DIRS"] = os.pathsep.join(filter(None, [known, *folders]))


def _is_user_facing(error: Exception) -> bool:
    """Errors the user can act on; matched by class name so no heavy module loads to check."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"ConfigError", "PreprocessError", "ShardingError", "MetricError", "FileNotFoundError",
                         "ServerStartError", "EmptyDayError", "HostNetworkError",
                         "SchemaChangeError", "SourceReadError"})  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlrm", description="End-to-end DLRM training pipeline")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the whole pipeline as a Prefect flow")
    _add_config_arguments(run)
    run.add_argument("--as-of", metavar="DAY", help="recurring run: today's data is DAY (or 'newest', the newest "
                     "complete day): continue the champion on the days before it that it has not seen, "
                     "judge on DAY")  # fmt: skip
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    run.set_defaults(handler=_run)

    backfill = commands.add_parser("backfill", help="recurring runs as of each day from --from to --to, in order")
    _add_config_arguments(backfill)
    backfill.add_argument("--from", dest="first", required=True, metavar="DAY",
                          help="the first night's day (an integer, or an ISO date for a dated warehouse)")
    backfill.add_argument("--to", dest="last", required=True, metavar="DAY", help="the last night's day")
    backfill.add_argument("--json", action="store_true", help="print the nights' summaries as one JSON object")
    backfill.set_defaults(handler=_backfill)

    train = commands.add_parser("train", help="only the training stage, on the features the run folder holds; "
                                "one command per host for a multi-host job")  # fmt: skip
    _add_config_arguments(train)
    train.add_argument("--out", metavar="FOLDER", help="where the job writes (default: <run_dir>/train); "
                       "on several hosts, the same shared folder on each")  # fmt: skip
    train.add_argument("--nnodes", type=int, default=1, help="hosts in the job (default: %(default)s)")
    train.add_argument("--node-rank", type=int, default=0, help="this host's rank, 0..nnodes-1; node 0 hosts the "
                       "rendezvous and prints the summary (default: %(default)s)")  # fmt: skip
    train.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and a free port (with --nnodes > 1)")
    train.add_argument("--local-addr", default="", metavar="ADDRESS",
                       help="the address this host advertises (default: the one that routes to the endpoint)")
    train.add_argument("--socket-ifname", default="", metavar="INTERFACE",
                       help="the interface gloo/NCCL use (default: the one holding that address)")
    train.add_argument("--join-timeout", type=int, default=300, metavar="SECONDS",
                       help="how long a host waits for the others (default: %(default)s)")
    train.add_argument("--json", action="store_true", help="print the report as one JSON object")
    train.set_defaults(handler=_train)

    retune = commands.add_parser("retune", help="tune hyperparameters for the config's tuning key (Optuna)")
    _add_config_arguments(retune)
    retune.add_argument("--trials", type=int, help="trial budget of the study (default: tuning.n_trials)")
    retune.add_argument("--timeout", type=float, help="wall-clock budget of this worker in seconds")
    retune.add_argument("--json", action="store_true", help="print the result as one JSON object")
    retune.set_defaults(handler=_retune)

    serve = commands.add_parser("serve", help="register and serve the nightly, retrain and retune deployments")
    _add_config_arguments(serve)
    serve.add_argument("--limit", type=int, help="most flow runs at once (default: no limit)")
    serve.add_argument("--with-server", action="store_true",
                       help="also start the Prefect server with its UI here (else PREFECT_API_URL names one)")
    serve.add_argument("--port", type=int, default=DASHBOARD_PORT, help="the UI's port with --with-server (default: %(default)s)")
    serve.add_argument("--trainer-node", type=int, metavar="R", help="serve only node R's part of multi-host "
                       "training (orchestration.trainer_hosts > 1), on that host")  # fmt: skip
    serve.set_defaults(handler=_serve)

    server = commands.add_parser("server", help="the Prefect server with its UI (the dashboard), until Ctrl-C")
    server.add_argument("--port", type=int, default=DASHBOARD_PORT, help="the UI's port (default: %(default)s)")
    server.set_defaults(handler=_server)

    generate = commands.add_parser("generate", help="write Criteo-format days of synthetic data")
    _add_config_arguments(generate)
    generate.add_argument("--days", type=int, nargs="*", help="days to write (default: the config's)")
    generate.add_argument("--out", help="output folder (default: the config's raw_dir)")
    generate.set_defaults(handler=_generate)

    ingest = commands.add_parser("ingest", help="raw Criteo files → validated Parquet warehouse")
    ingest.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="Criteo TSV files, plain or gzip, local paths or fsspec URLs")
    ingest.add_argument("--warehouse", required=True, metavar="FOLDER",
                        help="the warehouse folder (created if missing); each day lands in FOLDER/day=N/")
    ingest.add_argument("--day", type=int, help="the day of every SOURCE (default: day_N in the name)")
    ingest.add_argument("--force", action="store_true", help="re-ingest even if the manifest matches")
    ingest.add_argument("--allow-empty", action="store_true",
                        help="publish a day whose sources hold no lines (default: refuse it, exit 2)")
    ingest.add_argument("--multi-hot", default="", metavar="C3,C12",
                        help="features whose field holds comma-separated ids (stored as lists)")
    ingest.add_argument("--json", action="store_true", help="print the day totals as one JSON object")
    ingest.set_defaults(handler=_ingest)

    preprocess = commands.add_parser("preprocess", help="warehouse days → features (DuckDB), fitted on the train days")
    _add_config_arguments(preprocess)
    preprocess.add_argument("--days", nargs="*", help="days to write (default: the config's): integers, or dates")
    preprocess.add_argument("--json", action="store_true", help="print the state and the written days as JSON")
    preprocess.set_defaults(handler=_preprocess)

    plan = commands.add_parser("plan", help="plan the sharding of a model for a cluster, here or declared")
    _add_config_arguments(plan)
    plan.add_argument("--cluster", help="cluster TOML (default: this machine with training.nproc processes)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.set_defaults(handler=_plan)

    evaluate = commands.add_parser("evaluate", help="NE, AUC, calibration of a predictions file")
    evaluate.add_argument("--predictions", required=True, help="Parquet with label, prediction[, weight]")
    evaluate.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    evaluate.set_defaults(handler=_evaluate)
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and repeatable --set overrides, the same for every command that reads a config."""
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="TOML config (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.batch_size=4096")  # fmt: skip


def _retune(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.sources import raw_sources

    raw_sources(load_config(args.config, args.overrides))  # fail fast, before Prefect starts
    from flows.local_server import prefect_api
    from flows.retune import retune

    with prefect_api():
        result = retune(config_path=args.config, overrides=args.overrides, n_trials=args.trials,
                        timeout_s=args.timeout)  # fmt: skip
    if args.json:
        print(json.dumps(result))
    elif result["best_ne"] is None:
        print(f"study {result['study']}: no finished trial yet")
    else:
        print(f"study {result['study']}: best NE {result['best_ne']:.5f} (trial #{result['best_trial']})")
        for name, value in result["best_params"].items():
            print(f"  --set {name}={value!r}" if isinstance(value, str) else f"  --set {name}={value}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from flows.config import load_config

    load_config(args.config, args.overrides)  # fail fast, before Prefect starts
    if not args.with_server and not os.environ.get("PREFECT_API_URL"):
        raise UserError(
            "dlrm serve needs a Prefect server that stays, for the UI to list its deployments: add "
            f"--with-server, or start one with `dlrm server` and export PREFECT_API_URL=http://127.0.0.1:{args.port}/api"
        )
    from flows.local_server import persistent_server, prefect_api
    from flows.serve import serve_deployments

    with prefect_api(persistent_server(args.port) if args.with_server else None):
        serve_deployments(args.config, args.overrides, args.limit, args.trainer_node)
    raise_if_stopped()  # Prefect's runner ends quietly on Ctrl-C: the exit code still says so
    return 0


def _server(args: argparse.Namespace) -> int:
    import time

    if os.environ.get("PREFECT_API_URL"):
        raise UserError(f"PREFECT_API_URL is set ({os.environ['PREFECT_API_URL']}): that server is the dashboard; "
                        "unset it to start one here")  # fmt: skip
    from flows.local_server import persistent_server, prefect_api, server_answers

    with prefect_api(persistent_server(args.port)) as url:
        print(f"Prefect UI: {url.removesuffix('/api')}   (state in {os.environ['PREFECT_HOME']})\n"
              f"In another shell: export PREFECT_API_URL={url}; then dlrm serve, dlrm run, … show here. "
              "Ctrl-C stops the server.", flush=True)  # fmt: skip
        while server_answers(url):
            time.sleep(5)
    raise UserError(f"the Prefect server on {url} stopped answering")


def _train(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.host_training import train_on_this_host
    from training.hosts import HostRole
    from training.launcher import TrainingFailed

    config = load_config(args.config, args.overrides)
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    role = HostRole(args.nnodes, args.node_rank, args.rdzv_endpoint or "127.0.0.1:29400", args.local_addr,
                    args.socket_ifname, args.join_timeout)  # fmt: skip
    try:
        report = train_on_this_host(config, role, Path(args.out) if args.out else None)
    except TrainingFailed as failure:
        print(f"dlrm: {failure}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
    elif "eval_ne" in report:
        print(f"trained {report['steps']} steps on {report['world_size']} processes (global batch "
              f"{report['global_batch_size']:,}): {report['rows_trained']:,} rows, {report['samples_per_s']:,.0f} "
              f"samples/s; NE on days {report['eval_days']}: {report['eval_ne']:.4f} → {report['out_dir']}")  # fmt: skip
    else:
        print(f"node {report['node_rank']} of {report['nnodes']} done; node 0 prints the job's summary")
    return 0


def _run(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.recurring import resolve_as_of
    from flows.sources import raw_sources
    from flows.tasks import refuse_hosts_in_torchrun_args

    config = load_config(args.config, args.overrides)  # fail fast, before Prefect starts
    if resolve_as_of(config, args.as_of) is None:
        raw_sources(config)  # a recurring run's days are known once its champion is
    refuse_hosts_in_torchrun_args(config)
    from flows.local_server import prefect_api
    from flows.pipeline import run_pipeline

    with prefect_api():
        summary = run_pipeline(args.config, args.overrides, args.as_of)
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary, config))
    return 0


def _backfill(args: argparse.Namespace) -> int:
    """`dlrm run --as-of N` for each day N in order; stops at the first night that fails."""
    from flows.config import load_config
    from flows.sources import complete_days
    from flows.tasks import refuse_hosts_in_torchrun_args
    from ingestion.days import DayError, parse_day

    config = load_config(args.config, args.overrides)
    refuse_hosts_in_torchrun_args(config)
    try:
        first, last = parse_day(args.first), parse_day(args.last)
    except DayError as error:
        raise UserError(f"--from/--to: {error}") from None
    if last < first:
        raise UserError(f"--to {args.last} is before --from {args.first}")
    days = range(first, last + 1)
    if config.data.source != "synthetic":  # nights only for the days that have data
        days = [day for day in complete_days(config) if first <= day <= last]
    from flows.local_server import prefect_api
    from flows.pipeline import run_pipeline

    nights = []
    with prefect_api():
        for day in days:
            summary = run_pipeline(args.config, args.overrides, str(config.data.shown(day)))
            nights.append(summary)
            if not args.json:
                print(night_line(summary), flush=True)
    if args.json:
        print(json.dumps({"nights": nights}))
    return 0


def night_line(summary: dict[str, Any]) -> str:
    """One line per night of a backfill."""
    if summary.get("skipped"):
        return f"as of day {summary['as_of']}: skipped: {summary['skip_reason']}"
    start = f"from version {summary['warm_start_version']}" if summary["warm_start_version"] else "from scratch"
    return (f"as of day {summary['as_of']}: trained days {summary['days_trained']} {start} "
            f"({summary['rows_trained']:,} rows), NE {summary['eval_ne']:.4f}, version {summary['model_version']} "
            f"{'promoted' if summary['promoted'] else 'not promoted'}")  # fmt: skip


def format_summary(summary: dict[str, Any], config) -> str:
    if summary.get("skipped"):
        return "\n" + night_line(summary) + f"\n  champion             version {summary['champion_version']}, lineage days {summary['lineage_days']}"
    run_dir = Path(config.run_dir).resolve()
    ne = summary["eval_ne"]

    def reference(name: str, label: str) -> str:
        if f"{name}_ne" not in summary:
            return ""
        # no "% better" against a reference that is itself no better than the constant
        constant = summary.get("baseline_constant_ne") if name != "baseline_constant" else None
        return "  " + reference_line(label, ne, summary[f"{name}_ne"], constant) + "\n"

    bayes = (
        f"  Bayes-optimal NE     {summary['bayes_ne']:.4f}   (the best reachable; the model is "
        f"{-summary['ne_gain_vs_bayes_pct']:.1f} % above it)\n"
        if "bayes_ne" in summary else ""
    )
    champion = summary.get("champion_ne_same_days")
    lines = [
        "",
        f"DLRM pipeline '{config.name}' finished",
        f"  rows ingested        {summary['rows_ingested']:,}  (quarantined: {summary['rows_quarantined']:,})",
        (f"  held-out days        {summary.get('eval_days') or list(config.data.eval_days)}  "
         f"({int(summary['eval_count']):,} examples)"),
        *([f"  lineage              trained days {summary['days_trained']} "
           + (f"from version {summary['warm_start_version']}" if summary["warm_start_version"] else "from scratch")
           + f"; the model has seen days {summary['lineage_days']}"] if summary.get("as_of") is not None else []),
        f"  NE                   {ne:.4f}",
        (bayes + reference("logistic_regression", "logistic regression")
         + reference("baseline_constant", "constant click rate")).rstrip("\n"),
        f"  AUC                  {summary['eval_auc']:.4f}",
        f"  calibration          {summary['eval_calibration']:.3f}",
        f"  log loss             {summary['eval_log_loss']:.4f}",
        (
            f"  training throughput  {summary['train_samples_per_s']:,.0f} samples/s "
            f"({config.training.nproc} processes, {config.sharding.sharding_type})"
        ),
        f"  hyperparameters      {summary['tuning_decision']}: {summary['tuning_reason']}",
        (f"  MLflow run           {summary.get('mlflow_run_url') or summary['mlflow_run_id']}  "
         f"(model version {summary['model_version']})"),
        f"  champion             {'promoted: ' if summary['promoted'] else 'not promoted: '}{summary['promotion_reason']}"
        + (f" (champion NE on these days {champion:.4f})" if champion is not None and not summary["promoted"] else ""),
        "",
        "Open the UIs on this run's data:",
        f"  MLflow:  .venv/bin/mlflow ui --backend-store-uri {config.tracking_uri} --port 5000",
        "           then http://127.0.0.1:5000",
        f"  Prefect: PREFECT_HOME={os.environ.get('PREFECT_HOME', '~/.prefect')} .venv/bin/dlrm server",
        "           then http://127.0.0.1:4200",
        f"  Files:   {run_dir}",
    ]
    if summary.get("files_failed"):
        lines.insert(3, f"  PARTIAL: {len(summary['files_failed'])} file(s) failed: " + "; ".join(summary["files_failed"]))
    return "\n".join(lines)


def _generate(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from ingestion.synthetic import GroundTruth, generate_day

    config = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else config.path(config.data.raw_dir)
    truth = GroundTruth(config.data.synthetic, config.data.multi_hot)
    for day in args.days if args.days is not None else config.data.all_days:
        stats = generate_day(config.data.synthetic, day, out, truth)
        print(f"day {day}: {stats.rows:,} rows, click rate {stats.click_rate:.3f}, "
              f"Bayes-optimal NE {stats.bayes_ne:.4f} → {out / f'day_{day}.tsv.gz'}")
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from ingestion.days import DayError, parse_day
    from ingestion.preprocess import apply_state, fit_state

    config = load_config(args.config, args.overrides)
    warehouse, features = config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir)
    try:
        days = [parse_day(day) for day in args.days] if args.days is not None else list(config.data.all_days)
    except DayError as error:
        raise UserError(f"--days: {error}") from None
    state = fit_state(config.preprocess, warehouse, features, config.data.train_days)
    written = {config.data.shown(day): str(apply_state(config.preprocess, state, warehouse, features, day))
               for day in days}  # fmt: skip
    if args.json:
        print(json.dumps({"state_id": state.state_id, "table_sizes": state.table_sizes,
                          "train_rows": state.train_rows, "days": written}))  # fmt: skip
    else:
        print(f"preprocessing state {state.state_id}: fitted on days "
              f"{config.data.shown_days(state.train_days)} "
              f"({state.train_rows:,} rows, click rate {state.train_click_rate:.4f})")
        for day, folder in written.items():
            print(f"day {day} → {folder}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import time
    from dataclasses import replace

    from flows.config import load_cluster, load_config
    from flows.planning import plan_report
    from training.device import runtime_device
    from training.sharding import this_job_cluster

    config = load_config(args.config, args.overrides)
    if args.cluster:
        cluster = load_cluster(args.cluster)
    else:
        device = runtime_device(config.training.device, 0)  # as the workers will choose it
        cluster = replace(this_job_cluster(device, config.training.nproc, config.training.nproc), name="this machine")
    started = time.perf_counter()
    report = plan_report(config, cluster)
    report["planner_seconds"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "text"}))
    else:
        print(report["text"])
        print(f"\nplanned in {report['planner_seconds']:.1f} s")
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from ingestion.schema import check_multi_hot
    from ingestion.warehouse import day_of, ingest_day
    from ingestion.warehouse import log as ingest_log

    # a failed file is reported below as one "dlrm: error:" line: not also as its log record
    ingest_log.addFilter(lambda record: record.levelno < logging.ERROR)

    for source in args.sources:
        if "://" not in source and not Path(source).exists():
            raise UserError(f"{source}: no such file; pass existing Criteo files (plain or .gz)")
        if "://" not in source and Path(source).is_dir():
            raise UserError(f"{source}: a folder; pass Criteo files (plain or .gz), e.g. {source.rstrip('/')}/day_*.gz")
    if Path(args.warehouse).exists() and not Path(args.warehouse).is_dir():
        raise UserError(f"--warehouse {args.warehouse}: a file, not a folder; pass the warehouse folder (created if missing)")
    try:
        multi_hot = check_multi_hot([name.strip() for name in args.multi_hot.split(",") if name.strip()])
    except ValueError as error:
        raise UserError(f"--multi-hot: {str(error).removeprefix('multi_hot: ')}") from None
    by_day: dict[int, list[str]] = {}
    for index, source in enumerate(args.sources):
        by_day.setdefault(args.day if args.day is not None else day_of(source, index), []).append(source)
    totals = {"rows_read": 0, "rows_written": 0, "rows_quarantined": 0, "files_failed": []}
    for day, sources in sorted(by_day.items()):
        report = ingest_day(sources, day, Path(args.warehouse), force=args.force, multi_hot=multi_hot,
                            allow_empty=args.allow_empty)  # fmt: skip
        totals["rows_read"] += report.rows_read
        totals["rows_written"] += report.rows_written
        totals["rows_quarantined"] += report.rows_quarantined
        totals["files_failed"] += [f.error for f in report.files_failed]
        if not args.json:
            print(f"day {day}: {report.rows_read:,} read, {report.rows_written:,} written, "
                  f"{report.rows_quarantined:,} quarantined" + (" (unchanged, skipped)" if report.skipped else ""))
    for error in totals["files_failed"]:
        print(f"dlrm: error: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps({**totals, "partial": bool(totals["files_failed"])}))
    return 1 if totals["files_failed"] else 0


def _evaluate(args: argparse.Namespace) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from evaluation.metrics import summarize

    path = Path(args.predictions)
    if not path.exists():
        raise UserError(f"{path}: no such file; pass a Parquet file with label and prediction columns")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise UserError(f"{path}: not a readable Parquet file or folder ({str(error).splitlines()[0]}); pass the "
                        "predictions Parquet a run wrote, e.g. runs/demo/train/predictions/day=2/") from None
    missing = {"label", "prediction"} - set(table.column_names)
    if missing:
        raise UserError(f"{path}: missing column(s) {sorted(missing)}; needs label, prediction[, weight]")
    weights = table["weight"].to_numpy() if "weight" in table.column_names else None
    result = summarize(table["label"].to_numpy(), table["prediction"].to_numpy(), weights)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:<12} {value:.6f}" if key != "count" else f"{key:<12} {value:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
