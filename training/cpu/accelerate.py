"""`accelerate`: the one entry point that applies the CPU kernels to a model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from training.config import CpuConfig
from training.cpu import embedding_update, interaction, linear, memory, native_build, sparse
from training.model.build import dlrms_in


@dataclass(frozen=True)
class CpuKernels:
    """Which kernel computes what on this CPU host (recorded with the run)."""

    embedding_update: str  # "native", "vectorized" or "fbgemm"
    interaction: str  # "native", "aten" (torch's ops) or "dcn-v2" (no dot interaction)
    matmul: str  # "onednn" or "aten"
    malloc: str  # "retain" or "system"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def accelerate(model: nn.Module, config: CpuConfig, precision: str, embedding_weight_decay: float = 0.0) -> CpuKernels:
    """Swap the CPU kernels into every DLRM of `model` and set up the process for them.

    Call it before sharding: the sparse arch it swaps in holds the collection that the
    planner then shards. The model's parameters and their names are unchanged, so
    checkpoints and exported models are TorchRec's. Every choice follows from `config`, the
    precision and what this machine can build: the same job always computes the same way.
    """
    malloc = "retain" if config.malloc == "retain" and memory.retain() else "system"
    update = embedding_update.choose(config.embedding_update, embedding_weight_decay)
    embedding_update.use(update)
    dot_kernel = _interaction_kernel(config, precision)
    matmul = "onednn" if config.matmul == "onednn" and precision == "fp32" else "aten"
    has_dot = False
    for dlrm in dlrms_in(model):
        sparse.swap_sparse_arch(dlrm)
        has_dot = interaction.swap_interaction(dlrm, dot_kernel) or has_dot
        if matmul == "onednn":
            linear.swap_relu_layers(dlrm)
    return CpuKernels(update, dot_kernel if has_dot else "dcn-v2", matmul, malloc)


def _interaction_kernel(config: CpuConfig, precision: str) -> interaction.Kernel:
    """"native" for fp32 where the C kernel builds (an error if it was asked for and does
    not); torch's ops otherwise (bf16 has no native kernel)."""
    if config.interaction == "aten" or precision != "fp32":
        return "aten"
    try:
        interaction.load_native()
    except native_build.NativeUnavailable as error:
        if config.interaction == "native":
            raise RuntimeError(f"training.cpu.interaction = 'native': {error}; install a C compiler or set "
                               "training.cpu.interaction = 'aten'") from None
        return "aten"
    return "native"
