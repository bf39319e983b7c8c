"""Ids that come and go: hash, vocabulary and managed-collision tables night after night.

    .venv/bin/python bench/id_churn.py [--config configs/drifting-ids.toml] [--first 3] [--last 8]
        [--modes managed,hash,vocab] [--set KEY=VALUE ...]

Runs `dlrm backfill --from FIRST --to LAST` once per `preprocess.categorical_mode`, each in a
temporary run folder with the same table size (`preprocess.hash_size`). Prints, per night,
each mode's NE on the evaluation day, and for the last night the share of that day's ids
(weighted by how often they occur, and distinct) that have a row of their own
(training/serving/own_rows.py).
Then the training throughput of each mode (mean over the nights) and the remapper's memory
per process. Last, one JSON line with all of it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flows.run.config import load_config
from ingestion.preprocess import PreprocessState
from training.model.managed_ids import state_bytes
from training.serving.own_rows import own_row_share


def _backfill(config: str, first: int, last: int, overrides: list[str], home: Path) -> list[dict]:
    arguments = [a for o in overrides for a in ("--set", o)]
    done = subprocess.run([sys.executable, "-m", "flows.cli", "backfill", "--config", config, "--from", str(first),
                           "--to", str(last), *arguments, "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(home), "HOME": str(home)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm backfill failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["nights"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "drifting-ids.toml"))
    parser.add_argument("--first", type=int, default=3)
    parser.add_argument("--last", type=int, default=8)
    parser.add_argument("--modes", default="managed,hash,vocab")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    args = parser.parse_args()
    modes = args.modes.split(",")
    nights, shares, throughput, folders = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="id-churn-") as scratch:
        for mode in modes:
            run_dir = Path(scratch) / mode
            overrides = [f'run_dir="{run_dir}"', f'preprocess.categorical_mode="{mode}"', *args.overrides]
            runs = _backfill(args.config, args.first, args.last, overrides, Path(scratch) / "home")
            nights[mode] = {str(n["as_of"]): n["eval_ne"] for n in runs}
            throughput[mode] = float(np.mean([n["train_samples_per_s"] for n in runs]))
            config = load_config(args.config, overrides)
            states = sorted((config.path(config.preprocess.features_dir)).glob("*/state.json"))
            state = PreprocessState.load(max(states, key=lambda p: p.stat().st_mtime))
            share = own_row_share(mode, run_dir / "warehouse", run_dir / "train" / "serving", state.buckets,
                                  list(range(args.last)), args.last)
            shares[mode] = {"occurrences": share.occurrences, "distinct": share.distinct}
            folders[mode] = state
        managed = folders.get("managed")
        memory = state_bytes(managed.table_sizes, load_config(args.config).preprocess.managed.policy) if managed else 0
    print(f"{'night':>6}" + "".join(f"{mode:>10}" for mode in modes))
    for night in nights[modes[0]]:
        print(f"{night:>6}" + "".join(f"{nights[mode][night]:>10.4f}" for mode in modes))
    for mode in modes:
        share = shares[mode]
        print(f"{mode}: {100 * share['occurrences']:.1f} % of day {args.last}'s id occurrences "
              f"({100 * share['distinct']:.1f} % of its distinct ids) have a row of their own; "
              f"{throughput[mode]:,.0f} training samples/s")  # fmt: skip
    if managed:
        print(f"remapper state: {memory / 2**20:.2f} MiB per process ({sum(managed.table_sizes.values()):,} rows)")
    print(json.dumps({"nights": nights, "own_row_share": shares, "train_samples_per_s": throughput,
                      "remapper_bytes_per_process": memory}))  # fmt: skip


if __name__ == "__main__":
    main()
