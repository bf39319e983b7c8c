"""Is a retune ever worse than the configured values? One config run both ways.

    .venv/bin/python bench/tuned_vs_configured.py --config configs/small-real.toml [--trials 6]
        [--set KEY=VALUE ...] [--drifting-weeks 6 [--rows-per-week 5000]]

Runs `dlrm run` with `tuning.policy = "off"` (the configured values) and with
`"retune_first"` (a study of `--trials` trials, then the verdict against the configured
values), each in a temporary run folder, and prints both evaluation NEs, the verdict, and the
noise the verdict computed (the half-width of its paired-bootstrap interval on the validation
rows). `--drifting-weeks N` first writes a weekly warehouse of N partitions whose click signal
turns 0.25 rad a week (ingestion/sample_warehouse.py, the shape `configs/warehouse-example.toml`
reads) and trains on all but the newest week, judged on it:

    .venv/bin/python bench/tuned_vs_configured.py --config configs/warehouse-example.toml \
        --drifting-weeks 6 --trials 3 --set model.embedding_dim=8 ...

Last, one JSON line: configured_eval_ne, tuned_eval_ne, kept_configured, gain,
gain_low, gain_high, noise, trials, seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flows.run.config import load_config
from ingestion.sample_warehouse import write_sample_warehouse


def _drifting_warehouse(root: Path, weeks: int, rows_per_week: int) -> list[str]:
    """Weekly partitions from 2026-09-07 on, the signal turning 0.25 rad a week (a week apart its
    effects correlate by 0.97, five weeks apart by 0.32); the overrides that train on all but
    the newest and judge on it."""
    dates = [str(datetime.date(2026, 9, 7) + datetime.timedelta(weeks=k)) for k in range(weeks)]
    write_sample_warehouse(root, dates, rows_per_week, seed=11, signal_drift=0.25)
    train = ", ".join(f'"{date}"' for date in dates[:-1])
    return [f'data.path="{root}"', f"data.train_days=[{train}]", f'data.eval_days=["{dates[-1]}"]']


def _run(config: str, overrides: list[str], home: Path) -> dict:
    arguments = [a for o in overrides for a in ("--set", o)]
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", config, *arguments, "--json"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(home), "HOME": str(home)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm run failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "small-real.toml"))
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--drifting-weeks", type=int, default=0, help="train on a generated weekly warehouse")
    parser.add_argument("--rows-per-week", type=int, default=5_000)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tuned-vs-configured-") as scratch:
        home = Path(scratch) / "home"
        if args.drifting_weeks:
            args.overrides = [*_drifting_warehouse(Path(scratch) / "source", args.drifting_weeks, args.rows_per_week),
                              *args.overrides]  # fmt: skip
        configured = _run(args.config, [f'run_dir="{scratch}/configured"', *args.overrides, 'tuning.policy="off"'], home)
        overrides = [f'run_dir="{scratch}/tuned"', *args.overrides, 'tuning.policy="retune_first"',
                     f"tuning.n_trials={args.trials}"]  # fmt: skip
        tuned = _run(args.config, overrides, home)
        storage = load_config(args.config, overrides).optuna_storage
        (summary,) = optuna.get_all_study_summaries(storage)
        decision = optuna.load_study(study_name=summary.study_name, storage=storage).user_attrs["decision"]
    noise = (decision["gain_high"] - decision["gain_low"]) / 2
    for name, run in (("configured values", configured), (f"retuned ({args.trials} trials)", tuned)):
        print(f"{name}: eval NE {run['eval_ne_uncalibrated']:.5f} → {run['eval_ne']:.5f} calibrated, calibration "
              f"{run['eval_calibration_uncalibrated']:.3f} → {run['eval_calibration']:.3f} ({run['calibrator']}); "
              f"{'promoted' if run['promoted'] else 'not promoted'}: {run['promotion_reason']}")  # fmt: skip
    print(f"verdict: {decision['verdict']}")
    print(f"eval NE difference {tuned['eval_ne'] - configured['eval_ne']:+.5f}; the verdict's noise ±{noise:.5f}")
    print(json.dumps({"configured_eval_ne": configured["eval_ne"], "tuned_eval_ne": tuned["eval_ne"],
                      "configured_eval_ne_uncalibrated": configured["eval_ne_uncalibrated"],
                      "tuned_eval_ne_uncalibrated": tuned["eval_ne_uncalibrated"],
                      "configured_calibration": [configured["eval_calibration_uncalibrated"], configured["eval_calibration"]],
                      "tuned_calibration": [tuned["eval_calibration_uncalibrated"], tuned["eval_calibration"]],
                      "configured_promoted": configured["promoted"], "tuned_promoted": tuned["promoted"],
                      "kept_configured": decision["kept_configured"], "gain": decision["gain"],
                      "gain_low": decision["gain_low"], "gain_high": decision["gain_high"], "noise": noise,
                      "trials": args.trials, "seconds": round(time.perf_counter() - started, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
