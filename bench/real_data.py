"""The shipped defaults on real public data: the model against its logistic regression, per seed.

    .venv/bin/python bench/real_data.py --folder DIR [--seeds 0,1,2] [--only avazu,movielens,adult]
        [--set KEY=VALUE ...] [--keep SCRATCH] [--nights]

DIR holds data the user brought, kept outside the repository (their terms forbid
redistribution; no test needs them):

- `avazu-10k.csv`: the first 10,000 rows of Avazu's click logs (with its header). A hash of
  each row's id puts 8,000 in partition day=0 (training) and 2,000 in day=1 (evaluation);
  every categorical column is an id feature; its only number, the hour (one value in these
  rows), is the count column the bottom MLP needs.
- `ml-100k/`: MovieLens-100K (`u.data`, `u.user`, `u.item`). A rating of 4 or 5 is a click;
  one partition a week since the first rating; weeks 7–26 train (about 68,000 rows), week 27
  judges (8,684). Ids: user, movie, gender, occupation, ZIP prefix, genres (a list); counts:
  the user's age and the movie's release year.
- `adult.data`: UCI's Adult census table (the 30,162 complete rows, with a header line naming
  its columns; a file without one takes UCI's names in order). The first 10,000 rows, split
  80/20 by a hash of the row number as Avazu's; an income over 50K is a click. Six numbers
  (age, fnlwgt, years of education, capital gain and loss, hours a week) are the counts, the
  eight categorical columns the ids: the dataset with numbers that matter.

`--nights` replays MovieLens as a recurring lineage instead: a first model on weeks 7–18
judged on week 19, then `dlrm run --as-of W` for weeks 20–27, each night continuing the newest
model (`orchestration.continue_from = "latest"`); per night what it trained, its NE and
calibration, and the NE on that week of the model served after it (`served_ne`).

Each dataset becomes a hive-partitioned Parquet warehouse and a config that sets only
`[data]` (and the run folder): what a new user writes. `dlrm run` trains it once per seed
(`training.seed`), `--set` overrides applying to every run. It prints a table; last, one JSON
line: for each dataset the model's NE per seed, their spread ((max − min) / min), the
logistic regression's and the constant's NE, the served calibration, and how many runs beat
the regression.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
AVAZU_IDS = ("C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain", "app_category",
             "device_id", "device_ip", "device_model", "device_type", "device_conn_type", "C14", "C15", "C16", "C17",
             "C18", "C19", "C20", "C21")  # fmt: skip
WEEK_S = 7 * 86_400
MOVIELENS_TRAIN_WEEKS, MOVIELENS_EVAL_WEEK = range(7, 27), 27
ADULT_COUNTS = ("age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hr_per_week")
ADULT_IDS = ("type_employer", "education", "marital", "occupation", "relationship", "race", "sex", "country")
ADULT_COLUMNS = ("age", "type_employer", "fnlwgt", "education", "education_num", "marital", "occupation",
                 "relationship", "race", "sex", "capital_gain", "capital_loss", "hr_per_week", "country", "income")
ADULT_ROWS = 10_000
NIGHTS_FROM = 19  # --nights: the first model trains weeks 7–18 and is judged on 19


def avazu_warehouse(csv_file: Path, out: Path) -> dict:
    """Avazu's rows as day=0 (80 %, training) and day=1 (20 %, evaluation); the `[data]` table."""
    parts: dict[int, list[dict]] = {0: [], 1: []}
    with csv_file.open() as handle:
        for row in csv.DictReader(handle):
            day = 1 if hashlib.blake2b(row["id"].encode(), digest_size=8).digest()[0] < 256 * 0.2 else 0
            parts[day].append({"click": int(row["click"]), "hour": int(row["hour"]),
                               **{name: row[name] for name in AVAZU_IDS}})  # fmt: skip
    for day, rows in parts.items():
        _write(out / f"day={day}", rows)
    return {"source": "parquet", "path": str(out), "partition": "day", "label": "click", "dense": ["hour"],
            "sparse": list(AVAZU_IDS), "train_days": [0], "eval_days": [1], "slice_feature": "site_category"}  # fmt: skip


def adult_warehouse(data_file: Path, out: Path) -> dict:
    """Adult's first rows as day=0 (80 %, training) and day=1 (20 %, evaluation); the `[data]` table."""
    with data_file.open() as handle:
        lines = [line for line in csv.reader(handle, skipinitialspace=True) if len(line) == len(ADULT_COLUMNS)]
    if lines and lines[0][0] == "age":
        lines = lines[1:]
    parts: dict[int, list[dict]] = {0: [], 1: []}
    for number, line in enumerate(lines[:ADULT_ROWS]):
        row = dict(zip(ADULT_COLUMNS, line, strict=True))
        day = 1 if hashlib.blake2b(str(number).encode(), digest_size=8).digest()[0] < 256 * 0.2 else 0
        parts[day].append({"income_over_50k": int(row["income"].startswith(">50K")),
                           **{name: float(row[name]) for name in ADULT_COUNTS},
                           **{name: row[name] for name in ADULT_IDS}})  # fmt: skip
    for day, rows in parts.items():
        _write(out / f"day={day}", rows)
    return {"source": "parquet", "path": str(out), "partition": "day", "label": "income_over_50k",
            "dense": list(ADULT_COUNTS), "sparse": list(ADULT_IDS), "train_days": [0], "eval_days": [1],
            "slice_feature": "sex"}  # fmt: skip


