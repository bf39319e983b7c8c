"""Which categorical pairs a logistic regression should cross, chosen from the data, and what
crossing them is worth: the plain regression against the regression with the chosen crosses
(and, with `--all-pairs`, with every pair crossed), each with its L2 chosen by 5-fold
cross-validation, judged by NE on the held-out rows.

    .venv/bin/python bench/chosen_crosses.py [--folder DIR] [--only tiny,small-real,avazu,movielens]
        [--family-p 0.05] [--most 12] [--all-pairs]

`tiny` and `small-real` are those configs' generated days (their training days against
their evaluation days); the generator makes some categorical pairs interact through latent
vectors, which a plain regression cannot learn (small-real's ids are mostly seen once).
`avazu` and `movielens` are the public samples of bench/real_data.py, read from DIR (kept
outside the repository) and split as that bench splits them.

A pair is scored against the plain regression's out-of-fold predictions p by the score test
of ingestion/crosses.py: over the pair's values seen at least 5 times, Σ_value (Σ (y − p))² /
Σ p(1 − p), about χ² with one degree of freedom a value when the pair adds nothing. Pairs
whose χ² tail times the pairs scored is at most `--family-p` are crossed, the `--most`
strongest (`crosses.chosen_pairs`, as a run chooses). Scikit-learn fits the regressions: this
bench measures the idea, not the project's reference.

It prints a table per dataset and, last, one JSON line: for each dataset the plain
regression's NE, the chosen pairs, the crossed regression's NE and its change.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import scipy.sparse as sp
from real_data import avazu_warehouse, movielens_warehouse  # bench/, the script's own folder
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from evaluation.metrics import binary_state, compute_ne
from flows.run.config import load_config
from ingestion import crosses
from ingestion.synthetic import GroundTruth, generate_day

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {"tiny": "tiny.toml", "small-real": "small-real.toml"}
C_GRID = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
FOLDS = 5
MIN_COUNT = crosses.MIN_COUNT  # a pair's value counts toward its score once seen this often


class Split:
    """Training and held-out rows: labels, categorical values (strings), dense values."""

    def __init__(self, names: list[str], train: tuple, held_out: tuple) -> None:
        self.names = names
        (self.y, self.cats, self.dense), (self.y_out, self.cats_out, self.dense_out) = train, held_out


def generated_split(config_file: str, scratch: Path) -> tuple[Split, list[tuple[int, int]]]:
    """A config's generated days (its training days against its evaluation days), and the
    pairs the generator makes interact."""
    config = load_config(ROOT / "configs" / config_file)
    synthetic = config.data.synthetic
    truth = GroundTruth(synthetic)
    scratch.mkdir(parents=True, exist_ok=True)
    days = {}
    for day in (*config.data.train_days, *config.data.eval_days):
        generate_day(synthetic, day, scratch, truth)
        with gzip.open(scratch / f"day_{day}.tsv.gz", "rt") as handle:
            days[day] = [line.rstrip("\n").split("\t") for line in handle]

    def parse(rows: list[list[str]]) -> tuple:
        labels = np.array([int(r[0]) for r in rows])
        dense = np.array([[np.log1p(max(int(v), 0)) if v else 0.0 for v in r[1:14]] for r in rows])
        return labels, np.array([r[14:40] for r in rows], dtype=object), dense

    train = parse([row for day in config.data.train_days for row in days[day]])
    held_out = parse([row for day in config.data.eval_days for row in days[day]])
    return Split([f"C{i + 1}" for i in range(26)], train, held_out), sorted({tuple(sorted(p)) for p in truth.pairs})


def warehouse_split(data: dict) -> Split:
    """A bench/real_data.py warehouse: its training partitions against its judged ones."""

    def read(days: list[int]) -> tuple:
        tables = [pq.read_table(path) for day in days
                  for path in sorted(Path(data["path"]).glob(f"{data['partition']}={day}/*.parquet"))]  # fmt: skip
        rows = [row for table in tables for row in table.to_pylist()]
        labels = np.array([int(row[data["label"]]) for row in rows])
        cats = np.array([[_as_text(row[name]) for name in data["sparse"]] for row in rows], dtype=object)
        dense = np.array([[row[name] if row[name] is not None else 0.0 for name in data["dense"]] for row in rows], float)
        return labels, cats, dense

    return Split(list(data["sparse"]), read(data["train_days"]), read(data["eval_days"]))


def _as_text(value: object) -> str:
    return ",".join(str(v) for v in sorted(value)) if isinstance(value, list) else str(value)


def normalized_entropy(labels: np.ndarray, p: np.ndarray) -> float:
    return compute_ne(binary_state(labels, p))


def folds_of(rows: int) -> list[np.ndarray]:
    order = np.random.default_rng(0).permutation(rows)
    return np.array_split(order, FOLDS)


def fit_by_cv(x: sp.csr_matrix, y: np.ndarray, folds: list[np.ndarray]) -> tuple[float, np.ndarray, LogisticRegression]:
    """The C of C_GRID with the lowest mean out-of-fold NE, that C's out-of-fold predictions,
    and the regression refitted on every row."""
    best: tuple[float, float, np.ndarray] | None = None
    for c in C_GRID:
        out_of_fold = np.zeros(len(y))
        for fold in folds:
            keep = np.ones(len(y), bool)
            keep[fold] = False
            model = LogisticRegression(C=c, max_iter=1000, tol=1e-4).fit(x[keep], y[keep])
            out_of_fold[fold] = model.predict_proba(x[fold])[:, 1]
        score = normalized_entropy(y, out_of_fold)
        if best is None or score < best[0]:
            best = (score, c, out_of_fold)
    assert best is not None
    return best[1], best[2], LogisticRegression(C=best[1], max_iter=1000, tol=1e-4).fit(x, y)


def pair_scores(split: Split, out_of_fold: np.ndarray) -> list[crosses.PairScore]:
    """Every pair of categorical columns scored, strongest first (ingestion/crosses.py)."""
    codes = np.stack([np.unique(split.cats[:, column].astype(str), return_inverse=True)[1].reshape(-1)
                      for column in range(split.cats.shape[1])], axis=1)  # fmt: skip
    return crosses.pair_scores(codes, split.y, out_of_fold, MIN_COUNT)


def _crossed(cats: np.ndarray, a: int, b: int) -> np.ndarray:
    return np.char.add(np.char.add(cats[:, a].astype(str), "\x1f"), cats[:, b].astype(str))


def design(split: Split, pairs: list[tuple[int, int]]) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """One-hot columns (values seen at least twice) for each column and each crossed pair,
    and the dense values standardized."""
    train = [split.cats] + [_crossed(split.cats, a, b)[:, None] for a, b in pairs]
    held_out = [split.cats_out] + [_crossed(split.cats_out, a, b)[:, None] for a, b in pairs]
    encoder = OneHotEncoder(handle_unknown="ignore", min_frequency=2).fit(np.hstack(train))
    scaler = StandardScaler().fit(split.dense)
    x = sp.hstack([encoder.transform(np.hstack(train)), sp.csr_matrix(scaler.transform(split.dense))]).tocsr()
    x_out = sp.hstack([encoder.transform(np.hstack(held_out)), sp.csr_matrix(scaler.transform(split.dense_out))]).tocsr()
    return x, x_out


def measure(name: str, split: Split, family_p: float, most: int, all_pairs: bool, known: list | None) -> dict:
    began = time.monotonic()
    folds = folds_of(len(split.y))
    x, x_out = design(split, [])
    c_plain, out_of_fold, plain = fit_by_cv(x, split.y, folds)
    plain_ne = normalized_entropy(split.y_out, plain.predict_proba(x_out)[:, 1])
    scores = pair_scores(split, out_of_fold)
    chosen = crosses.chosen_pairs(scores, family_p, most)
    result = {"rows": len(split.y), "held_out_rows": len(split.y_out), "plain_ne": round(plain_ne, 5), "plain_c": c_plain,
              "chosen": [f"{split.names[a]}×{split.names[b]}" for a, b in chosen],
              "top_scores": [[f"{split.names[s.first]}×{split.names[s.second]}", round(s.z, 1), s.values,
                              float(f"{s.p * len(scores):.2g}")] for s in scores[:8]]}  # fmt: skip
    if known is not None:
        ranks = [i for i, s in enumerate(scores) if (s.first, s.second) in set(known)]
        result["generator_pairs_ranked"] = ranks
    if chosen:
        xc, xc_out = design(split, chosen)
        c_crossed, _, crossed = fit_by_cv(xc, split.y, folds)
        crossed_ne = normalized_entropy(split.y_out, crossed.predict_proba(xc_out)[:, 1])
        result.update(crossed_ne=round(crossed_ne, 5), crossed_c=c_crossed)
    else:
        result.update(crossed_ne=round(plain_ne, 5), crossed_c=c_plain)
    result["change"] = round(result["crossed_ne"] / plain_ne - 1, 4)
    if all_pairs:
        every = [(s.first, s.second) for s in scores]
        xa, xa_out = design(split, every)
        _, _, crossed_all = fit_by_cv(xa, split.y, folds)
        result["all_pairs_ne"] = round(normalized_entropy(split.y_out, crossed_all.predict_proba(xa_out)[:, 1]), 5)
    result["seconds"] = round(time.monotonic() - began, 1)
    return result


def show(name: str, result: dict) -> None:
    print(f"\n{name}: {result['rows']} rows to train, {result['held_out_rows']} judged")
    print(f"  plain regression            NE {result['plain_ne']:.5f}  (C {result['plain_c']})")
    print(f"  with chosen crosses         NE {result['crossed_ne']:.5f}  (C {result['crossed_c']}; "
          f"{100 * result['change']:+.2f} %)  {', '.join(result['chosen']) or 'none chosen'}")  # fmt: skip
    if "all_pairs_ne" in result:
        print(f"  with every pair crossed     NE {result['all_pairs_ne']:.5f}")
    print("  strongest pairs (z, values, χ² tail × pairs scored): "
          + ", ".join(f"{pair} {z} {values} {family}" for pair, z, values, family in result["top_scores"]))
    if "generator_pairs_ranked" in result:
        print(f"  the generator's pairs rank {result['generator_pairs_ranked']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, help="where avazu-10k.csv and ml-100k/ are (bench/real_data.py)")
    parser.add_argument("--only", default="tiny,small-real,avazu,movielens")
    parser.add_argument("--family-p", type=float, default=crosses.FAMILY_P,
                        help="the largest χ² tail, times the pairs scored, a pair is crossed at")
    parser.add_argument("--most", type=int, default=12, help="at most this many pairs crossed")
    parser.add_argument("--all-pairs", action="store_true", help="also fit the regression with every pair crossed")
    args = parser.parse_args()
    wanted = args.only.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch_dir = Path(scratch)
        for name, config_file in GENERATED.items():
            if name in wanted:
                split, known = generated_split(config_file, scratch_dir / name)
                results[name] = measure(name, split, args.family_p, args.most, args.all_pairs, known)
                show(name, results[name])
        for name, build, source in (("avazu", avazu_warehouse, "avazu-10k.csv"), ("movielens", movielens_warehouse, "ml-100k")):
            if name not in wanted:
                continue
            if args.folder is None or not (args.folder / source).exists():
                raise SystemExit(f"{name}: {source} not found; pass --folder DIR holding it (bench/real_data.py)")
            split = warehouse_split(build(args.folder / source, scratch_dir / name))
            results[name] = measure(name, split, args.family_p, args.most, args.all_pairs, None)
            show(name, results[name])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
