"""The GPU path, timed: this trainer on CUDA against TorchRec's stock DLRM training loop.

One generated day, one model shape (26 tables of 100k rows × dim 64, bottom MLP 13-512-256-64,
top MLP 512-256-1), the same global batch, the same optimizers (row-wise Adagrad fused into
the embeddings' backward, fused Adam for the MLPs), pinned batches and a table-wise plan of
fused tables in GPU memory:

(a) this trainer, each variant a real torchrun job (training.launch.launcher) over every visible
    GPU, NCCL, the steps `pipeline = "auto"` picks (plain steps with the dense part replayed
    as CUDA graphs on one GPU, `TrainPipelineSparseDist` on several):
    fused tables in GPU memory (fp32, and bf16), tables in host memory with a GPU cache
    (fused_uvm_caching), and row-wise sharding where there are 2+ GPUs;
(b) TorchRec's stock loop on GPU 0: `DLRMTrain` in `DistributedModelParallel`, the planner held
    to the same plan, `TrainPipelineSparseDist`; against (a)'s fp32 fused variant on one GPU.

Both are timed after WARMUP_STEPS steps (allocation, kernel selection, caches), between two
points where the host has waited for the GPU: the trainer from its metrics records (each
logged step all-reduces the NE sums and reads them back), the stock loop with
`torch.cuda.synchronize`. Without a GPU the script runs what the host can (fp32 on the CPU,
the stock loop with plain steps) so that it is exercised anywhere; only a GPU host gives GPU
figures (`device` in the output says which it was).
Prints one JSON line last: per-variant samples/s, the stock loop's, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evaluation.config import EvaluationConfig
from ingestion.config import PreprocessConfig, SyntheticConfig
from ingestion.preprocess import apply_state, fit_state
from ingestion.reader import build_reader
from ingestion.schema import SPARSE_COLUMNS
from ingestion.synthetic import generate_day
from ingestion.warehouse import ingest_day
from training.codec import encode
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.device import device_memory_bytes
from training.launch.launcher import launch
from training.loop.progress import read_records
from training.model.precision import allow_tf32
from training.worker import exit_skipping_teardown

TABLE_ROWS = 100_000
MODEL = ModelConfig(embedding_dim=64, bottom_mlp=(512, 256, 64), top_mlp=(512, 256, 1))
LR = {"embedding_lr": 0.05, "dense_lr": 0.001}  # dense: Adam's
EPS = 1e-8
WARMUP_STEPS = 20


def prepare(folder: Path, rows: int) -> list[str]:
    config = SyntheticConfig(rows_per_day=rows, seed=5, cardinality_scale=0.05)
    generate_day(config, 0, folder / "raw")
    ingest_day([str(folder / "raw" / "day_0.tsv.gz")], 0, folder / "warehouse")
    preprocess = PreprocessConfig(hash_size=TABLE_ROWS)
    state = fit_state(preprocess, folder / "warehouse", folder / "features", (0,))
    written = apply_state(preprocess, state, folder / "warehouse", folder / "features", 0)
    return [str(p) for p in sorted(written.glob("*.parquet"))]


def variants(gpus: int) -> dict[str, tuple[int, ShardingConfig, str]]:
    """name → (processes, sharding, precision)."""
    if gpus == 0:
        return {"cpu_fp32": (1, ShardingConfig(sharding_type="table_wise", compute_kernel="fused"), "fp32")}
    fused = ShardingConfig(sharding_type="table_wise", compute_kernel="fused")
    chosen = {
        "fused_hbm_fp32": (gpus, fused, "fp32"),
        "fused_hbm_bf16": (gpus, fused, "bf16"),
        "uvm_caching_fp32": (gpus, ShardingConfig(sharding_type="table_wise", compute_kernel="fused_uvm_caching"), "fp32"),
    }
    if gpus >= 2:
        chosen["one_gpu_fp32"] = (1, fused, "fp32")
        chosen["row_wise_fp32"] = (gpus, ShardingConfig(sharding_type="row_wise", compute_kernel="fused"), "fp32")
    return chosen


def one_gpu_variant(gpus: int) -> str:
    return "cpu_fp32" if gpus == 0 else "fused_hbm_fp32" if gpus == 1 else "one_gpu_fp32"


def this_trainer(files: list[str], folder: Path, name: str, nproc: int, sharding: ShardingConfig,
                 precision: str, batch: int, device: str) -> dict:  # fmt: skip
    job = TrainJob(
        model=MODEL,
        sharding=sharding,
        training=TrainingConfig(nproc=nproc, batch_size=batch, device=device, precision=precision,
                                log_every=WARMUP_STEPS, min_steps=0, dense_optimizer="adam", embedding_eps=EPS,
                                **LR),
        evaluation=EvaluationConfig(batch_size=8192, heldout_every_steps=0),
        table_sizes={feature: TABLE_ROWS for feature in SPARSE_COLUMNS},
        train_files=tuple(files),
        eval_files={"0": tuple(files[:1])},
        out_dir=str(folder / name),
    )
    launch(job, on_line=lambda line: None)
    summary = encode(job.folder.read_summary())
    summary["steady_samples_per_s"] = steady_rate(job)
    return summary


def steady_rate(job: TrainJob) -> float:
    """Samples/s from the first logged step (WARMUP_STEPS) to the last: both points waited
    for the device (the logged NE sums are all-reduced and read back)."""
    records = [r for r in read_records(job.folder.metrics) if r.kind == "train"]
    first, last = records[0], records[-1]
    if last.step == first.step:
        return 0.0
    return (last.samples_seen - first.samples_seen) / (last.elapsed_s - first.elapsed_s)


def stock_loop(files: list[str], batch: int, device: torch.device, steps: int) -> float:
    """TorchRec's own DLRM training loop in this process on `device`; samples/s after the warm-up."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29517"), RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        allow_tf32(device)
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=MODEL.embedding_dim, num_embeddings=TABLE_ROWS,
                                     feature_names=[f]) for f in SPARSE_COLUMNS]  # fmt: skip
        model = DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                               dense_in_features=13, dense_arch_layer_sizes=list(MODEL.bottom_mlp),
                               over_arch_layer_sizes=list(MODEL.top_mlp), dense_device=device))  # fmt: skip
        apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(),
                                    {"lr": LR["embedding_lr"], "eps": EPS})  # fmt: skip
        same_plan = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in tables}
        topology = Topology(world_size=1, compute_device=device.type,
                            hbm_cap=device_memory_bytes(device) if device.type == "cuda" else None)  # fmt: skip
        plan = EmbeddingShardingPlanner(topology=topology, constraints=same_plan).plan(
            model, get_default_sharders())  # type: ignore[arg-type]
        sharded = DistributedModelParallel(model, device=device, plan=plan)
        fused = device.type == "cuda"  # torch's fused Adam runs on CUDA (and CPU)
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(sharded.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=LR["dense_lr"], fused=fused))  # fmt: skip
        optimizer = CombinedOptimizer([sharded.fused_optimizer, dense])
        reader = build_reader(files, batch, 0, 1, drop_remainder=True, prefetch=4)
        seconds = timed_stock_steps(sharded, optimizer, iter(reader), device, WARMUP_STEPS, steps - WARMUP_STEPS)
        return batch * (steps - WARMUP_STEPS) / seconds
    finally:
        dist.destroy_process_group()


