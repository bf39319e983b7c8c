"""`dlrm evaluate` on a 10-million-row predictions file (target: under 10 s on this machine).

Times the command as a user runs it (a fresh process: start-up, Parquet read, every metric)
and checks its NE against a float64 numpy formula. Prints its figures last as one JSON line:
rows, seconds, seconds_metrics_only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evaluation.metrics import summarize


def make_predictions(path: Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    p = rng.beta(0.7, 2.2, rows).astype(np.float32)  # float32 scores: many exact ties, as in practice
    y = (rng.random(rows) < p).astype(np.int8)
    pq.write_table(pa.table({"label": y, "prediction": p}), path, compression="zstd")


def main(rows: int = 10_000_000) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "predictions.parquet"
        make_predictions(path, rows)
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "flows.cli", "evaluate", "--predictions", str(path), "--json"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        metrics = json.loads(result.stdout.strip().splitlines()[-1])
        table = pq.read_table(path)
        y, p = table["label"].to_numpy().astype(np.float64), table["prediction"].to_numpy().astype(np.float64)
        started = time.perf_counter()
        in_process = summarize(y, p)
        metrics_only = time.perf_counter() - started
    q = np.clip(p, 1e-12, 1 - 1e-12)
    ctr = y.mean()
    oracle_ne = -np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)) / -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    assert abs(metrics["ne"] - oracle_ne) < 1e-9 and abs(in_process["auc"] - metrics["auc"]) < 1e-12
    print(f"dlrm evaluate: {rows:,} rows in {seconds:.2f} s (metrics alone {metrics_only:.2f} s); "
          f"NE {metrics['ne']:.6f} (numpy {oracle_ne:.6f}), AUC {metrics['auc']:.6f}")
    return {"rows": rows, "seconds": round(seconds, 3), "seconds_metrics_only": round(metrics_only, 3)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000)))
