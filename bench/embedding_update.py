"""The embeddings' fused row-wise Adagrad on CPU: fbgemm's JIT kernel against this project's
vectorised one (training/cpu/rowwise_adagrad.py) and native one (training/cpu/native_rowwise_adagrad.py),
on the same module and the same batches.

fbgemm's table-batched module of the throughput benchmark's shape (26 tables of 100k rows ×
dim 16, batch 2048, one id per table and example), forward + backward with the update, in
turns of 10 steps of each kernel, best of 5 turns. Two kinds of batch:
  - `bench`: the throughput benchmark's own batches (categorical ids that repeat a lot: about
    5.6k distinct rows in a batch's 53k ids);
  - `uniform`: ids drawn uniformly over each table (about 53k distinct rows), as hashed ids of
    high-cardinality features are.
The forward alone is timed too, so the backward's share is known.

Prints its figures last as one JSON line: per kind of batch, each kernel's step in ms and
the speedup of each of this project's backwards (with the update) over fbgemm's.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from train_throughput import BATCH, MODEL, TABLE_ROWS, embedding_module, id_batches, prepare

from ingestion.schema import SPARSE_COLUMNS
from training.cpu import embedding_update

Batch = tuple[torch.Tensor, torch.Tensor]


def uniform_batches() -> list[Batch]:
    generator = torch.Generator().manual_seed(0)
    ids = len(SPARSE_COLUMNS) * BATCH
    return [(torch.randint(0, TABLE_ROWS, (ids,), generator=generator), torch.arange(ids + 1)) for _ in range(20)]


def distinct_rows(batch: Batch) -> int:
    ids = batch[0].view(len(SPARSE_COLUMNS), BATCH)
    return sum(int(row.unique().numel()) for row in ids)


def best_ms(step: Callable[[], None], prepare_turn: Callable[[], None], turns: int = 5, steps: int = 10) -> float:
    best = float("inf")
    for _ in range(turns):
        prepare_turn()
        step()  # warm
        started = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - started) / steps)
    return best * 1e3


def compare(batches: list[Batch]) -> dict[str, float]:
    module = embedding_module()
    grad = torch.randn(BATCH, len(SPARSE_COLUMNS) * MODEL.embedding_dim)
    cycle = itertools.cycle(batches)

    def train() -> None:
        module(*next(cycle)).backward(grad)

    def forward() -> None:
        with torch.no_grad():
            module(*next(cycle))

    kernels = ("fbgemm", "vectorized", "native")
    times: dict[str, list[float]] = {name: [] for name in ("forward", *kernels)}
    for _ in range(2):  # in turns, so a busy moment of a shared machine hits all alike
        for kernel in kernels:
            times[kernel].append(best_ms(train, functools.partial(embedding_update.use, kernel)))
        times["forward"].append(best_ms(forward, lambda: None))
    embedding_update.use("fbgemm")
    best = {name: min(values) for name, values in times.items()}
    backward = {name: best[name] - best["forward"] for name in kernels}
    return {
        "distinct_rows": sum(map(distinct_rows, batches)) / len(batches),
        "forward_ms": round(best["forward"], 3),
        **{f"{kernel}_step_ms": round(best[kernel], 3) for kernel in kernels},
        "vectorized_backward_speedup": round(backward["fbgemm"] / backward["vectorized"], 2),
        "native_backward_speedup": round(backward["fbgemm"] / backward["native"], 2),
    }


def main() -> dict[str, object]:
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        files = prepare(Path(tmp))
        kinds = {"bench": id_batches(files), "uniform": uniform_batches()}
        figures = {kind: compare(batches) for kind, batches in kinds.items()}
    for kind, f in figures.items():
        print(f"{kind} batches ({f['distinct_rows']:,.0f} distinct rows of {len(SPARSE_COLUMNS) * BATCH:,} ids): "
              f"forward {f['forward_ms']:.2f} ms; forward + backward with the update: fbgemm {f['fbgemm_step_ms']:.2f} ms, "
              f"vectorized {f['vectorized_step_ms']:.2f} ms, native {f['native_step_ms']:.2f} ms; backward over fbgemm's: "
              f"vectorized {f['vectorized_backward_speedup']:.2f}x, "
              f"native {f['native_backward_speedup']:.2f}x faster")  # fmt: skip
    return {f"{kind}_{key}": value for kind, f in figures.items() for key, value in f.items()}


if __name__ == "__main__":
    print(json.dumps(main()))
