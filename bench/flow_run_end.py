"""What a flow run's end waits for: Prefect's heartbeat thread against flows/stages/heartbeats.py.

    .venv/bin/python bench/flow_run_end.py [--rounds 3]

Prefect joins a flow run's heartbeat thread when the run ends, and that thread sleeps in
steps of one second. Against a temporary Prefect server started as a `dlrm` command starts
its own, alternately with Prefect's own heartbeat context and the prompt one: (1) a flow of
four subflows that do nothing, (2) `dlrm run`'s pipeline on `configs/tiny.toml` in this
process (training on a warm-rank server started once, as the test suite trains), each in a
new run folder. Per round and variant the wall time; the figures are medians, the ratios
prompt ÷ Prefect's of each round's pair, medianed. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.cli import prepare_environment  # before Prefect reads its settings

prepare_environment()

from prefect import flow, flow_engine
from prefect.context import refresh_global_settings_context

from flows.deployments.pipeline import run_pipeline
from flows.stages import heartbeats
from flows.stages.local_server import prefect_api, temporary_server
from training.launch.warm_ranks import ENVIRONMENT_KEY, start_server, stop_server

VARIANTS = {"prefects_own": heartbeats.PREFECTS_OWN, "prompt": heartbeats.prompt_heartbeats}


@flow
def _step() -> None:
    """A flow run with no work: what is timed is its start and its end."""


@flow
def _four_subflows() -> None:
    for _ in range(4):
        _step()


def _tiny_pipeline() -> None:
    run_pipeline(str(ROOT / "configs" / "tiny.toml"), [f'run_dir="{tempfile.mkdtemp(prefix="flow-run-end-")}"'])


def _timed(work: Callable[[], None], variant: str) -> float:
    flow_engine._send_heartbeats = VARIANTS[variant]
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    socket_path = Path(tempfile.mkdtemp(prefix="wr-")) / "s.sock"
    warm = start_server(socket_path)
    os.environ[ENVIRONMENT_KEY] = str(socket_path)
    server = temporary_server()
    database = Path(tempfile.mkdtemp(prefix="prefect-")) / "prefect.db"
    server = dataclasses.replace(server, env={**server.env, "PREFECT_SERVER_DATABASE_CONNECTION_URL":
                                              f"sqlite+aiosqlite:///{database}"})  # fmt: skip
    works = {"subflows": _four_subflows, "tiny_pipeline": _tiny_pipeline}
    seconds: dict[str, dict[str, list[float]]] = {w: {v: [] for v in VARIANTS} for w in works}
    try:
        with prefect_api(server):
            refresh_global_settings_context()
            for name, work in works.items():
                _timed(work, "prompt")  # the first run of each pays its imports and compilations
                for round_ in range(rounds):
                    order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
                    for variant in order:
                        seconds[name][variant].append(_timed(work, variant))
                    print(f"{name} round {round_ + 1}: " + ", ".join(f"{v} {seconds[name][v][-1]:.2f} s" for v in VARIANTS),
                          flush=True)  # fmt: skip
    finally:
        flow_engine._send_heartbeats = heartbeats.prompt_heartbeats
        stop_server(warm)
    result = {
        name: {
            **{f"{v}_s": round(statistics.median(s), 3) for v, s in by_variant.items()},
            "ratio": round(statistics.median(p / o for p, o in zip(by_variant["prompt"], by_variant["prefects_own"])), 3),
        }
        for name, by_variant in seconds.items()
    }
    print(json.dumps({"rounds": rounds, **result}))


if __name__ == "__main__":
    main()
