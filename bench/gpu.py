"""The GPU path, timed: this trainer on CUDA against TorchRec's stock DLRM training loop.

One generated day, one model shape (26 tables of 100k rows × dim 64, bottom MLP 13-512-256-64,
top MLP 512-256-1), the same global batch:

(a) this trainer, each variant a real torchrun job (training.launch.launcher) over every visible
    GPU, NCCL, `TrainPipelineSparseDist` (pipeline = "auto"):
    fused tables in GPU memory (fp32, and bf16), tables in host memory with a GPU cache
    (fused_uvm_caching), and row-wise sharding where there are 2+ GPUs;
(b) TorchRec's stock loop on GPU 0: `DLRMTrain` in `DistributedModelParallel` with the default
    planner and sharders, fused row-wise Adagrad applied in backward, dense Adagrad,
    `TrainPipelineSparseDist`; against (a)'s fp32 fused variant on one GPU.

Both are timed from their second step on the same batches. Without a GPU the script runs
what the host can (fp32 on the CPU, the stock loop with plain steps) so that it is exercised
anywhere; only a GPU host gives GPU figures (`device` in the output says which it was).
Prints one JSON line last: per-variant samples/s, the stock loop's, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

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
from training.launch.launcher import launch

TABLE_ROWS = 100_000
MODEL = ModelConfig(embedding_dim=64, bottom_mlp=(512, 256, 64), top_mlp=(512, 256, 1))
LR = {"embedding_lr": 0.05, "dense_lr": 0.05}


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
        return {"cpu_fp32": (1, ShardingConfig(), "fp32")}
    chosen = {
        "fused_hbm_fp32": (gpus, ShardingConfig(sharding_type="table_wise", compute_kernel="fused"), "fp32"),
        "fused_hbm_bf16": (gpus, ShardingConfig(sharding_type="table_wise", compute_kernel="fused"), "bf16"),
        "uvm_caching_fp32": (gpus, ShardingConfig(sharding_type="table_wise", compute_kernel="fused_uvm_caching"), "fp32"),
        "one_gpu_fp32": (1, ShardingConfig(sharding_type="table_wise", compute_kernel="fused"), "fp32"),
    }
    if gpus >= 2:
        chosen["row_wise_fp32"] = (gpus, ShardingConfig(sharding_type="row_wise", compute_kernel="fused"), "fp32")
    return chosen


def this_trainer(files: list[str], folder: Path, name: str, nproc: int, sharding: ShardingConfig,
                 precision: str, batch: int, device: str) -> dict:  # fmt: skip
    job = TrainJob(
        model=MODEL,
        sharding=sharding,
        training=TrainingConfig(nproc=nproc, batch_size=batch, device=device, precision=precision, log_every=50,
                                min_steps=0, **LR),
        evaluation=EvaluationConfig(batch_size=8192, heldout_every_steps=0),
        table_sizes={feature: TABLE_ROWS for feature in SPARSE_COLUMNS},
        train_files=tuple(files),
        eval_files={"0": tuple(files[:1])},
        out_dir=str(folder / name),
    )
    launch(job, on_line=lambda line: None)
    return encode(job.folder.read_summary())


def stock_loop(files: list[str], batch: int, device: torch.device, steps: int) -> float:
    """TorchRec's own DLRM training loop in this process on `device`; samples/s from step 2."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
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
        tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=MODEL.embedding_dim, num_embeddings=TABLE_ROWS,
                                     feature_names=[f]) for f in SPARSE_COLUMNS]  # fmt: skip
        model = DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                               dense_in_features=13, dense_arch_layer_sizes=list(MODEL.bottom_mlp),
                               over_arch_layer_sizes=list(MODEL.top_mlp), dense_device=device))  # fmt: skip
        apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": LR["embedding_lr"]})
        sharded = DistributedModelParallel(model, device=device)
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(sharded.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params, lr=LR["dense_lr"]))  # fmt: skip
        optimizer = CombinedOptimizer([sharded.fused_optimizer, dense])
        batches = iter(build_reader(files, batch, 0, 1, drop_remainder=True))
        if device.type == "cuda":
            pipeline = TrainPipelineSparseDist(sharded, optimizer, device)
            step = lambda: pipeline.progress(batches)
        else:
            def step():
                loss, _ = sharded(next(batches))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        step()  # warm-up: allocation, kernel selection
        _sync(device)
        started = time.perf_counter()
        for _ in range(steps - 1):
            step()
        _sync(device)
        return batch * (steps - 1) / (time.perf_counter() - started)
    finally:
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(rows: int, batch: int) -> dict:
    gpus = torch.cuda.device_count()
    device = "cuda" if gpus else "cpu"
    figures: dict = {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus, "global_batch": batch}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = prepare(folder, rows)
        for name, (nproc, sharding, precision) in variants(gpus).items():
            summary = this_trainer(files, folder, name, nproc, sharding, precision, batch, device)
            figures[f"{name}_samples_per_s"] = round(summary["samples_per_s"])
            print(f"{name}: {summary['samples_per_s']:,.0f} samples/s ({summary['steps']} steps, "
                  f"{summary['world_size']} processes, {summary['pipeline']})", flush=True)  # fmt: skip
        steps = min(200, rows // batch)
        stock = stock_loop(files, batch, torch.device(device, 0) if gpus else torch.device("cpu"), steps)
    mine = figures["one_gpu_fp32_samples_per_s" if gpus else "cpu_fp32_samples_per_s"]
    figures.update(stock_torchrec_samples_per_s=round(stock), ratio_vs_stock=round(mine / stock, 3))
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the generated day")
    parser.add_argument("--batch", type=int, default=8192, help="global batch size")
    args = parser.parse_args()
    print(json.dumps(main(args.rows, args.batch)))
