"""Where a GPU training step's time goes: the step alone, batches already in memory.

    .venv/bin/python bench/gpu_step_probe.py [--batches 8192,65536] [--steps 60] [--out DIR]

The throughput bench's model (26 tables of 100,000 rows × 64, MLPs 13-512-256-64 and
512-256-1, row-wise Adagrad fused into the tables' backward, fused Adam) on one process,
fed the same pinned batches from memory (no reader), so each figure is the step's own:

- stock:          TorchRec's `DLRMTrain` and `TrainPipelineSparseDist`, as its examples write it
- plain:          this trainer's model and plain steps (copy, forward, backward, dense step)
- pipelined:      this trainer's model and its sparse-dist pipeline (training/loop/steps.py)
- dot:            pipelined, with the dot interaction of training/cpu/interaction.py (gather
                  forward, scatter backward: no sort-based index_put)
- dot_graphed:    dot, with the dense part (bottom MLP, interaction, top MLP) replayed as
                  one CUDA graph forward and one backward (torch.cuda.make_graphed_callables)
- dot_compiled:   dot, each dense part under `torch.compile(mode="reduce-overhead")`
- trainer:        the model as the worker builds it (training/worker.py: on a GPU, the dot
                  interaction and, in a one-process job, the CUDA graphs), pipelined;
                  `trainer_plain` with plain steps, `trainer_eager` without the graphs,
                  `trainer_bf16` in bf16

For each variant and batch: ms per step (wall, the device waited for at both ends), the
device's busy ms per step (kernels and copies under the profiler), and the top kernels.
Then the reader alone (rows/s at each batch, one prefetch thread as the trainer reads).
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu import LR, MODEL, TABLE_ROWS, sync  # bench/gpu.py, beside this script

from evaluation.config import EvaluationConfig
from ingestion.schema import SPARSE_COLUMNS
from training.config import ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.loop.optimizers import attach_embedding_optimizer, build_optimizer
from training.loop.steps import PipelinedSteps, PlainSteps
from training.model.build import build_train_model, dlrms_in
from training.model.precision import allow_tf32
from training.sharding.plan import shard_model
from training.worker import exit_skipping_teardown

WARMUP = 15
IN_MEMORY = 6  # distinct batches cycled


def batches_in_memory(batch: int, device: torch.device) -> list[Batch]:
    generator = torch.Generator().manual_seed(3)
    made = []
    for _ in range(IN_MEMORY):
        ids = torch.randint(0, TABLE_ROWS, (len(SPARSE_COLUMNS) * batch,), generator=generator)
        kjt = KeyedJaggedTensor(keys=list(SPARSE_COLUMNS), values=ids,
                                lengths=torch.ones(len(SPARSE_COLUMNS) * batch, dtype=torch.int32), stride=batch)  # fmt: skip
        made.append(Batch(dense_features=torch.rand(batch, 13, generator=generator), sparse_features=kjt,
                          labels=(torch.rand(batch, generator=generator) < 0.25).float()))  # fmt: skip
    return [b.pin_memory() for b in made] if device.type == "cuda" else made


def cycle(items: list[Batch]) -> Iterator[Batch]:
    while True:
        yield from items


def job_for(batch: int, device: torch.device, folder: Path) -> TrainJob:
    return TrainJob(
        model=MODEL, sharding=ShardingConfig(sharding_type="table_wise", compute_kernel="fused"),
        training=TrainingConfig(nproc=1, batch_size=batch, device=device.type, precision="fp32", min_steps=0,
                                dense_optimizer="adam", embedding_eps=1e-8, **LR),
        evaluation=EvaluationConfig(heldout_every_steps=0), table_sizes={f: TABLE_ROWS for f in SPARSE_COLUMNS},
        train_files=(), eval_files={}, out_dir=str(folder),
    )  # fmt: skip


class DenseHead(nn.Module):
    """The DLRM's dense part as one callable: (dense features, pooled embeddings) → logits."""

    def __init__(self, dlrm: nn.Module) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=sparse))