def movielens_warehouse(folder: Path, out: Path) -> dict:
    """MovieLens-100K's ratings as weekly partitions (a rating ≥ 4 is a click); the `[data]` table."""
    users = {u[0]: u for u in (line.rstrip("\n").split("|") for line in (folder / "u.user").open(encoding="latin-1"))}
    movies = {}
    for line in (folder / "u.item").open(encoding="latin-1"):
        item = line.rstrip("\n").split("|")
        year = item[2][-4:]
        movies[item[0]] = (int(year) if year.isdigit() else None, [g for g, on in enumerate(item[5:]) if on == "1"])
    ratings = [fields for fields in (line.split() for line in (folder / "u.data").open()) if len(fields) == 4]
    first = min(int(r[3]) for r in ratings)
    weeks: dict[int, list[dict]] = {}
    for user, movie, rating, stamp in ratings:
        week = (int(stamp) - first) // WEEK_S
        if week not in (*MOVIELENS_TRAIN_WEEKS, MOVIELENS_EVAL_WEEK):
            continue
        profile = users.get(user)
        year, genres = movies.get(movie, (None, []))
        weeks.setdefault(week, []).append({
            "liked": int(int(rating) >= 4), "user_id": int(user), "movie_id": int(movie),
            "gender": profile[2] if profile else None, "occupation": profile[3] if profile else None,
            "zip3": profile[4][:3] if profile else None, "genres": genres,
            "age": float(profile[1]) if profile else None, "release_year": float(year) if year else None,
        })  # fmt: skip
    for week, rows in weeks.items():
        _write(out / f"week={week}", rows)
    return {"source": "parquet", "path": str(out), "partition": "week", "label": "liked",
            "dense": ["age", "release_year"], "sparse": ["user_id", "movie_id", "gender", "occupation", "zip3", "genres"],
            "train_days": list(MOVIELENS_TRAIN_WEEKS), "eval_days": [MOVIELENS_EVAL_WEEK],
            "slice_feature": "occupation"}  # fmt: skip


def _write(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "part-0.parquet")


def config_text(name: str, run_dir: Path, data: dict) -> str:
    """A config that sets only where the data is: every other key at its shipped default."""
    slice_feature = data.pop("slice_feature")
    lines = [f'name = "{name}"', f'run_dir = "{run_dir}"', "", "[data]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in data.items()]
    return "\n".join([*lines, "", "[evaluation]", f'slice_feature = "{slice_feature}"', ""])


def run(config: Path, overrides: list[str], home: Path, as_of: int | None = None) -> dict:
    arguments = [a for o in overrides for a in ("--set", o)] + (["--as-of", str(as_of)] if as_of is not None else [])
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config), *arguments, "--json"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(home), "HOME": str(home),
                               "DLRM_DATA_DIRS": str(config.parent)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm run failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, type=Path, help="where avazu-10k.csv, ml-100k/ and adult.data are")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--only", default="avazu,movielens")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--keep", type=Path, help="keep the warehouses and run folders here (default: a temporary folder)")
    parser.add_argument("--nights", action="store_true",
                        help="MovieLens as recurring nights instead: weeks 7–18 from scratch (as of 19), then one "
                             "`dlrm run --as-of W` a week to 27, each continuing the newest model")  # fmt: skip
    args = parser.parse_args()
    if args.nights:
        return nights(args)
    builders = {"avazu": (args.folder / "avazu-10k.csv", avazu_warehouse),
                "movielens": (args.folder / "ml-100k", movielens_warehouse),
                "adult": (args.folder / "adult.data", adult_warehouse)}  # fmt: skip
    seeds = [int(s) for s in args.seeds.split(",")]
    results, started = {}, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="real-data-") as temporary:
        scratch = args.keep or temporary
        Path(scratch).mkdir(parents=True, exist_ok=True)
        for name in args.only.split(","):
            source, build = builders[name]
            if not source.exists():
                raise SystemExit(f"{source}: not found; bring the data to --folder (see this script's docstring)")
            root = Path(scratch) / name
            config = root / "config.toml"
            root.mkdir(exist_ok=True)
            config.write_text(config_text(name, root / "run", build(source, root / "warehouse")))
            runs = [run(config, [f'run_dir="{root}/run-{seed}"', f"training.seed={seed}", *args.overrides],
                        Path(scratch) / "home") for seed in seeds]  # fmt: skip
            results[name] = summarise(runs, seeds)
            show(name, results[name])
    print(json.dumps({"datasets": results, "overrides": args.overrides, "seconds": round(time.perf_counter() - started, 1)}))


