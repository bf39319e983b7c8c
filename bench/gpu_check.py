"""The GPU checks as one command: `python bench/gpu_check.py --out DIR`.

Made for a GPU host that got this project from `make bundle` (no Prefect, MLflow or Optuna
needed) and to finish in under 6 minutes on one H100. Each check writes its log into DIR;
DIR/gpu_check.json (rewritten after every check, so a stopped run keeps what it measured)
holds `device`, `torch`, `fbgemm`, `torchrec` and, per check, its figures or the reason it
was not measured:

- imports:    fbgemm's CUDA operators and a TorchRec embedding collection on the GPU
- tests:      the `gpu`-marked tests that need neither Prefect nor MLflow
- throughput: bench/gpu.py (this trainer's variants against TorchRec's stock loop)
- ne_gpu_vs_cpu: one sharded job on the GPUs (NCCL) and on the CPU (gloo), with the held-out
              NE of each; the tolerance is the CPU runs' own seed-to-seed spread
- plan:       the planner's plan for the card found (HBM read from CUDA), for a model whose
              tables take 1.2x that memory (half the host's memory on CPU)
- quantized_comms: fp16 and bf16 all-to-alls against fp32 (2+ GPUs; else not measured)
- managed:    managed-collision ids (configs/drifting-ids.toml's generator, more rows a day):
              hash, vocab and managed tables of the same size trained on the GPU, managed
              also on the CPU; NE, training throughput with and without the remapper, and
              the remapper's memory on the GPU against the planner's estimate
- characterize: the batch-size sweep of `dlrm characterize` (no MLflow), tables in GPU memory
              against tables in host memory behind a GPU cache, at each batch

Without CUDA it runs the subset the host can (and says so in `mode`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evaluation.config import EvaluationConfig
from evaluation.metrics import summarize
from ingestion.config import PreprocessConfig, SyntheticConfig
from ingestion.preprocess import apply_state, fit_state
from ingestion.synthetic import GroundTruth, generate_day
from ingestion.warehouse import ingest_day
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.launcher import launch

GPUS = torch.cuda.device_count()
# a subprocess imports this tree first, whatever an installed copy of the project holds
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


class Skipped(Exception):
    """A check this host cannot run: the reason is recorded instead of figures."""


def versions() -> dict:
    import fbgemm_gpu
    import torchrec

    return {
        "device": torch.cuda.get_device_name(0) if GPUS else f"cpu ({platform.processor() or platform.machine()})",
        "gpus": GPUS,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "fbgemm": getattr(fbgemm_gpu, "__version__", "unknown"),
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "python": platform.python_version(),
        "mode": "cuda" if GPUS else "cpu subset (no CUDA device visible)",
    }


# -- the checks ---------------------------------------------------------------------------


def check_imports(out: Path) -> dict:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    device = torch.device("cuda", 0) if GPUS else torch.device("cpu")
    lengths = torch.tensor([1, 2, 0, 1], device=device)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    assert offsets.tolist() == [0, 1, 3, 3, 4], offsets
    tables = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10,
                                                               feature_names=["f"])], device=device)  # fmt: skip
    ids = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 3, 4], device=device), lengths=lengths)
    pooled = tables(ids)["f"]
    assert pooled.shape == (4, 8) and pooled.device == device
    return {"fbgemm_op_device": str(offsets.device), "embedding_bag_device": str(pooled.device)}


def check_tests(out: Path) -> dict:
    """The gpu-marked tests (tests/integration/test_gpu.py), in a pytest of their own."""
    report = out / "tests.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "-o", "addopts=", f"--junitxml={report}", "tests/integration/test_gpu.py"],
                          cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    (out / "tests.log").write_text(done.stdout + done.stderr)
    from xml.etree import ElementTree

    if not report.is_file():
        raise RuntimeError(f"pytest wrote no report (status {done.returncode}): {done.stdout[-400:]}")
    suite = ElementTree.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]  # fmt: skip
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed_tests": failed, "ok": done.returncode in (0, 5) and not failed}  # fmt: skip


def check_throughput(out: Path, rows: int) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--rows", str(rows)], cwd=ROOT,
                          env=CHILD_ENV, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    (out / "throughput.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"bench/gpu.py failed (status {done.returncode}): {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def small_job_data(folder: Path) -> tuple[dict[str, int], list[str], list[str]]:
    """Three generated days of 100,000 rows (two to train, one to evaluate), preprocessed: few
    enough ids that one epoch learns them (NE about 0.82, ±0.004 from seed to seed on CPU)."""
    config = SyntheticConfig(rows_per_day=100_000, seed=21, cardinality_scale=0.001)
    truth = GroundTruth(config)
    preprocess = PreprocessConfig(hash_size=20_000, duckdb_threads=4)
    for day in (0, 1, 2):
        generate_day(config, day, folder / "raw", truth)
        ingest_day([str(folder / "raw" / f"day_{day}.tsv.gz")], day, folder / "warehouse")
    state = fit_state(preprocess, folder / "warehouse", folder / "features", (0, 1))
    files = {day: [str(p) for p in sorted(apply_state(preprocess, state, folder / "warehouse", folder / "features",
                                                      day).glob("*.parquet"))] for day in (0, 1, 2)}  # fmt: skip
    return state.table_sizes, files[0] + files[1], files[2]


def small_job(sizes: dict[str, int], train: list[str], evaluate: list[str], out: Path, **training) -> TrainJob:
    return TrainJob(
        model=ModelConfig(embedding_dim=16, bottom_mlp=(64, 16), top_mlp=(64, 1)),
        sharding=training.pop("sharding", ShardingConfig("table_wise", "fused")),
        training=TrainingConfig(**{"batch_size": 1024, "epochs": 1, "embedding_lr": 0.05, "dense_lr": 0.002,
                                   "log_every": 50, **training}),
        evaluation=EvaluationConfig(batch_size=8192, heldout_every_steps=0),
        table_sizes=sizes,
        train_files=tuple(train),
        eval_files={"2": tuple(evaluate)},
        out_dir=str(out),
    )


def heldout_ne(job: TrainJob, log: Path) -> float:
    lines: list[str] = []
    try:
        launch(job, on_line=lines.append)
    finally:
        with log.open("a") as file:
            file.write(f"== {job.out}\n" + "\n".join(lines) + "\n")
    scores = job.folder.read_predictions("2")
    return summarize(scores.labels, scores.predictions)["ne"]


def check_ne_gpu_vs_cpu(out: Path, data: tuple) -> dict:
    """The same job on the CPU (gloo) with three seeds and on the GPUs (NCCL) with two.

    A GPU run starts from other random weights than a CPU run of the same seed (each device
    has its own generator) and sums in another order (fbgemm's CUDA kernels, TF32 products),
    so it is one more draw of the job: its mean NE should lie within the CPU seeds' spread
    of theirs (at least 0.002)."""
    log = out / "ne_gpu_vs_cpu.log"
    processes = max(1, GPUS)

    def ne(where: str, seed: int, precision: str = "fp32") -> float:
        return heldout_ne(small_job(*data, Path(tmp) / f"{where}-{precision}-{seed}", nproc=processes, device=where,
                                    precision=precision, seed=seed), log)  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        with ThreadPoolExecutor(3) as pool:  # three torchrun jobs side by side on the host's cores
            cpu = list(pool.map(lambda seed: ne("cpu", seed), (0, 1, 2)))
        spread = max(cpu) - min(cpu)
        figures = {"processes": processes, "cpu_ne": [round(v, 5) for v in cpu], "cpu_mean_ne": round(sum(cpu) / 3, 5),
                   "tolerance": round(max(spread, 0.002), 5)}  # fmt: skip
        if not GPUS:
            raise Skipped(f"no GPU: the CPU runs only ({json.dumps(figures)})")
        gpu = [ne("cuda", seed) for seed in (0, 1)]
        bf16 = ne("cuda", 0, "bf16")
    difference = sum(gpu) / 2 - sum(cpu) / 3
    figures.update(gpu_fp32_ne=[round(v, 5) for v in gpu], gpu_bf16_ne=round(bf16, 5), difference=round(difference, 5),
                   ok=abs(difference) <= figures["tolerance"])  # fmt: skip
    return figures


def check_plan(out: Path) -> dict:
    from flows.run.config import load_config
    from flows.run.feature_files import tables_to_plan
    from flows.run.planning import plan_report
    from training.sharding.plan import this_job_cluster

    device = torch.device("cuda", 0) if GPUS else torch.device("cpu")
    cluster = this_job_cluster(device, max(1, GPUS), max(1, GPUS))
    if cluster.compute_device == "cuda":
        cluster = replace(cluster, device_model=torch.cuda.get_device_name(0))
    memory = cluster.device_memory_gb * 2**30 * max(1, GPUS)
    dim, tables = 128, 26
    # on a GPU, more than its HBM: the planner must place some tables in host memory (UVM)
    rows = int((1.2 if GPUS else 0.5) * memory / (tables * dim * 4))
    config = load_config(ROOT / "configs" / "m3-scaled.toml", [
        f"model.embedding_dim={dim}", f"model.bottom_mlp=[512, {dim}]", f"model.declared_tables.count={tables}",
        f"model.declared_tables.max_rows={rows}",
        f"model.declared_tables.min_rows={rows}", "model.declared_tables.pooling_factor=1.0",
        f"training.nproc={max(1, GPUS)}", "training.batch_size=8192",
    ])  # fmt: skip
    report = plan_report(config, cluster, tables_to_plan(config))
    (out / "plan.txt").write_text(report.text + "\n")
    return {"device_memory_gb": round(cluster.device_memory_gb, 1), "host_memory_gb": round(cluster.host_memory_gb, 1),
            "tables": report.tables, "embedding_gib": round(report.embedding_gib, 1),
            "sharding_types": report.sharding_types, "compute_kernels": report.compute_kernels,
            "host_memory_tables": len(report.host_memory_tables),
            "per_rank": [{k: (round(v / 2**30, 2) if k.endswith("bytes") else v) for k, v in rank.items()}
                         for rank in report.per_rank],
            "planner_seconds": report.planner_seconds}  # fmt: skip


def check_quantized_comms(out: Path, data: tuple) -> dict:
    if GPUS < 2:
        raise Skipped(f"{'one GPU' if GPUS == 1 else 'no GPU'}: not measured (quantized all-to-alls need 2+ GPUs)")
    log = out / "quantized_comms.log"
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "fp16", "bf16"):
            sharding = ShardingConfig("table_wise", "fused", comm_forward_precision=precision,
                                      comm_backward_precision=precision)  # fmt: skip
            figures[f"{precision}_ne"] = round(heldout_ne(small_job(*data, Path(tmp) / precision, nproc=GPUS,
                                                                    device="cuda", sharding=sharding), log), 5)  # fmt: skip
    figures["fp16_minus_fp32"] = round(figures["fp16_ne"] - figures["fp32_ne"], 5)
    figures["bf16_minus_fp32"] = round(figures["bf16_ne"] - figures["fp32_ne"], 5)
    return figures


def check_managed(out: Path, rows_per_day: int) -> dict:
    """Days 0–2 of configs/drifting-ids.toml's generator trained, day 3 scored, with the same
    table size in each mode, on the GPU (a process per GPU); managed also with a second seed,
    and on the CPU (one process) with three: the GPU seeds' mean NE must lie within the CPU
    seeds' spread of theirs (at least 0.005)."""
    from flows.run.config import load_config
    from training.model.managed_ids import ManagedIds, state_bytes

    config = load_config(ROOT / "configs" / "drifting-ids.toml")
    synthetic = replace(config.data.synthetic, rows_per_day=rows_per_day)
    log = out / "managed.log"
    figures: dict = {"rows_per_day": rows_per_day, "hash_size": config.preprocess.hash_size,
                     "policy": config.preprocess.managed.policy,
                     "eviction_interval": config.preprocess.managed.eviction_interval}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        truth = GroundTruth(synthetic)
        for day in (0, 1, 2, 3):
            generate_day(synthetic, day, folder / "raw", truth)
            ingest_day([str(folder / "raw" / f"day_{day}.tsv.gz")], day, folder / "warehouse")

        def job(mode: str, where: str, seed: int = 0) -> tuple[TrainJob, dict[str, int]]:
            preprocess = replace(config.preprocess, categorical_mode=mode, duckdb_threads=4)
            state = fit_state(preprocess, folder / "warehouse", folder / "features", (0, 1, 2))
            files = {day: [str(p) for p in sorted(apply_state(preprocess, state, folder / "warehouse", folder / "features",
                                                                 day).glob("*.parquet"))] for day in (0, 1, 2, 3)}  # fmt: skip
            training = replace(config.training, nproc=max(1, GPUS) if where == "cuda" else 1, device=where, seed=seed,
                               batch_size=2048, epochs=1, log_every=50, threads_per_proc=4)  # fmt: skip
            return TrainJob(model=config.model, sharding=config.sharding, training=training,
                            evaluation=EvaluationConfig(batch_size=8192, heldout_every_steps=0),
                            table_sizes=state.table_sizes, train_files=tuple(files[0] + files[1] + files[2]),
                            eval_files={"2": tuple(files[3])}, out_dir=str(folder / f"{mode}-{where}-{seed}"),
                            managed_ids=preprocess.managed if mode == "managed" else None), state.table_sizes  # fmt: skip

        where = "cuda" if GPUS else "cpu"
        for mode in ("hash", "vocab", "managed"):
            trained, sizes = job(mode, where)
            figures[f"{mode}_ne"] = round(heldout_ne(trained, log), 5)
            summary = trained.folder.read_summary()
            figures[f"{mode}_samples_per_s"] = round(summary.samples_per_s)
            if mode == "managed":
                figures.update(managed_rounds=summary.managed_rounds, managed_restarted_rows=summary.managed_restarted_rows,
                               managed_resident_ids=summary.managed_resident_ids, table_rows=sum(sizes.values()))  # fmt: skip
                remapper = ManagedIds(sizes, config.preprocess.managed.policy, device=torch.device(where))
                figures["remapper_bytes"] = sum(b.numel() * b.element_size() for b in remapper.buffers())
                figures["remapper_bytes_estimated"] = state_bytes(sizes, config.preprocess.managed.policy)
        figures["managed_over_hash_throughput"] = round(figures["managed_samples_per_s"] / figures["hash_samples_per_s"], 3)
        if not GPUS:
            raise Skipped(f"no GPU: the CPU runs only ({json.dumps(figures)})")
        # a GPU run is another draw of the job (other initial weights, other sums): the managed
        # NE of two GPU seeds against three CPU seeds' spread, as ne_gpu_vs_cpu does
        second, _ = job("managed", "cuda", seed=1)
        gpu = [figures["managed_ne"], heldout_ne(second, log)]
        with ThreadPoolExecutor(3) as pool:
            cpu = list(pool.map(lambda seed: heldout_ne(job("managed", "cpu", seed=seed)[0], log), (0, 1, 2)))
    tolerance = max(max(cpu) - min(cpu), 0.005)
    difference = sum(gpu) / 2 - sum(cpu) / 3
    figures.update(managed_gpu_ne=[round(v, 5) for v in gpu], managed_cpu_ne=[round(v, 5) for v in cpu],
                   tolerance=round(tolerance, 5), difference=round(difference, 5), ok=abs(difference) <= tolerance)  # fmt: skip
    return figures


# -- running them -------------------------------------------------------------------------


# The throughput bench's model (bench/gpu.py): 26 tables of 100,000 rows × 64, MLPs 512-256-64 and 512-256-1
CHARACTERIZE_MODEL = ["model.embedding_dim=64", "model.bottom_mlp=[512, 256, 64]", "model.top_mlp=[512, 256, 1]",
                      "preprocess.hash_size=100000", 'training.dense_optimizer="adam"', "training.dense_lr=0.001"]


def check_characterize(out: Path, first: int, last: int) -> dict:
    """`dlrm characterize`'s sweep (no MLflow): the batch-size curve with tables in GPU memory
    (fused) and in host memory behind a GPU cache (fused_uvm_caching), one process per GPU;
    a CPU host measures the fused tables and records the other series as refused."""
    from flows.characterize.measure import characterize
    from flows.characterize.sweeps import parse_sweep, series_of
    from flows.run.config import read_toml
    from training.characterize.measure import Windows

    config = ROOT / "configs" / "demo.toml"
    scratch = tempfile.mkdtemp(prefix="characterize-")  # the rows and the jobs' folders: not results
    overrides = [*CHARACTERIZE_MODEL, f"training.nproc={max(1, GPUS)}", f'run_dir="{scratch}"']
    log = out / "characterize.log"
    log.write_text("")

    def say(line: str) -> None:
        print(f"  {line}", flush=True)
        with log.open("a") as file:  # as it goes: a run stopped at its limit keeps its points
            file.write(line + "\n")

    sweeps = [parse_sweep("sharding.compute_kernel=fused,fused_uvm_caching")]
    report = characterize(series_of(read_toml(config), overrides, sweeps, config), sweeps, first_batch=first,
                          last_batch=last, windows=Windows(min_window_samples=262_144 if GPUS else 16_384),
                          track=False, on_line=say)  # fmt: skip
    from training.codec import encode

    figures = encode(report)
    (out / "characterize.json").write_text(json.dumps(figures, indent=2) + "\n")
    figures.pop("out_dir", None)
    return {"ok": report.hardware_batch_size is not None, **figures}


def run_check(name: str, check: Callable[[], dict], results: dict, out: Path) -> None:
    started = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        figures = check()
        outcome = {"ok": figures.pop("ok", True), **figures}
    except Skipped as reason:
        outcome = {"ok": None, "reason": str(reason)}
    except Exception as error:  # noqa: BLE001 - recorded, and the other checks still run
        (out / f"{name}.error.log").write_text(traceback.format_exc())
        outcome = {"ok": False, "reason": f"{type(error).__name__}: {str(error)[-800:]}"}
    outcome["seconds"] = round(time.perf_counter() - started, 1)
    results["checks"][name] = outcome
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"[gpu_check] {name}: {json.dumps(outcome)[:600]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and the logs")
    parser.add_argument("--rows", type=int, help="rows for the throughput bench (default 5M on a GPU, 400k on CPU)")
    parser.add_argument("--managed-rows", type=int, help="rows a day for the managed check (default 200k on a GPU, 20k on CPU)")
    parser.add_argument("--only", help="comma-separated checks to run (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {**versions(), "checks": {}}
    print(f"[gpu_check] {json.dumps({k: v for k, v in results.items() if k != 'checks'})}", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    data: list[tuple] = []

    def shared_data() -> tuple:
        if not data:
            data.append(small_job_data(scratch))
        return data[0]

    checks: dict[str, Callable[[], dict]] = {
        "imports": lambda: check_imports(args.out),
        "plan": lambda: check_plan(args.out),
        "ne_gpu_vs_cpu": lambda: check_ne_gpu_vs_cpu(args.out, shared_data()),
        "throughput": lambda: check_throughput(args.out, args.rows or (5_000_000 if GPUS else 400_000)),
        "tests": lambda: check_tests(args.out),
        "quantized_comms": lambda: check_quantized_comms(args.out, shared_data()),
        "managed": lambda: check_managed(args.out, args.managed_rows or (200_000 if GPUS else 20_000)),
        "characterize": lambda: check_characterize(args.out, *((2048, 65_536) if GPUS else (512, 4096))),
    }
    chosen = args.only.split(",") if args.only else list(checks)
    unknown = [name for name in chosen if name not in checks]
    if unknown:
        print(f"gpu_check: error: unknown check(s) {unknown}; choose from {list(checks)}", file=sys.stderr)
        return 2
    for name in chosen:
        run_check(name, checks[name], results, args.out)
    failed = [name for name, outcome in results["checks"].items() if outcome["ok"] is False]
    print(json.dumps({"failed": failed, **{k: v for k, v in results.items() if k != "checks"}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
