"""The NE cost of a larger batch, before and after retuning.

On generated data, one run:
  1. retune at batch B (a study of real training runs): the baseline NE is its best;
  2. train at 8·B with B's best parameters unchanged: the large-batch NE (the gap);
  3. retune at 8·B, warm-started from B's best scaled by the linear and √ rules: the
     retuned NE.
Gaps are in percent of the baseline NE (positive: worse than the baseline).

Prints its figures last as one JSON line: baseline_ne, large_batch_ne, retuned_ne,
gap_pct, retuned_gap_pct (and the studies' trial counts and seconds).

    .venv/bin/python bench/retune_gap.py [--trials 12] [--batch 256] [--factor 8] [--seeds 2]

Every NE is a mean over the same training seeds (`tuning.seeds_per_trial`), so the gaps
compare parameters, not luck. About 35 minutes on 2 cores (2.4 M training rows; each
trial is two real training runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flows.run.config import PipelineConfig, load_config
from flows.run.feature_files import Features
from flows.run.reports import IngestDay
from flows.run.resolve import resolve_run
from flows.tuning.retune import run_retune
from flows.tuning.trials import train_and_score
from ingestion.preprocess import apply_state, fit_state
from ingestion.synthetic import GroundTruth, generate_day
from ingestion.warehouse import ingest_day


def build_features(config: PipelineConfig) -> Features:
    """Generate, ingest and preprocess the config's days with the library (no Prefect)."""
    raw, warehouse = config.path(config.data.raw_dir), config.path(config.data.warehouse_dir)
    features_root = config.path(config.preprocess.features_dir)
    truth = GroundTruth(config.data.synthetic, config.data.multi_hot)
    ingest = []
    for day in config.data.all_days:
        generate_day(config.data.synthetic, day, raw, truth)
        report = ingest_day([str(raw / f"day_{day}.tsv.gz")], day, warehouse, multi_hot=config.data.multi_hot)
        ingest.append(IngestDay(day, report.rows_read, report.rows_written, report.rows_quarantined, [], report.skipped))
    state = fit_state(config.preprocess, warehouse, features_root, config.data.train_days)
    files = {
        day: [str(p) for p in sorted(apply_state(config.preprocess, state, warehouse, features_root, day).glob("*.parquet"))]
        for day in config.data.all_days
    }  # fmt: skip
    return Features(state, files, ingest)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "retune-bench.toml"))
    parser.add_argument("--trials", type=int, default=12, help="trials per study")
    parser.add_argument("--batch", type=int, default=256, help="the small global batch B")
    parser.add_argument("--factor", type=int, default=8, help="the large batch is factor × B")
    parser.add_argument("--seeds", type=int, default=2,
                        help="training seeds per trial: every NE reported is a mean over them")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both batch sizes, e.g. data.synthetic.rows_per_day=800000")
    args = parser.parse_args()

    run_dir = ROOT / "runs" / "bench-retune-gap"
    shutil.rmtree(run_dir, ignore_errors=True)  # fresh studies: the figures are this run's
    # min_steps 0: both studies at exactly the batch sizes compared (no run-length rule)
    common = [*args.overrides, f'run_dir="{run_dir}"', f"tuning.n_trials={args.trials}",
              f"tuning.seeds_per_trial={args.seeds}", "training.min_steps=0"]
    small = load_config(args.config, [*common, f"training.batch_size={args.batch}"])
    # Held-out NE for the pruner at the same samples seen in both studies.
    every = max(1, small.evaluation.heldout_every_steps // args.factor)
    large = load_config(args.config, [*common, f"training.batch_size={args.batch * args.factor}",
                                      f"evaluation.heldout_every_steps={every}"])  # fmt: skip
    features = build_features(small)

    started = time.perf_counter()
    tuned = run_retune(resolve_run(small, state=features.state), features)
    small_seconds = time.perf_counter() - started
    assert tuned.best is not None, "the study at batch B finished no trial"
    print(f"batch {args.batch}: tuned NE {tuned.best.ne:.5f} in {small_seconds:.0f} s ({tuned.best.params})", flush=True)

    large_ne = train_and_score(large, features, tuned.best.params, run_dir / "large-batch-same-params")
    print(f"batch {args.batch * args.factor}, same parameters: NE {large_ne:.5f}", flush=True)

    started = time.perf_counter()
    retuned = run_retune(resolve_run(large, state=features.state), features)
    large_seconds = time.perf_counter() - started
    assert retuned.best is not None, "the study at batch 8·B finished no trial"
    print(f"batch {args.batch * args.factor}, retuned: NE {retuned.best.ne:.5f} in {large_seconds:.0f} s "
          f"({retuned.best.params})", flush=True)  # fmt: skip

    baseline = tuned.best.ne
    figures = {
        "batch_size": args.batch,
        "large_batch_size": args.batch * args.factor,
        "trials_per_study": args.trials,
        "seeds_per_trial": args.seeds,
        "train_rows": sum(r.rows_written for r in features.ingest if r.day in small.data.train_days),
        "baseline_ne": round(baseline, 6),
        "large_batch_ne": round(large_ne, 6),
        "retuned_ne": round(retuned.best.ne, 6),
        "gap_pct": round(100 * (large_ne - baseline) / baseline, 3),
        "retuned_gap_pct": round(100 * (retuned.best.ne - baseline) / baseline, 3),
        "retuned_from_warm_start": retuned.best.trial_number < retuned.warm_started,
        "study_seconds_small": round(small_seconds, 1),
        "study_seconds_large": round(large_seconds, 1),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