def nights(args: argparse.Namespace) -> None:
    """MovieLens's weeks as nights (`--nights`): what each night trained and served, per seed;
    last, one JSON line with every night and, per seed, the mean NE of the nights that trained
    and the last night's (week 27, the single run's judged week)."""
    seeds, results, started = [int(s) for s in args.seeds.split(",")], {}, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="real-nights-") as temporary:
        root = Path(args.keep or temporary) / "movielens-nights"
        root.mkdir(parents=True, exist_ok=True)
        data = movielens_warehouse(args.folder / "ml-100k", root / "warehouse")
        data.update(train_days=list(range(MOVIELENS_TRAIN_WEEKS.start, NIGHTS_FROM)), eval_days=[NIGHTS_FROM])
        config = root / "config.toml"
        config.write_text(config_text("movielens-nights", root / "run", data))
        for seed in seeds:
            overrides = [f'run_dir="{root}/run-{seed}"', f"training.seed={seed}", 'orchestration.continue_from="latest"',
                         *args.overrides]  # fmt: skip
            chain = [night_row(run(config, overrides, root / "home", week))
                     for week in range(NIGHTS_FROM, MOVIELENS_EVAL_WEEK + 1)]  # fmt: skip
            trained = [n["eval_ne"] for n in chain if n["trained"]]
            refused = sum(n["trained"] and not n["promoted"] for n in chain)
            served = [n["served_ne"] for n in chain[1:] if n["served_ne"] is not None]  # after the first model
            results[seed] = {"nights": chain, "trained_nights": len(trained), "mean_ne_trained": statistics.fmean(trained),
                             "mean_served_ne": statistics.fmean(served) if served else None, "served_weeks": len(served),
                             "last_ne": chain[-1]["eval_ne"], "refused": refused}  # fmt: skip
            for n in chain:
                served = f"; served NE {n['served_ne']:.4f}" if n["served_ne"] is not None else ""
                print(f"seed {seed} week {n['as_of']}: " + (f"NE {n['eval_ne']:.4f} calibration {n['calibration']:.3f} "
                      f"{n['rows_trained']:,} rows {n['steps']} steps {'promoted' if n['promoted'] else 'refused'}"
                      if n["trained"] else n["skip_reason"][:60]) + served, flush=True)  # fmt: skip
    print(json.dumps({"nights": results, "overrides": args.overrides, "seconds": round(time.perf_counter() - started, 1)}))


def night_row(summary: dict) -> dict:
    """One night: what it trained, and `served_ne`, the NE on its day of the model served after
    it (the new model if promoted, else the champion; a waiting night's is the champion's)."""
    if summary.get("skipped"):
        return {"as_of": summary["as_of"], "trained": False, "skip_reason": summary["skip_reason"],
                "eval_ne": summary.get("eval_ne"), "served_ne": summary.get("eval_ne"), "promoted": False}  # fmt: skip
    served = summary["eval_ne"] if summary["promoted"] else summary.get("champion_ne_same_days")
    return {"as_of": summary["as_of"], "trained": True, "days": summary["days_trained"], "eval_ne": summary["eval_ne"],
            "served_ne": served, "calibration": summary["eval_calibration"], "rows_trained": summary["rows_trained"],
            "steps": summary["steps"], "promoted": summary["promoted"],
            "logistic_regression_ne": summary["logistic_regression_ne"]}  # fmt: skip


def summarise(runs: list[dict], seeds: list[int]) -> dict:
    ne = [r["eval_ne"] for r in runs]
    reference = [r["logistic_regression_ne"] for r in runs]
    return {
        "seeds": seeds, "eval_ne": ne, "eval_ne_mean": statistics.fmean(ne), "spread": (max(ne) - min(ne)) / min(ne),
        "eval_ne_uncalibrated": [r["eval_ne_uncalibrated"] for r in runs if "eval_ne_uncalibrated" in r],
        "logistic_regression_ne": reference, "constant_ne": runs[0]["baseline_constant_ne"],
        "calibration": [r["eval_calibration"] for r in runs], "calibrator": [r["calibrator"] for r in runs],
        "rows_trained": [r["rows_trained"] for r in runs], "steps": [r["steps"] for r in runs],
        "global_batch_size": [r["global_batch_size"] for r in runs],
        "beats_regression": sum(m < lr for m, lr in zip(ne, reference, strict=True)), "promoted": [r["promoted"] for r in runs],
    }  # fmt: skip


def show(name: str, result: dict) -> None:
    print(f"{name}: model NE {', '.join(f'{v:.4f}' for v in result['eval_ne'])} (seeds {result['seeds']}; spread "
          f"{100 * result['spread']:.2f} %), logistic regression {statistics.fmean(result['logistic_regression_ne']):.4f}, "
          f"constant {result['constant_ne']:.4f}; calibration {', '.join(f'{c:.3f}' for c in result['calibration'])}; "
          f"{result['beats_regression']} of {len(result['eval_ne'])} beat the regression", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