def timed_stock_steps(model, optimizer, batches: Iterator[Batch], device: torch.device, warmup: int, timed: int) -> float:
    """TorchRec's stock loop as its examples write it (read, move, forward, zero_grad, backward,
    step; `TrainPipelineSparseDist` on CUDA, batches pinned): `warmup` steps, then the seconds
    of `timed` more, the device waited for at both ends. bench/step_overhead.py times it too."""
    if device.type == "cuda":
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(model, optimizer, device)
        pinned = (b.pin_memory() for b in batches)
        step: Callable[[], object] = lambda: pipeline.progress(pinned)
    else:
        def step() -> None:
            loss, _ = model(next(batches).to(device, non_blocking=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for _ in range(warmup):
        step()
    sync(device)
    started = time.perf_counter()
    for _ in range(timed):
        step()
    sync(device)
    elapsed = time.perf_counter() - started
    if device.type == "cuda":
        pipeline.detach()  # the model's own forwards again, for whatever runs next on it
    return elapsed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(rows: int, batch: int, only: tuple[str, ...] = ()) -> dict:
    if rows // batch < 2 * WARMUP_STEPS:
        raise SystemExit(f"--rows {rows:,} gives {rows // batch} steps of {batch:,}: give at least "
                         f"{2 * WARMUP_STEPS * batch:,} rows (twice the {WARMUP_STEPS} warm-up steps)")  # fmt: skip
    gpus = torch.cuda.device_count()
    device = "cuda" if gpus else "cpu"
    figures: dict = {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus, "global_batch": batch,
                     "rows": rows, "warmup_steps": WARMUP_STEPS}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = prepare(folder, rows)
        for name, (nproc, sharding, precision) in variants(gpus).items():
            if only and name not in only and name != one_gpu_variant(gpus):
                continue
            summary = this_trainer(files, folder, name, nproc, sharding, precision, batch, device)
            figures[f"{name}_samples_per_s"] = round(summary["steady_samples_per_s"])
            print(f"{name}: {summary['steady_samples_per_s']:,.0f} samples/s ({summary['steps']} steps, "
                  f"{summary['world_size']} processes, {summary['pipeline']}, {summary['precision']})", flush=True)  # fmt: skip
        steps = rows // batch
        stock = stock_loop(files, batch, torch.device(device, 0) if gpus else torch.device("cpu"), steps)
        print(f"TorchRec's stock loop: {stock:,.0f} samples/s ({steps} steps)", flush=True)
    mine = figures[f"{one_gpu_variant(gpus)}_samples_per_s"]
    figures.update(stock_torchrec_samples_per_s=round(stock), ratio_vs_stock=round(mine / stock, 3))
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000, help="rows of the generated day")
    parser.add_argument("--batch", type=int, default=8192, help="global batch size")
    parser.add_argument("--only", default="", help="comma-separated variants (the one-GPU fp32 one always runs)")
    args = parser.parse_args()
    print(json.dumps(main(args.rows, args.batch, tuple(filter(None, args.only.split(","))))))
    exit_skipping_teardown()  # as the trainer's workers leave: gloo's threads outlive the destroy
