"""What a Prefect server's start costs on a new home: Prefect's own start-up against a copy of
the template (flows/stages/prefect_database.py), and a home that has its database.

    .venv/bin/python bench/prefect_home_start.py [--rounds 2]

Each round, in a user cache of its own (so the first start finds no template): the temporary
server a `dlrm` command starts (`flows.stages.local_server`), from its start to its first
answer, on a new home (Prefect migrates a new SQLite file; the start keeps the template),
on a second new home (a copy of the template), and on the first home again. The figures
are the medians; the ratio is copy ÷ new of each round, medianed. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.stages.prefect_defaults import apply_prefect_defaults

apply_prefect_defaults()
os.environ.pop("PREFECT_API_URL", None)  # the server started here, not one the shell names

from flows.stages.local_server import _start, temporary_server
from flows.stages.prefect_database import template_path
from training.launch.processes import stop_group


def seconds_to_answer(home: Path) -> float:
    """A temporary server on `home`: seconds from its start to its first answer."""
    os.environ["PREFECT_HOME"] = str(home)
    began = time.monotonic()
    process = _start(temporary_server(), 300.0)
    took = time.monotonic() - began
    stop_group(process, grace_s=10.0)
    return took


def one_round(root: Path) -> dict[str, float]:
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    assert not template_path().exists()
    new = seconds_to_answer(root / "first")
    assert template_path().exists(), "the first new home's start keeps the template"
    copied = seconds_to_answer(root / "second")
    existing = seconds_to_answer(root / "first")
    return {"new_home_s": new, "copied_home_s": copied, "existing_home_s": existing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rounds = []
    for number in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="prefect-home-start-") as root:
            rounds.append(one_round(Path(root)))
        print(f"round {number + 1}: " + ", ".join(f"{key} {value:.1f}" for key, value in rounds[-1].items()), flush=True)
    figures = {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]}
    figures["copy_over_new"] = round(statistics.median(r["copied_home_s"] / r["new_home_s"] for r in rounds), 3)
    print(f"\n{'home':<34}{'to answer':>10}")
    for label, key in (("new, Prefect's own start-up", "new_home_s"), ("new, a copy of the template", "copied_home_s"),
                       ("one that has its database", "existing_home_s")):  # fmt: skip
        print(f"{label:<34}{figures[key]:>9.1f}s")
    print(json.dumps({"bench": "prefect_home_start", "rounds": args.rounds, **figures}))


if __name__ == "__main__":
    main()
