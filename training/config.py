"""Configuration of the model, its sharding and the training run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
COMPUTE_KERNELS = ("fused", "fused_uvm", "fused_uvm_caching", "dense")
# torchrun's options that make a job span hosts
HOST_ARGUMENTS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master", "--standalone")


@dataclass(frozen=True)
class ModelConfig:
    """DLRM shape: `bottom_mlp` ends at `embedding_dim`, `top_mlp` ends at one logit."""

    arch: Literal["dlrm", "dlrm_dcn"] = "dlrm"
    """`dlrm`: dot interaction; `dlrm_dcn`: DCN-v2 cross layers"""
    embedding_dim: int = 16
    """width of every embedding"""
    bottom_mlp: tuple[int, ...] = (512, 256, 16)
    """the dense features' MLP; must end with `embedding_dim`"""
    top_mlp: tuple[int, ...] = (512, 256, 1)
    """the MLP over the interaction; must end with 1 (the logit)"""
    # How the training rows size the MLPs (training/model/width.py): the configured widths are
    # the ceiling, and few rows scale them down so that a seed's first epoch cannot overfit.
    mlp_width: Literal["auto", "configured"] = "auto"
    """`auto`: a fresh run with few training rows scales every hidden layer of both MLPs by one factor, so that the first
    layer is at most one unit per 512 training rows (a power of two, never below 128, never above the configured width; the
    output widths stay): 8,000 rows train 512-256 MLPs as 128-64. The change is said in the log and the run's resolved
    changes; a warm start keeps its champion's widths. `configured`: train the widths exactly as configured"""
    dcn_num_layers: int = 3
    """DCN-v2 cross layers (`dlrm_dcn` only)"""
    dcn_low_rank_dim: int = 64
    """the low-rank width of each cross layer (`dlrm_dcn` only)"""
    # Wide & Deep: each id also adds its own learned weight to the logit (training/model/stock_dlrm.py: WideDLRM)
    wide: bool = False
    """Wide & Deep: each id also adds its own learned weight to the logit, and the dense features a linear term, beside the
    DLRM's output (`dlrm` only). Each embedding row carries 4 more columns whose sum is the id's weight (fbgemm's kernels take
    rows of 4·k floats), so sharding, checkpoints, warm starts and serving work unchanged. In a plain DLRM an id's own effect
    reaches the logit only through its dot product with the bottom MLP's output, which a few thousand rows rarely teach: on
    `configs/small-real.toml` (8,000 rows) the tuned NE goes from 0.9462 to 0.9369 (own weights from 0), next to the logistic
    regression's 0.9342"""
    # Where a wide model's own weights start (training/sharding/start.py): "zero" (the model starts
    # as its DLRM), or "logistic_regression" (as the fitted reference, the deep part then
    # learns what it leaves: small data)
    wide_start: Literal["zero", "logistic_regression"] = "zero"
    """where a wide model's own weights start on a fresh run (a resumed or warm-started run loads its own): `"zero"`, so the
    model starts as its DLRM; `"logistic_regression"`, as the fitted reference (the same fit as the run's logistic-regression
    reference: rows, folds, `evaluation.reference_max_rows`; the same for every `training.seed`), with the top MLP's last
    layer at 0, so the deep part learns what the regression leaves. Rank 0 fits it and sends it to every rank. Small data:
    L-BFGS with a validated L2 finds the ids' own weights better than a few epochs of SGD; keep `training.embedding_lr` at
    0.005 or less or they drift from that optimum"""
    # The L2 of the regression a wide part starts from (training/reference.py): one C for
    # every weight, or each feature's own by type-II maximum likelihood
    wide_start_l2: Literal["per_feature", "shared"] = "per_feature"
    """the L2 of the regression a wide part starts from (`wide_start = "logistic_regression"`): `"per_feature"`, the
    validated C, then each feature's ids their own prior variance by type-II maximum likelihood (empirical Bayes: a feature of
    a few values seen thousands of times is not shrunk as one of thousands of ids seen once); `"shared"`, the reference's
    one C for every weight. The reported reference keeps one C either way ([run-length.md](run-length.md))"""
    # Few rows start at the regression (training/model/small_data.py): measured better on
    # Avazu's 8,000 rows, worse on MovieLens's 66,000.
    regression_start: Literal["auto", "configured"] = "auto"
    """`auto`: a fresh run with fewer than 32,768 training rows trains a wide DLRM started as the fitted logistic regression
    (`wide = true`, `wide_start = "logistic_regression"`, `training.embedding_lr` at most 0.005), and a night continuing such a
    model keeps that rate; on Avazu's 8,000 rows it ends level with the regression where the plain DLRM stayed 0.8 % behind,
    and with `wide_start_l2` ahead of it on `configs/small-real.toml` and four weeks of MovieLens
    ([run-length.md](run-length.md)). Said in the run's resolved changes. It leaves a config that sets `wide = true` itself,
    `arch = "dlrm_dcn"` and managed ids as they are. `configured`: train the model as configured"""
    # Pairs of features crossed into tables of their own (flows/run/crosses.py).
    crosses: Literal["auto", "none"] = "auto"
    """`auto`: a fresh run crosses the pairs of one-id features that a score test against the logistic-regression reference's
    out-of-fold predictions finds (a χ² tail of 0.05 over the pairs scored, the 12 strongest at most;
    [run-length.md](run-length.md)): each pair's combined
    rows get a table of their own, in the model, the wide start and the served model alike; a night keeps its champion's
    pairs. Managed ids cross nothing. `none`: no crosses"""
    # Dense features also cut into bins of their own table each (flows/run/crosses.py).
    count_bins: Literal["auto", "none"] = "auto"
    """`auto`: a fresh run that starts as the fitted regression (`regression_start`) cuts a dense feature into quantile
    bins (up to 32, 200 training rows a bin at least) when a score test against the reference's out-of-fold predictions
    finds a shape its one weight on ln(1 + x) misses (a χ² tail of 0.05 over the counts scored), and the regression with
    the bins then predicts held-out rows better: each bin is a row of a table of its own, in the model, the wide start and
    the served model alike; a night keeps its champion's bins. A larger run's bottom MLP learns each count's shape itself,
    and managed ids cut nothing. `none`: no bins ([run-length.md](run-length.md))"""
    # Tables declared by shape, for planning a model without its data (empty: from the data).
    declared_tables: DeclaredTables = field(default_factory=lambda: DeclaredTables())

    def __post_init__(self) -> None:
        if self.embedding_dim <= 0 or self.embedding_dim % 4:
            # fbgemm's embedding kernels (CPU and CUDA) take rows of 4·k floats
            raise ValueError(f"embedding_dim: must be a positive multiple of 4, got {self.embedding_dim}")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp: must end with embedding_dim ({self.embedding_dim}), "
                f"got {list(self.bottom_mlp)}"
            )
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp: must end with 1 (the logit), got {list(self.top_mlp)}")
        if any(width <= 0 for width in (*self.bottom_mlp, *self.top_mlp)):
            raise ValueError("bottom_mlp: layer widths must be positive")
        if self.wide and self.arch != "dlrm":
            raise ValueError(f"wide: only arch = \"dlrm\" (the dot interaction) has a wide part, got arch = \"{self.arch}\"")
        if self.wide_start != "zero" and not self.wide:
            raise ValueError("wide_start: only a wide model has own weights to start; set model.wide = true "
                             "or leave wide_start at \"zero\"")