def graph_dense_part(model: nn.Module, batch: int, device: torch.device) -> None:
    [dlrm] = dlrms_in(model)
    head = DenseHead(dlrm)
    dense = torch.rand(batch, 13, device=device)
    sparse = torch.rand(batch, len(SPARSE_COLUMNS), MODEL.embedding_dim, device=device, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(head, (dense, sparse))
    dlrm.graphed_head = graphed  # a child of the hybrid module: a leaf to the pipeline's tracer
    sparse_arch = dlrm.sparse_arch

    def forward(dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return dlrm.graphed_head(dense_features, sparse_arch(sparse_features))

    dlrm.forward = forward


def compile_dense_part(model: nn.Module) -> None:
    """`torch.compile(mode="reduce-overhead")` on each dense part (CUDA graphs through Inductor),
    as TorchRec's newer `DLRM.compile_dense_path` does."""
    [dlrm] = dlrms_in(model)
    for part in ("dense_arch", "inter_arch", "over_arch"):
        setattr(dlrm, part, torch.compile(getattr(dlrm, part), mode="reduce-overhead"))


def build_trainer(batch: int, device: torch.device, folder: Path, dot: bool, graphed: bool, compiled: bool = False):
    job = job_for(batch, device, folder)
    torch.manual_seed(0)
    model = build_train_model(job.model, job.table_sizes, torch.device("meta"), job.dense_features)
    if dot:
        from training.cpu.interaction import swap_interaction

        [dlrm] = dlrms_in(model)
        swap_interaction(dlrm, "aten")
    attach_embedding_optimizer(model, job.training)
    sharded, _ = shard_model(model, job.sharding, device, batch)
    optimizer = build_optimizer(sharded, job.training)
    if graphed:
        graph_dense_part(sharded, batch, device)
    if compiled:
        compile_dense_part(sharded)
    return sharded, optimizer, job


def build_stock(batch: int, device: torch.device):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from training.launch.device import device_memory_bytes

    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=MODEL.embedding_dim, num_embeddings=TABLE_ROWS,
                                 feature_names=[f]) for f in SPARSE_COLUMNS]  # fmt: skip
    model = DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                           dense_in_features=13, dense_arch_layer_sizes=list(MODEL.bottom_mlp),
                           over_arch_layer_sizes=list(MODEL.top_mlp), dense_device=device))  # fmt: skip
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05, "eps": 1e-8})
    same = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in tables}
    topology = Topology(world_size=1, compute_device=device.type,
                        hbm_cap=device_memory_bytes(device) if device.type == "cuda" else None)  # fmt: skip
    plan = EmbeddingShardingPlanner(topology=topology, constraints=same).plan(model, get_default_sharders())
    sharded = DistributedModelParallel(model, device=device, plan=plan)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(sharded.named_parameters())),
                                  lambda p: torch.optim.Adam(p, lr=0.001, fused=device.type == "cuda"))  # fmt: skip
    return sharded, CombinedOptimizer([sharded.fused_optimizer, dense])


def stepper(variant: str, batch: int, device: torch.device, folder: Path) -> Callable[[Iterator[Batch]], object]:
    if variant == "stock":
        model, optimizer = build_stock(batch, device)
        if device.type == "cuda":
            from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

            return TrainPipelineSparseDist(model, optimizer, device).progress

        def plain(batches: Iterator[Batch]) -> object:
            loss, _ = model(next(batches).to(device, non_blocking=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss

        return plain
    if variant.startswith("trainer"):  # the worker's own build (training/worker.py)
        from training.worker import build

        precision = "bf16" if variant.endswith("bf16") else "fp32"
        graphs = "off" if "eager" in variant else "auto"
        job = job_for(batch, device, folder / variant)
        job = dataclasses.replace(job, training=dataclasses.replace(job.training, precision=precision, cuda_graphs=graphs))
        built = build(job, device, write_plan=False)
        kind = PlainSteps if "plain" in variant or device.type != "cuda" else PipelinedSteps
        return kind(built.model, built.optimizer, job.training, device).step
    model, optimizer, job = build_trainer(batch, device, folder / variant, dot=variant.startswith("dot"),
                                          graphed=variant == "dot_graphed",
                                          compiled=variant == "dot_compiled")  # fmt: skip
    kind = PlainSteps if variant == "plain" or device.type != "cuda" else PipelinedSteps
    return kind(model, optimizer, job.training, device).step


def device_busy_ms(profile, steps: int) -> tuple[float, list[dict]]:
    """Σ of the device's kernel and copy times per step, and the top kernels by device time."""
    events = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in events) / 1000 / steps if events else 0.0
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in events:
        totals[e.name] = totals.get(e.name, 0.0) + e.device_time
        counts[e.name] = counts.get(e.name, 0) + 1
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:18]
    return busy, [{"kernel": name[:90], "ms_per_step": round(t / 1000 / steps, 4), "calls_per_step": counts[name] / steps}
                  for name, t in top]  # fmt: skip


