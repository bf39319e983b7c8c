"""Calibration night after night: a recurring chain on generated days, and one model trained
from scratch on the same days, each judged before and after its calibrator.

    .venv/bin/python bench/calibration_chain.py [--config configs/tiny.toml] [--rows 20000]
        [--first 2] [--last 5] [--set KEY=VALUE ...]

Runs `dlrm backfill --from FIRST --to LAST` (each night continues the champion on the day it
has not seen, judged on the next) and `dlrm run` on days 0..LAST-1 judged on LAST, in a
temporary run folder, with the given overrides (for example
`--set evaluation.calibration='"none"'`). Prints a table per night (NE and Σ predictions /
Σ clicks before and after calibration, the click rates of the trained and the judged day,
promoted or not), the last night's NE over the from-scratch run's, and, last, one JSON line:
the nights, the from-scratch run, and that ratio (`last_night_ne_vs_scratch`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent


def _dlrm(*args: str, home: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args, "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(home), "HOME": str(home)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm {args[0]} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _click_rate(run_dir: Path, day: int) -> float:
    table = pq.read_table(run_dir / "warehouse" / f"day={day}", columns=["label"])
    return float(table["label"].to_numpy().mean())


def _row(summary: dict, run_dir: Path) -> dict:
    metrics = summary.get("metrics", summary)
    trained = summary["days_trained"]
    return {
        "as_of": summary.get("as_of"), "days_trained": trained, "rows_trained": summary["rows_trained"],
        "eval_ne": metrics["eval_ne"], "eval_ne_uncalibrated": metrics.get("eval_ne_uncalibrated"),
        "calibration": metrics["eval_calibration"], "calibration_uncalibrated": metrics.get("eval_calibration_uncalibrated"),
        "lr_ne": metrics.get("logistic_regression_ne"), "promoted": summary["promoted"],
        "reason": summary["promotion_reason"],
        "ctr_trained": sum(_click_rate(run_dir, d) for d in trained) / len(trained),
        "ctr_judged": _click_rate(run_dir, summary["eval_days"][0]),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    parser.add_argument("--rows", type=int, default=20_000, help="generated rows a day")
    parser.add_argument("--first", type=int, default=2)
    parser.add_argument("--last", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="calibration-chain-") as scratch:
        work = Path(scratch)
        common = ["--config", args.config, "--set", f"data.synthetic.rows_per_day={args.rows}"]
        for override in args.overrides:
            common += ["--set", override]
        chain_dir, scratch_dir = work / "chain", work / "scratch"
        backfill = _dlrm("backfill", *common, "--set", f'run_dir="{chain_dir}"', "--from", str(args.first),
                         "--to", str(args.last), home=work / "prefect")  # fmt: skip
        nights = [_row(night, chain_dir) for night in backfill["nights"] if not night.get("skipped")]
        once = _dlrm("run", *common, "--set", f'run_dir="{scratch_dir}"', "--set",
                     f"data.train_days={list(range(args.last))}", "--set", f"data.eval_days=[{args.last}]",
                     home=work / "prefect")  # fmt: skip
        from_scratch = _row(once, scratch_dir)
    print(f"{'as of':>6} {'trained':>10} {'NE before':>10} {'NE after':>9} {'cal before':>11} {'cal after':>10} "
          f"{'CTR trained':>12} {'CTR judged':>11}  promoted")  # fmt: skip
    for row in [*nights, {**from_scratch, "as_of": "scratch"}]:
        before = "" if row["eval_ne_uncalibrated"] is None else f"{row['eval_ne_uncalibrated']:.4f}"
        cal_before = "" if row["calibration_uncalibrated"] is None else f"{row['calibration_uncalibrated']:.3f}"
        print(f"{row['as_of']!s:>6} {row['days_trained']!s:>10} {before:>10} {row['eval_ne']:>9.4f} {cal_before:>11} "
              f"{row['calibration']:>10.3f} {row['ctr_trained']:>12.4f} {row['ctr_judged']:>11.4f}  "
              f"{'yes' if row['promoted'] else 'no: ' + row['reason']}")  # fmt: skip
    # below 1: the chain's last night is ahead of the model trained on every day at once
    last_vs_scratch = nights[-1]["eval_ne"] / from_scratch["eval_ne"] if nights else None
    print(f"last night's NE / from scratch: {last_vs_scratch:.4f}" if nights else "no night trained")
    print(json.dumps({"overrides": args.overrides, "rows_per_day": args.rows, "nights": nights,
                      "from_scratch": from_scratch, "last_night_ne_vs_scratch": last_vs_scratch}))  # fmt: skip


if __name__ == "__main__":
    main()
