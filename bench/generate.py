"""Synthetic Criteo-format generation speed (target: ≥ 200k rows/s on this machine).

Prints progress, then its figures last as one JSON line: rows, seconds, rows_per_s.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingestion.config import SyntheticConfig
from ingestion.synthetic import GroundTruth, generate_day


def main(rows: int = 1_000_000) -> dict[str, float]:
    config = SyntheticConfig(rows_per_day=rows, seed=7, cardinality_scale=0.05)
    truth = GroundTruth(config)  # built once per run, outside the timed part
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        stats = generate_day(config, 0, Path(folder), truth)
        seconds = time.perf_counter() - started
        size = (Path(folder) / "day_0.tsv.gz").stat().st_size
    print(f"generated {stats.rows:,} rows ({size / 2**20:.0f} MiB gzip) in {seconds:.2f} s; "
          f"click rate {stats.click_rate:.3f}, Bayes-optimal NE {stats.bayes_ne:.4f}")
    return {"rows": stats.rows, "seconds": round(seconds, 3), "rows_per_s": round(stats.rows / seconds)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)))