ShardingType = Literal["auto", "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
ComputeKernel = Literal["auto", "fused", "fused_uvm", "fused_uvm_caching", "dense"]


def _check_pair(sharding_type: str, compute_kernel: str) -> None:
    if "auto" in (sharding_type, compute_kernel):
        return
    if (sharding_type == "data_parallel") != (compute_kernel == "dense"):
        raise ValueError(
            "compute_kernel: data_parallel tables use the 'dense' kernel and only they do "
            f"(got {sharding_type} with {compute_kernel})"
        )


@dataclass(frozen=True)
class TableSharding:
    """A per-table override of the sharding rule ("auto" here keeps the global value)."""

    sharding_type: ShardingType = "auto"
    """as above, for this table"""
    compute_kernel: ComputeKernel = "auto"
    """as above, for this table"""

    def __post_init__(self) -> None:
        _check_pair(self.sharding_type, self.compute_kernel)


@dataclass(frozen=True)
class ShardingConfig:
    """Where the planner may place embedding tables.

    `sharding_type` and `compute_kernel` apply to every table; "auto" lets the planner choose
    among what the device supports (on GPUs: row-wise splits and host-memory placement of
    large tables). `tables` overrides the rule per table, e.g. `[sharding.tables.t_C3]`.
    """

    sharding_type: ShardingType = "table_wise"
    """for every table: `auto`, `table_wise`, `row_wise`, `column_wise`, `table_row_wise`, `data_parallel`. `auto` lets the
    planner choose among what the device supports. On CPU, TorchRec supports `table_wise`, `column_wise` and `data_parallel`"""
    compute_kernel: ComputeKernel = "fused"
    """where tables live: `fused` (device memory), `fused_uvm` (host memory), `fused_uvm_caching` (host memory with a GPU cache),
    `dense` (the kernel of `data_parallel` tables, and only of them), or `auto`"""
    tables: dict[str, TableSharding] = field(default_factory=dict)
    # The planner's greedy searches stop after this many plans in a row that are no faster
    # than their best (0: search every proposal, TorchRec's default). For the scaled M3 on
    # 2 × 8 GPUs the full search rated 3,050 proposals in 28–41 s on 2 CPU cores; stopping
    # after 50 found a plan of the same estimated cost in 10.6 s (after 10, in 8.8 s).
    search_patience: int = 50
    """the planner's greedy searches stop after this many plans in a row that are no faster than their best; `0` searches every
    proposal (TorchRec's default)"""
    # Precision of the embeddings' all-to-alls (TorchRec's quantized communication codecs):
    # forward (pooled embeddings) and backward (their gradients). fp16/bf16 halve the bytes
    # between GPUs; TorchRec applies the codecs on CUDA only.
    comm_forward_precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """precision of the pooled embeddings' all-to-all: `fp16` or `bf16` halve its bytes (TorchRec's quantized communication
    codecs); CUDA only, refused on CPU, where TorchRec would ignore it"""
    comm_backward_precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """the same for their gradients on the way back"""

    def __post_init__(self) -> None:
        _check_pair(self.sharding_type, self.compute_kernel)
        if self.search_patience < 0:
            raise ValueError(f"search_patience: must be ≥ 0 (0 searches exhaustively), got {self.search_patience}")

    def for_table(self, table: str) -> TableSharding:
        override = self.tables.get(table, TableSharding())
        return TableSharding(
            override.sharding_type if override.sharding_type != "auto" else self.sharding_type,
            override.compute_kernel if override.compute_kernel != "auto" else self.compute_kernel,
        )


@dataclass(frozen=True)
class DeclaredTables:
    """Embedding tables declared by shape rather than fitted from data (`dlrm plan`).

    `count` tables whose rows fall along a power law from `max_rows` down to `min_rows`.
    """

    count: int = 0
    """how many tables"""
    max_rows: int = 20_000_000
    """rows of the largest"""
    min_rows: int = 1_000
    """rows of the smallest"""
    pooling_factor: float = 1.0
    """ids per bag on average, for the planner's cost estimates"""

    def __post_init__(self) -> None:
        if self.count < 0 or self.min_rows < 1 or self.max_rows < self.min_rows:
            raise ValueError("count: needs count ≥ 0 and 1 ≤ min_rows ≤ max_rows")
        if self.pooling_factor <= 0:
            raise ValueError(f"pooling_factor: must be positive, got {self.pooling_factor}")

    def table_sizes(self) -> dict[str, int]:
        if self.count == 0:
            return {}
        ratio = (self.min_rows / self.max_rows) ** (1.0 / max(1, self.count - 1))
        return {f"f{i:03d}": max(self.min_rows, round(self.max_rows * ratio**i)) for i in range(self.count)}


@dataclass(frozen=True)
class ClusterConfig:
    """A cluster to plan for, which need not be this machine (`dlrm plan --cluster`)."""

    name: str = "cluster"
    """printed with the plan"""
    hosts: int = 1
    """hosts in the cluster"""
    devices_per_host: int = 8
    """GPUs (or CPU ranks) per host"""
    compute_device: Literal["cuda", "cpu"] = "cuda"
    """`cuda` or `cpu`"""
    device_memory_gb: float = 80.0
    """memory per device"""
    host_memory_gb: float = 1024.0
    """memory per host"""
    # The device's name as CUDA reports it (e.g. "NVIDIA H100 80GB HBM3"), so a tuning key
    # taken from this declaration equals one taken on the hardware; "" uses `name`.
    device_model: str = ""
    """the device's name as CUDA reports it (e.g. `"NVIDIA H100 80GB HBM3"`), so that a tuning key taken from this file
    equals one taken on the hardware; empty: `name`"""

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise ValueError("hosts: hosts and devices_per_host must be at least 1")
        if self.device_memory_gb <= 0 or self.host_memory_gb <= 0:
            raise ValueError("device_memory_gb: memory sizes must be positive")

    @property
    def workers(self) -> Workers:
        return Workers(self.devices_per_host, self.hosts)


@dataclass(frozen=True)
class CpuConfig:
    """The CPU development path's kernels ([training.cpu]), applied by training/cpu/ on CPU
    hosts only. Each choice is fixed for a job and machine: nothing is decided by timing.

    - `embedding_update`: the embeddings' fused row-wise Adagrad. "native": a C loop
      (needs a C compiler); "vectorized": the same in torch ops; "fbgemm": fbgemm's own;
      "auto": native where it compiles, else fbgemm.
    - `interaction`: the fp32 dot interaction. "native": one C pass per sample; "aten":
      torch's batched products; "auto": native where it compiles.
    - `matmul`: the MLPs' fp32 ReLU layers. "onednn": oneDNN with the bias and ReLU fused;
      "aten": PyTorch's own (MKL).
    - `malloc`: "retain" keeps freed blocks up to 32 MB in the process (glibc's mallopt), so
      a step does not page-fault its activations in again; "system": glibc's defaults.
    """

    embedding_update: Literal["auto", "native", "vectorized", "fbgemm"] = "auto"
    """the embeddings' fused row-wise Adagrad inside fbgemm's backward. `native`: one C loop over the ids (needs a C compiler);
    `vectorized`: the same in torch ops; `fbgemm`: fbgemm's own. `auto`: `native` where it compiles and fbgemm's op still
    takes the arguments it was written for, else `fbgemm`"""
    interaction: Literal["auto", "native", "aten"] = "auto"
    """the fp32 dot interaction. `native`: one C pass per sample; `aten`: torch's batched products. `auto`: `native` where it
    compiles, else `aten`. bf16 always uses `aten`"""
    matmul: Literal["onednn", "aten"] = "onednn"
    """the MLPs' fp32 ReLU layers. `onednn`: one oneDNN product with the bias and ReLU fused; `aten`: PyTorch's own (MKL)"""
    malloc: Literal["retain", "system"] = "retain"
    """`retain`: freed blocks up to 32 MB stay in the process (glibc's `mallopt`), so a step does not page-fault its activations
    in again; `system`: glibc's defaults. Nothing changes where the C library is not glibc"""


@dataclass(frozen=True)
class TrainingConfig:
    """The torchrun job. `batch_size` is global: each rank of every host takes an equal share."""

    nproc: int = 2
    """training processes per host (on GPU hosts: the GPUs per host)"""
    batch_size: int = 2048
    """the global batch: a multiple of the world size (`nproc` × `orchestration.trainer_hosts`), each process takes an equal
    share. The run may train at a smaller one (`min_steps`); the summary, the tuning key and MLflow name the batch it trained
    at"""
    # "auto": the run chooses its own length (training/loop/validation.py). After each epoch
    # it scores the held-out training rows (evaluation.calibration_percent % of each training
    # day by a hash of the row, the calibrator's among them: rows no epoch trains on) and
    # stops when `patience` epochs in a row did not lower their NE, or after `max_epochs`;
    # the model it keeps is the best epoch's. A night that continues a champion scores the
    # champion first: when no epoch of the new rows beats it, the night keeps its weights.
    # An integer trains exactly that many epochs.
    epochs: int | Literal["auto"] = "auto"
    """passes over the training days. `"auto"`: the run chooses its length by validation (docs/run-length.md): after each epoch
    it scores the held-out training rows (`evaluation.calibration_percent` % of each training day by a hash of the row, the
    calibrator's among them), stops after `patience` epochs without a lower NE there or at `max_epochs`, and keeps the best
    epoch's model; a run that starts from a model (a night continuing the champion, or `model.wide_start =
    "logistic_regression"`) scores it first and keeps it when no epoch beats it. The summary says how many epochs it trained
    and kept, and why (`run_length`); MLflow has the NE by epoch (`validation_ne`). A whole number trains exactly that many
    epochs"""
    max_epochs: int = 8
    """the most epochs a run with `epochs = "auto"` trains"""
    patience: int = 2
    """epochs in a row without a lower validation NE after which a run with `epochs = "auto"` stops"""
    # The rows that choose the length of a fresh run: "held_out", the calibrator's hash
    # slice of every training day; "newest_day", the newest training day whole, when there
    # are at least four (the run trains on the earlier ones): closer to how the next day
    # scores the model, and on MovieLens-100K worse by 0.5 % NE (docs/run-length.md).
    validation_rows: Literal["held_out", "newest_day"] = "held_out"
    """the rows that choose a fresh run's length: `"held_out"`, the calibrator's hash slice of every training day;
    `"newest_day"`, the newest training day whole when there are at least four (the run trains on the earlier ones), closer to
    how the next day scores the model but measured worse on MovieLens-100K ([run-length.md](run-length.md))"""
    # A run with fewer optimizer steps than this halves its global batch until it has them
    # (training/loop/run_length.py, logged); 0 keeps the batch as configured. With epochs =
    # "auto" it is the steps of one epoch: each validation follows that many steps.
    min_steps: int = 50
    """a run with fewer optimizer steps than this halves its global batch until it has them (never below 32 rows per process) and
    logs the change; `0` keeps the batch as configured. A run that still has fewer steps is warned about. With `epochs =
    "auto"`, the steps of one epoch: each validation follows that many"""
    embedding_lr: float = 0.05
    """the embeddings' learning rate (fused row-wise Adagrad)"""
    dense_lr: float = 0.001
    """the MLPs' learning rate"""
    dense_optimizer: Literal["adagrad", "adam"] = "adam"
    """the MLPs' optimizer: `adam` or `adagrad`"""
    # Row-wise Adagrad's epsilon (embeddings) and the dense optimizer's weight decay.
    embedding_eps: float = 1e-8
    """row-wise Adagrad's epsilon"""
    dense_weight_decay: float = 0.0
    """the MLP optimizer's weight decay"""
    # L2 on the embedding rows a step touches (fbgemm's L2 weight-decay mode): the
    # regulariser for ids seen a few times, which otherwise memorise their labels.
    embedding_weight_decay: float = 0.0
    """L2 on the embedding rows each step touches (fbgemm's L2 mode): the regulariser for ids seen a few times; on CPU hosts this
    project's kernels apply it (fbgemm's CPU kernel ignores it), so `training.cpu.embedding_update` must not be `fbgemm`"""
    warmup_steps: int = 0
    """steps of linear warm-up for both learning rates"""
    # Warm-up as a fraction of the run's steps (the longer of the two counts; never longer
    # than the run), so one setting fits a run of any length and batch size.
    warmup_fraction: float = 0.0
    """warm-up as a fraction of the run's steps; the longer of the two applies, never longer than the run"""
    # A run that continues a champion (`dlrm run --as-of`) starts from its optimizer state,
    # so it skips the warm-up unless this is set.
    warmup_on_warm_start: bool = False
    """a recurring run continuing the champion starts from its optimizer state, so it skips the warm-up; `true` warms up again"""
    # A fresh model's logit bias starts at the training days' click rate (its log odds): the
    # model starts as the constant predictor, not at p = 0.5.
    start_at_click_rate: bool = True
    """a fresh model's logit bias starts at the log odds of the training days' click rate, so it starts as the constant predictor
    rather than at p = 0.5; short runs on small data otherwise spend their steps on the bias and end miscalibrated (on
    `configs/small-real.toml` calibration 0.848 → 0.918). A resumed or continued run loads its own"""
    # After warm-up, each rate decays to `min_lr_fraction` of itself by the run's last step (a
    # warm-started night restarts the schedule). At a constant rate the model that ends a run
    # is the last step of a noisy walk, its logit bias following the last batches' click
    # counts: the tiny config's calibration read 0.82–1.17 from run to run, and decay settles
    # it. Not the default: a run of one pass at a large rate (the demo) loses 2 % NE to it.
    # docs/calibration.md has the figures.
    lr_decay: Literal["none", "linear", "cosine"] = "none"
    """after warm-up: `none`, `linear` or `cosine`; a decayed run ends settled, not on the last batches' noise, but a one-pass
    run at a large rate can lose NE to it ([calibration.md](calibration.md))"""
    min_lr_fraction: float = 0.0
    """where decay ends, as a fraction of each rate; in [0, 1]"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: each process takes the GPU of its local rank where there are GPUs (NCCL), else the CPU (gloo); `cpu`; `cuda`"""
    # "bf16": matrix work of the forward pass in bfloat16 (weights, optimizer state and the
    # loss stay float32). Twice the GEMM rate on CPUs with AVX-512 BF16 or AMX, and on GPUs;
    # far slower than fp32 elsewhere. "auto": bf16 on a GPU that has it natively (Ampere and
    # newer), fp32 on CPUs (where bf16 is taken only when set).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`bf16`: the forward pass's matrix work in bfloat16 (weights, optimizer state and loss stay float32); pays only where the
    device multiplies bf16 natively. `auto`: bf16 on GPUs that have it natively (Ampere on), fp32 on CPUs (set `bf16` for AMX
    or AVX-512 BF16: about 3× the step rate, up to 2 % of NE on small jobs). An explicit `bf16` on a device without it trains
    anyway, with a warning. On GPUs fp32 products use TF32"""
    threads_per_proc: int = 1
    """torch threads in each process"""
    # CPU-only speed settings ([training.cpu]); GPU hosts ignore them.
    cpu: CpuConfig = field(default_factory=lambda: CpuConfig())
    # "sparse_dist": TorchRec's TrainPipelineSparseDist (device copies and the ids'
    # all-to-all of the next batches overlap the current step); "plain": one batch at a
    # time; "auto": the pipeline on several GPUs, plain steps on one GPU and on CPU.
    pipeline: Literal["auto", "sparse_dist", "plain"] = "auto"
    """`sparse_dist`: TorchRec's `TrainPipelineSparseDist` (device copies and the ids' all-to-all of the next batches overlap the
    current step); `plain`: one batch at a time; `auto`: the pipeline on several GPUs, plain steps on one GPU and on CPU"""
    # torch.compile the bottom MLP, the interaction and the top MLP (fused element-wise work
    # and casts). Costs seconds of compilation in the first step; needs a C++ compiler on CPU.
    compile: bool = False
    """`torch.compile` of the bottom MLP, the interaction and the top MLP as one graph; the first step takes seconds longer;
    needs a C++ compiler on CPU"""
    # The dense part's kernels (bottom MLP, interaction, top MLP, forward and backward) as
    # CUDA graphs: on a GPU they are short and their launches keep the GPU waiting.
    cuda_graphs: Literal["auto", "off"] = "auto"
    """`auto`: on a GPU, the bottom MLP, the interaction and the top MLP replay as two CUDA graphs (forward, backward) at the
    training batch, in jobs of one process (not with `compile` nor a wide model); `off`: launched one by one"""
    seed: int = 0
    """initialisation and shuffle"""
    log_every: int = 20
    """a training record (loss, NE, throughput) every this many steps, and at the last step"""
    # Sharded checkpoints every this many steps (0: only at the end); the last K are kept.
    checkpoint_every: int = 0
    """sharded checkpoints every this many steps; `0`: only at the end"""
    keep_checkpoints: int = 2
    """the newest this many checkpoints are kept (with the checkpoints their delta chains need)"""
    # "delta": a checkpoint holds the table rows changed since the one before it (and the
    # dense part); a full one starts each chain (training/loop/delta_checkpoint.py).
    checkpoint_mode: Literal["full", "delta"] = "full"
    """`full`: every checkpoint holds every table; `delta`: a checkpoint holds the dense part and only the table rows (with their
    optimizer state) changed since the checkpoint before it, in this run or, for a night continuing the champion, the champion's;
    a chain loads bit for bit as a full checkpoint, into any world size ([performance.md](performance.md))"""
    full_checkpoint_every: int = 8
    """in delta mode, a chain has at most this many checkpoints: every this many, a full one (also after a world size change)"""
    # A failed launch is relaunched this many times; each relaunch resumes from a checkpoint.
    max_restarts: int = 0
    """a failed launch is relaunched this many times, each resuming from the last checkpoint"""
    # Extra torchrun arguments (e.g. ["--monitor-interval=1"]). Not the hosts: those are
    # orchestration.trainer_hosts, or `dlrm train --nnodes`.
    torchrun_args: tuple[str, ...] = ()
    """extra torchrun arguments (e.g. `["--monitor-interval=1"]`); not the hosts of a job (`--nnodes`, `--node-rank`, `--rdzv-*`,
    `--master-*`, `--standalone` are refused when the config loads): several hosts are `orchestration.trainer_hosts`, which
    `dlrm train --nnodes N` sets"""

    @property
    def chooses_epochs(self) -> bool:
        """The run chooses its length by validation (`epochs = "auto"`)."""
        return self.epochs == "auto"

    @property
    def delta_every(self) -> int:
        """`save_checkpoint`'s `full_every`: the chain length in delta mode, 0 in full mode."""
        return self.full_checkpoint_every if self.checkpoint_mode == "delta" else 0

    @property
    def most_epochs(self) -> int:
        """The epochs a run trains at most: `epochs`, or `max_epochs` when it chooses."""
        return self.max_epochs if self.epochs == "auto" else int(self.epochs)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc: must be at least 1, got {self.nproc}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be positive, got {self.batch_size}")
        hosts = [arg for arg in self.torchrun_args if arg.startswith(HOST_ARGUMENTS)]
        if hosts:
            # one way into several hosts: the job's hosts know each other's part (who writes
            # the summary, who clears the folder) only when they come from there
            raise ValueError(f"torchrun_args: {hosts} set the job's hosts; set orchestration.trainer_hosts and "
                             "orchestration.rdzv_endpoint (the pipeline), or run `dlrm train --nnodes N --node-rank R "
                             "--rdzv-endpoint HOST:PORT` on each host (README: Running on several hosts)")  # fmt: skip
        if self.epochs != "auto" and (isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1):
            raise ValueError(f"epochs: must be \"auto\" or a whole number of at least 1, got {self.epochs!r}")
        if self.max_epochs < 1 or self.patience < 1:
            raise ValueError(f"max_epochs and patience: must be at least 1, got {self.max_epochs} and {self.patience}")
        if self.min_steps < 0:
            raise ValueError(f"min_steps: must be ≥ 0 (0: off), got {self.min_steps}")
        for key in ("embedding_lr", "dense_lr"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}: must be positive, got {getattr(self, key)}")
        if self.embedding_eps <= 0 or self.dense_weight_decay < 0:
            raise ValueError("embedding_eps: must be positive, with dense_weight_decay ≥ 0")
        if self.embedding_weight_decay < 0:
            raise ValueError(f"embedding_weight_decay: must be ≥ 0, got {self.embedding_weight_decay}")
        if self.embedding_weight_decay and self.cpu.embedding_update == "fbgemm":
            raise ValueError("embedding_weight_decay: fbgemm's CPU kernel ignores it; on CPU hosts set "
                             "training.cpu.embedding_update = 'auto' (GPU hosts apply it either way)")
        if self.threads_per_proc < 1:
            raise ValueError(f"threads_per_proc: must be at least 1, got {self.threads_per_proc}")
        if self.log_every < 1:
            raise ValueError(f"log_every: must be at least 1, got {self.log_every}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be ≥ 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction: must be in [0, 1), got {self.warmup_fraction}")
        if not 0.0 <= self.min_lr_fraction <= 1.0:
            raise ValueError(f"min_lr_fraction: must be in [0, 1], got {self.min_lr_fraction}")
        if self.full_checkpoint_every < 1:
            raise ValueError(f"full_checkpoint_every: must be at least 1, got {self.full_checkpoint_every}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every: must be ≥ 0, with keep_checkpoints ≥ 1")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be ≥ 0, got {self.max_restarts}")


@dataclass(frozen=True)
class Workers:
    """The processes of a training job: `nproc` on each of `hosts` hosts. The one home of
    the world size and of each rank's share of the global batch."""

    nproc: int
    hosts: int = 1

    @property
    def world_size(self) -> int:
        return self.nproc * self.hosts

    def per_rank_batch(self, global_batch: int) -> int:
        """Each rank's share of the global batch, over every process of every host."""
        world = self.world_size
        if global_batch < world or global_batch % world:
            hosts = f"{self.hosts} hosts × {self.nproc} processes" if self.hosts > 1 else f"{self.nproc} processes"
            raise ValueError(f"training.batch_size: {global_batch} is not a multiple of the world size {world} "
                             f"({hosts}); set a multiple of {world}")  # fmt: skip
        return global_batch // world
