"""The `dlrm` command.

    dlrm run --config configs/demo.toml [--set section.key=value ...] [--as-of DAY] [--json]
    dlrm backfill --config FILE --from DAY --to DAY [--json]
    dlrm train --config FILE [--out DIR] [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT] [--json]
    dlrm submit --config FILE [--nodes N] [--partition P] [--time T] [--gpus-per-node G] [--sbatch-arg A ...] [--wait] [--json]
    dlrm retune --config FILE [--trials N] [--timeout S] [--json]
    dlrm serve --config FILE [--limit N] [--with-server [--port 4200]]
    dlrm server [--port 4200]
    dlrm generate --config FILE [--days 0 1 2]
    dlrm ingest SOURCE... --warehouse DIR [--day N] [--multi-hot C3,C12] [--allow-empty] [--json]
    dlrm preprocess --config FILE [--days 0 1 2] [--json]
    dlrm plan --config FILE [--cluster CLUSTER.toml] [--json]
    dlrm characterize --config FILE [--sweep KEY=V1,V2 ...] [--max-batch N] [--own-features] [--json]
    dlrm port --config FILE [--cluster CLUSTER.toml] [--json]
    dlrm evaluate --predictions FILE.parquet [--json]
    dlrm export-delta --config FILE --from-version A --to-version B --out DIR [--json]

A problem the user can fix (a bad config, a missing file) ends with one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from flows.cli import commands
from flows.cli.commands import UserError
from flows.stages.prefect_defaults import DASHBOARD_PORT, apply_prefect_defaults, quiet_library_output
from training.launch.interpreter import end_without_teardown
from training.launch.processes import Stopped, stop_on_signals, write_line_to_stderr

DEFAULT_CONFIG = "configs/demo.toml"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def prepare_environment() -> None:
    """The command's environment defaults, set before Prefect reads its settings (at import
    here; again by a process that forks commands with environments of their own)."""
    # Each checkout's Prefect state is its own (deployments, runs, the local server's database):
    # with the shared ~/.prefect, two checkouts' `dlrm serve` would pick up each other's runs.
    os.environ.setdefault("PREFECT_HOME", str(PROJECT_ROOT / ".prefect"))
    # Our packages log through the standard library; Prefect shows those records in the UI too.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "ingestion,training,evaluation,flows")
    apply_prefect_defaults()
    quiet_library_output()
    # Prefect keeps its local server's database in PREFECT_HOME but does not create the folder.
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)


prepare_environment()


def entry() -> NoReturn:
    """The `dlrm` console script and `python -m flows.cli`: `main`, then the end of a normal
    exit less the interpreter's teardown, 2.3 s after a `dlrm run`'s report
    (training/launch/interpreter.py)."""
    end_without_teardown(exit_code_of(sys.argv[1:]))


def exit_code_of(argv: Sequence[str]) -> int:
    """`main(argv)`'s exit code as the interpreter would end with it: argparse's exits and
    --help as they say, an uncaught error's traceback and 1 (130 for an interrupt)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except KeyboardInterrupt:  # before the command's own stop handling: Python's exit code for it
        traceback.print_exc()
        return 130
    except BaseException:  # noqa: BLE001 - an uncaught error: its traceback and exit code 1, as Python's
        traceback.print_exc()
        return 1


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
    # called from the signal handler too: written to the descriptor, past Prefect's print
    # capture and its loggers' locks, which the signal may have interrupted
    write_line_to_stderr(f"dlrm: {line}")


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
    return bool({cls.__name__ for cls in type(error).__mro__} & commands.USER_FACING_ERRORS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlrm", description="End-to-end DLRM training pipeline")
    subcommands = parser.add_subparsers(dest="command", required=True)

    run = subcommands.add_parser("run", help="run the whole pipeline as a Prefect flow")
    _add_config_arguments(run)
    run.add_argument("--as-of", metavar="DAY", help="recurring run: today's data is DAY (or 'newest', the newest "
                     "complete day): continue the champion on the days before it that it has not seen, "
                     "judge on DAY")  # fmt: skip
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    run.set_defaults(handler=commands.run)

    backfill = subcommands.add_parser("backfill", help="recurring runs as of each day from --from to --to, in order")
    _add_config_arguments(backfill)
    backfill.add_argument("--from", dest="first", required=True, metavar="DAY",
                          help="the first night's day (an integer, or an ISO date for a dated warehouse)")
    backfill.add_argument("--to", dest="last", required=True, metavar="DAY", help="the last night's day")
    backfill.add_argument("--json", action="store_true", help="print the nights' summaries as one JSON object")
    backfill.set_defaults(handler=commands.backfill)

    train = subcommands.add_parser("train", help="only the training stage, on the features the run folder holds; "
                                "one command per host for a multi-host job")  # fmt: skip
    _add_config_arguments(train)
    train.add_argument("--out", metavar="FOLDER", help="where the job writes (default: <run_dir>/train); "
                       "on several hosts, the same shared folder on each")  # fmt: skip
    train.add_argument("--nnodes", type=int, help="hosts in the job (default: the Slurm allocation's nodes inside one, "
                       "else orchestration.trainer_hosts, 1)")  # fmt: skip
    train.add_argument("--node-rank", type=int, help="this host's rank, 0..nnodes-1; node 0 hosts the rendezvous and "
                       "prints the summary (default: SLURM_NODEID inside an allocation, else 0)")  # fmt: skip
    train.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="node 0's address and a free port (with --nnodes > 1; default: the allocation's first node "
                       "inside Slurm, else orchestration.rdzv_endpoint)")  # fmt: skip
    train.add_argument("--local-addr", default="", metavar="ADDRESS",
                       help="the address this host advertises (default: the one that routes to the endpoint)")
    train.add_argument("--socket-ifname", default="", metavar="INTERFACE",
                       help="the interface gloo/NCCL use (default: the one holding that address)")
    train.add_argument("--join-timeout", type=int, default=300, metavar="SECONDS",
                       help="how long a host waits for the others (default: %(default)s)")
    train.add_argument("--json", action="store_true", help="print the report as one JSON object")
    train.set_defaults(handler=commands.train)

    submit = subcommands.add_parser("submit", help="`dlrm train` as a Slurm batch job on N nodes (sbatch); the script is "
                                    "kept in the run folder")  # fmt: skip
    _add_config_arguments(submit)
    submit.add_argument("--nodes", type=int, default=1, help="nodes, one `dlrm train` each (default: %(default)s)")
    submit.add_argument("--partition", default="", help="the Slurm partition (default: the cluster's)")
    submit.add_argument("--time", dest="time_limit", default="", metavar="LIMIT", help="the time limit, e.g. 02:00:00")
    submit.add_argument("--gpus-per-node", type=int, default=0, metavar="G", help="GPUs a node (set training.nproc to match)")
    submit.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="ARG",
                        help="one more #SBATCH argument, e.g. --sbatch-arg=--account=recsys (repeatable)")  # fmt: skip
    submit.add_argument("--wait", action="store_true", help="follow the job to its end; Ctrl-C cancels it (scancel)")
    submit.add_argument("--json", action="store_true", help="print the report as one JSON object")
    submit.set_defaults(handler=commands.submit)

    retune = subcommands.add_parser("retune", help="tune hyperparameters for the config's tuning key (Optuna)")
    _add_config_arguments(retune)
    retune.add_argument("--trials", type=int, help="trial budget of the study (default: tuning.n_trials)")
    retune.add_argument("--timeout", type=float, help="wall-clock budget of this worker in seconds; without "
                        "--trials the study runs trials until then (the config's count is not used)")
    retune.add_argument("--json", action="store_true", help="print the result as one JSON object")
    retune.set_defaults(handler=commands.retune)

    serve = subcommands.add_parser("serve", help="register and serve the nightly, retrain and retune deployments")
    _add_config_arguments(serve)
    serve.add_argument("--limit", type=int, help="most flow runs at once (default: no limit)")
    serve.add_argument("--with-server", action="store_true",
                       help="also start the Prefect server with its UI here (else PREFECT_API_URL names one)")
    serve.add_argument("--port", type=int, default=DASHBOARD_PORT, help="the UI's port with --with-server (default: %(default)s)")
    serve.add_argument("--trainer-node", type=int, metavar="R", help="serve only node R's part of multi-host "
                       "training (orchestration.trainer_hosts > 1), on that host")  # fmt: skip
    serve.set_defaults(handler=commands.serve)

    server = subcommands.add_parser("server", help="the Prefect server with its UI (the dashboard), until Ctrl-C")
    server.add_argument("--port", type=int, default=DASHBOARD_PORT, help="the UI's port (default: %(default)s)")
    server.set_defaults(handler=commands.server)

    generate = subcommands.add_parser("generate", help="write Criteo-format days of synthetic data")
    _add_config_arguments(generate)
    generate.add_argument("--days", type=int, nargs="*", help="days to write (default: the config's)")
    generate.add_argument("--out", help="output folder (default: the config's raw_dir)")
    generate.set_defaults(handler=commands.generate)

    ingest = subcommands.add_parser("ingest", help="raw Criteo files → validated Parquet warehouse")
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
    ingest.set_defaults(handler=commands.ingest)

    preprocess = subcommands.add_parser("preprocess", help="warehouse days → features (DuckDB), fitted on the train days")
    _add_config_arguments(preprocess)
    preprocess.add_argument("--days", nargs="*", help="days to write (default: the config's): integers, or dates")
    preprocess.add_argument("--json", action="store_true", help="print the state and the written days as JSON")
    preprocess.set_defaults(handler=commands.preprocess)

    plan = subcommands.add_parser("plan", help="plan the sharding of a model for a cluster, here or declared")
    _add_config_arguments(plan)
    plan.add_argument("--cluster", help="cluster TOML (default: this machine with training.nproc processes)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.set_defaults(handler=commands.plan)

    characterize = subcommands.add_parser("characterize", help="measure this hardware with the config's model: "
                                          "throughput, step time and memory per batch size, the hardware's batch")  # fmt: skip
    _add_config_arguments(characterize)
    characterize.add_argument("--sweep", dest="sweeps", action="append", default=[], metavar="KEY=V1,V2",
                              help="also vary a config key (one series per value), e.g. sharding.compute_kernel="
                              "fused,fused_uvm_caching; training.batch_size=… gives the batches instead of doubling")  # fmt: skip
    characterize.add_argument("--first-batch", type=int, help="the first global batch (default: 256 a process)")
    characterize.add_argument("--max-batch", type=int, help="no global batch beyond this (default: 4,096 a "
                              "process on CPUs, 65,536 on GPUs)")  # fmt: skip
    characterize.add_argument("--min-gain", type=float, default=0.05, help="a doubling that gains less than this "
                              "share of throughput has saturated (default: %(default)s) ...")  # fmt: skip
    characterize.add_argument("--patience", type=int, default=2, help="... when this many doublings in a row "
                              "do (default: %(default)s)")  # fmt: skip
    characterize.add_argument("--own-features", action="store_true", help="train on the config's own training "
                              "features, as an earlier `dlrm run` or `dlrm preprocess` left them (default: rows "
                              "generated to the config's shape)")  # fmt: skip
    characterize.add_argument("--no-tracking", action="store_true", help="do not log an MLflow run")
    characterize.add_argument("--json", action="store_true", help="print the report as one JSON object")
    characterize.set_defaults(handler=commands.characterize)

    port = subcommands.add_parser("port", help="move to new hardware: measure its batch size, retune at it, "
                                  "train (dlrm run with tuning.policy = characterize_then_retune)")  # fmt: skip
    _add_config_arguments(port)
    port.add_argument("--cluster", help="the trainer hosts' hardware as declared (orchestration.trainer_cluster); "
                      "default: this machine")  # fmt: skip
    port.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    port.set_defaults(handler=commands.port, as_of=None)

    evaluate = subcommands.add_parser("evaluate", help="NE, AUC, calibration of a predictions file")
    evaluate.add_argument("--predictions", required=True, help="Parquet with label, prediction[, weight]")
    evaluate.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    evaluate.set_defaults(handler=commands.evaluate)

    export_delta = subcommands.add_parser("export-delta", help="the rows, dense part and calibration that take one "
                                          "registered version's served model to another's (Parquet)")  # fmt: skip
    _add_config_arguments(export_delta)
    export_delta.add_argument("--from-version", required=True, help="the version serving now")
    export_delta.add_argument("--to-version", required=True, help="the version to serve")
    export_delta.add_argument("--out", required=True, help="the folder to write the delta into")
    export_delta.add_argument("--json", action="store_true", help="print the report as one JSON object")
    export_delta.set_defaults(handler=commands.export_delta)
    return parser


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and repeatable --set overrides, the same for every command that reads a config."""
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="TOML config (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.batch_size=4096")  # fmt: skip
