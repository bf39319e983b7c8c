"""Which kernel updates the embeddings on CPU: fbgemm's, or one of this project's two.

No kernel wins everywhere. fbgemm's JIT kernel updates row by row in code that mixes AVX
and SSE instructions: on a Xeon VM with AMX that cost ~550 ns per distinct row and the
vectorised kernel (training/cpu_rowwise_adagrad.py) was 1.8-4.4x faster; on a Zen 4 EPYC,
which does not charge for the mix, fbgemm's was about 2x faster than the vectorised one.
The native kernel (training/native_rowwise_adagrad.py, C compiled on first use) needs a C
compiler. `training.cpu_embedding_update = "auto"` therefore times each kernel that runs
here on a probe shaped like the job's tables and keeps the fastest, and every rank keeps
the same one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from training import cpu_rowwise_adagrad, native_build, native_rowwise_adagrad

Kernel = Literal["fbgemm", "vectorized", "native"]
KERNELS: tuple[Kernel, ...] = ("fbgemm", "vectorized", "native")
# Probe: a few tables of the job's width and its local batch, ids drawn uniformly (every
# id a distinct row, the per-row cost that separates the kernels).
PROBE_TABLES, PROBE_ROWS, PROBE_MAX_BATCH = 8, 50_000, 2048
# This project's kernels must win by this much to replace the library's own.
MARGIN = 0.9


@dataclass(frozen=True)
class UpdateChoice:
    kernel: Kernel
    probe_ms: dict[str, float]  # per kernel; empty when the kernel was configured, not timed


def use(kernel: Kernel) -> None:
    """Make `kernel` the embeddings' CPU update in this process."""
    if kernel == "fbgemm":
        cpu_rowwise_adagrad.uninstall()
    else:
        cpu_rowwise_adagrad.install(kernel)


def probe_ms(embedding_dim: int, batch: int, turns: int = 3, steps: int = 4) -> dict[str, float]:
    """Forward + backward with the update of a probe table batch, per kernel, in ms: the best
    of `turns`, taken in turns so a busy moment of a shared machine hits all alike. Leaves
    fbgemm's kernel installed. Only fbgemm's is timed when this fbgemm's op no longer takes
    this project's kernels' arguments (its version changed them); the native one only where
    it compiles."""
    kernels = available()
    tables = cpu_tables(PROBE_TABLES, PROBE_ROWS, embedding_dim)
    batch = max(1, min(batch, PROBE_MAX_BATCH))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PROBE_ROWS, (PROBE_TABLES * batch,), generator=generator)
    offsets = torch.arange(ids.numel() + 1)
    grad = torch.randn(batch, PROBE_TABLES * embedding_dim, generator=generator)
    best = dict.fromkeys(kernels, float("inf"))
    try:
        for _ in range(turns):
            for kernel in kernels:
                use(kernel)
                tables(ids, offsets).backward(grad)  # warm: fbgemm compiles its kernel here
                started = time.perf_counter()
                for _ in range(steps):
                    tables(ids, offsets).backward(grad)
                best[kernel] = min(best[kernel], (time.perf_counter() - started) / steps * 1e3)
    finally:
        use("fbgemm")
    return best


def available() -> tuple[Kernel, ...]:
    """The kernels that can run in this process."""
    if not cpu_rowwise_adagrad.fits_this_fbgemm():
        return ("fbgemm",)
    try:
        native_rowwise_adagrad.kernel()
    except native_build.NativeUnavailable:
        return ("fbgemm", "vectorized")
    return KERNELS


def faster(times_ms: dict[str, float]) -> Kernel:
    """The fastest of this project's kernels that were timed, when clearly faster than
    fbgemm's: ties keep the library's own."""
    ours = {kernel: ms for kernel, ms in times_ms.items() if kernel != "fbgemm"}
    best = min(ours, key=ours.get, default=None)  # type: ignore[arg-type]
    return best if best is not None and ours[best] < MARGIN * times_ms["fbgemm"] else "fbgemm"  # type: ignore[return-value]



def cpu_tables(count: int, rows: int, embedding_dim: int) -> torch.nn.Module:
    """fbgemm's table-batched module of `count` tables in host memory, with exact row-wise
    Adagrad fused into its backward (what TorchRec builds for a CPU shard)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        ComputeDevice,
        EmbeddingLocation,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    spec = (rows, embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
    return SplitTableBatchedEmbeddingBagsCodegen([spec] * count, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                 learning_rate=0.01)  # fmt: skip