def measure(variant: str, batch: int, device: torch.device, steps: int, folder: Path) -> dict:
    step = stepper(variant, batch, device, folder)
    batches = cycle(batches_in_memory(batch, device))
    for _ in range(WARMUP):
        step(batches)
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step(batches)
    sync(device)
    wall_ms = 1000 * (time.perf_counter() - started) / steps
    result = {"ms_per_step": round(wall_ms, 3), "samples_per_s": round(batch / wall_ms * 1000)}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        profiled = 10
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                step(batches)
            sync(device)
        busy, top = device_busy_ms(prof, profiled)
        result.update(device_busy_ms=round(busy, 3), top_kernels=top)
    return result


def reader_rates(batches: list[int], rows: int) -> dict:
    """The reader alone over a generated day: rows/s at each batch, read as the trainer reads
    (one background thread hashing and pinning)."""
    from ingestion.config import PreprocessConfig, SyntheticConfig
    from ingestion.preprocess import apply_state, fit_state
    from ingestion.synthetic import generate_day
    from ingestion.warehouse import ingest_day
    from training.loop.batches import TrainBatches
    from training.loop.checkpoint import TrainPosition

    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        generate_day(SyntheticConfig(rows_per_day=rows, seed=5, cardinality_scale=0.05), 0, folder / "raw")
        ingest_day([str(folder / "raw" / "day_0.tsv.gz")], 0, folder / "warehouse")
        preprocess = PreprocessConfig(hash_size=TABLE_ROWS)
        state = fit_state(preprocess, folder / "warehouse", folder / "features", (0,))
        written = apply_state(preprocess, state, folder / "warehouse", folder / "features", 0)
        rates["prepare_s"] = round(time.perf_counter() - started, 1)
        files = tuple(str(p) for p in sorted(written.glob("*.parquet")))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        import training.loop.batches as batches_module

        chosen = batches_module.reader_decode_threads
        rates["decode_threads"] = chosen(job_for(batches[0], device, folder).training)
        for batch in batches:
            job = job_for(batch, device, folder / f"r{batch}")
            job = dataclasses.replace(job, train_files=files)
            for threads in ("one", "chosen"):
                batches_module.reader_decode_threads = chosen if threads == "chosen" else (lambda config: 1)
                reader = TrainBatches(job, device, TrainPosition(0, 0, 0))
                started, seen = time.perf_counter(), 0
                for _ in reader.stream:
                    reader.pop_trained()
                    seen += batch
                rates[f"reader_rows_per_s_{batch}_{threads}"] = round(seen / (time.perf_counter() - started))
                reader.close()
        batches_module.reader_decode_threads = chosen
    return rates


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8192,65536")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--variants", default="stock,plain,pipelined,dot,dot_graphed")
    parser.add_argument("--reader-rows", type=int, default=1_000_000, help="0: no reader figures")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29521"), RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    allow_tf32(device)
    figures: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    out = Path(args.out) if args.out else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for batch in map(int, args.batches.split(",")):
                for variant in args.variants.split(","):
                    if variant in ("dot_graphed", "dot_compiled") and device.type != "cuda":
                        continue
                    key = f"{variant}_{batch}"
                    try:
                        figures[key] = measure(variant, batch, device, args.steps, Path(tmp))
                    except Exception as error:  # noqa: BLE001 - one variant's failure is a figure too
                        figures[key] = {"error": f"{type(error).__name__}: {error}"[:400]}
                        traceback.print_exc()
                    brief = {k: v for k, v in figures[key].items() if k != "top_kernels"}
                    print(f"{key}: {brief}", flush=True)
                    if out:
                        (out / "probe.json").write_text(json.dumps(figures, indent=1))
                    torch.cuda.empty_cache() if device.type == "cuda" else None
        if args.reader_rows:
            figures["reader"] = reader_rates([int(b) for b in args.batches.split(",")], args.reader_rows)
            print(f"reader: {figures['reader']}", flush=True)
    finally:
        dist.destroy_process_group()
    if out:
        (out / "probe.json").write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    print(json.dumps(main()))
    exit_skipping_teardown()  # as the trainer's workers leave: gloo's threads outlive the destroy
