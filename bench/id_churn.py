"""Ids that come and go: hash, vocabulary and managed-collision tables night after night.

    .venv/bin/python bench/id_churn.py [--config configs/drifting-ids.toml] [--first 3] [--last 8]
        [--modes managed,hash,vocab] [--set KEY=VALUE ...]

Runs `dlrm backfill --from FIRST --to LAST` once per `preprocess.categorical_mode`, each in a
temporary run folder with the same table size (`preprocess.hash_size`). Prints, per night,
each mode's NE on the evaluation day, and for the last night the share of that day's ids
(weighted by how often they occur, and distinct) that have a row of their own:
- managed: the id is admitted (the served model's remapping);
- vocab: the id is in the vocabulary (the served vocabularies);
- hash: the id was trained and no other trained id hashes to its row.
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
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flows.config import load_config
from ingestion.preprocess import PreprocessState
from training.model.managed_ids import state_bytes


def _backfill(config: str, first: int, last: int, overrides: list[str], home: Path) -> list[dict]:
    arguments = [a for o in overrides for a in ("--set", o)]
    done = subprocess.run([sys.executable, "-m", "flows.cli", "backfill", "--config", config, "--from", str(first),
                           "--to", str(last), *arguments, "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(home), "HOME": str(home)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm backfill failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["nights"]


def _day_ids(run_dir: Path, day: int, features: list[str]) -> dict[str, np.ndarray]:
    table = pq.read_table(run_dir / "warehouse" / f"day={day}", columns=features)
    return {f: table[f].drop_null().to_numpy().astype(np.int64) for f in features}


def _own_row_share(mode: str, run_dir: Path, state: PreprocessState, trained_days: list[int], day: int) -> dict:
    """The share of `day`'s ids with a row of their own in the last night's model."""
    features = list(state.buckets)
    ids = _day_ids(run_dir, day, features)
    serving = run_dir / "train" / "serving"
    owned_occurrences = owned_distinct = total_occurrences = total_distinct = 0
    if mode == "hash":
        trained = {f: np.unique(np.concatenate([v[f] for v in (_day_ids(run_dir, d, [f]) for d in trained_days)]))
                   for f in features}  # fmt: skip
    else:
        arrays = np.load(serving / "vocabularies.npz")
    for f in features:
        values = ids[f]
        distinct = np.unique(values)
        if mode == "hash":
            rows = 1 + trained[f] % state.buckets[f]
            shared = np.unique(rows, return_counts=True)
            alone = set(shared[0][shared[1] == 1].tolist())
            known = np.isin(distinct, trained[f])
            own = known & np.isin(1 + distinct % state.buckets[f], list(alone))
        else:
            own = np.isin(distinct, arrays[f"{f}.values"])
        owned = distinct[own]
        owned_distinct += int(own.sum())
        total_distinct += len(distinct)
        owned_occurrences += int(np.isin(values, owned).sum())
        total_occurrences += len(values)
    return {"occurrences": owned_occurrences / total_occurrences, "distinct": owned_distinct / total_distinct}


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
            shares[mode] = _own_row_share(mode, run_dir, state, list(range(args.last)), args.last)
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
