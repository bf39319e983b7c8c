"""Which kernel applies the embeddings' fused row-wise Adagrad update on CPU.

TorchRec's fused embedding optimizer runs inside fbgemm's table-batched embedding backward
(`fbgemm::split_embedding_backward_codegen_rowwise_adagrad_cpu`). This module registers one
of this project's kernels as that op's CPU kernel for the process, or leaves fbgemm's own:
- "native": one C loop over the ids (training/cpu/native_rowwise_adagrad.py), 3.1–5.5×
  faster than fbgemm's on a 2-core Zen 3 EPYC; needs a C compiler;
- "vectorized": the same in torch ops (training/cpu/rowwise_adagrad.py), 1.8–4.4× faster
  than fbgemm's on a Xeon VM that charges for mixing AVX and SSE code, about 2× slower on
  a Zen 4 EPYC, which does not;
- "fbgemm": fbgemm's JIT kernel.
"auto" is decided without timing anything, so the same job on the same machine always
computes the same way: native where it compiles and fbgemm's op still takes its arguments,
else fbgemm's. GPU kernels are never touched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch

from training.cpu import native_build, native_rowwise_adagrad, rowwise_adagrad
from training.cpu.rowwise_adagrad import FbgemmArgs

OP = "split_embedding_backward_codegen_rowwise_adagrad_cpu"
Kernel = Literal["fbgemm", "vectorized", "native"]
KERNELS: dict[str, Callable[[FbgemmArgs], None]] = {
    "vectorized": rowwise_adagrad.rowwise_adagrad_backward,
    "native": native_rowwise_adagrad.rowwise_adagrad_backward,
}

_library: torch.library.Library | None = None
_installed: Kernel = "fbgemm"


def choose(setting: str, weight_decay: float = 0.0) -> Kernel:
    """The kernel for `training.cpu.embedding_update`: the setting itself, or for "auto" the
    native kernel where it can run here, else fbgemm's. fbgemm's CPU kernel ignores weight
    decay, so a decayed run falls back to the vectorized kernel instead."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    if not fits_this_fbgemm():
        if weight_decay:
            raise RuntimeError(
                f"training.embedding_weight_decay: fbgemm's CPU kernel ignores it and its op {OP} changed "
                "arguments, so this project's kernels cannot stand in; set training.embedding_weight_decay = 0"
            )
        return "fbgemm"
    try:
        native_rowwise_adagrad.kernel()
    except native_build.NativeUnavailable:
        return "vectorized" if weight_decay else "fbgemm"
    return "native"


def use(kernel: Kernel) -> None:
    """Make `kernel` fbgemm's CPU row-wise Adagrad in this process (idempotent)."""
    global _library, _installed
    if kernel == _installed:
        return
    _uninstall()
    if kernel == "fbgemm":
        return
    import fbgemm_gpu

    if not fits_this_fbgemm():
        raise RuntimeError(
            f"training.cpu.embedding_update = '{kernel}': fbgemm {fbgemm_gpu.__version__} changed the "
            f"arguments of fbgemm::{OP} (now {schema_arguments()}); set training.cpu.embedding_update = 'fbgemm'"
        )
    if kernel == "native":
        try:
            native_rowwise_adagrad.kernel()
        except native_build.NativeUnavailable as error:
            raise RuntimeError(
                f"training.cpu.embedding_update = 'native': {error}; install a C compiler or set "
                "training.cpu.embedding_update = 'vectorized'"
            ) from None
    update = KERNELS[kernel]

    def backward(*args, **kwargs) -> None:
        update(FbgemmArgs(*args, **kwargs))

    library = torch.library.Library("fbgemm", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        library.impl(OP, backward, "CPU")
    _library, _installed = library, kernel


def installed() -> Kernel:
    """Which kernel is fbgemm's CPU row-wise Adagrad in this process now."""
    return _installed


def _uninstall() -> None:
    global _library, _installed
    if _library is not None:
        _library._destroy()
    _library, _installed = None, "fbgemm"
    rowwise_adagrad.reset_scratch()


def fits_this_fbgemm() -> bool:
    """Whether fbgemm's op still takes the arguments `FbgemmArgs` names."""
    return schema_arguments() == list(FbgemmArgs._fields)


def schema_arguments() -> list[str]:
    """The argument names of the fbgemm op this module's kernels stand in for."""
    import fbgemm_gpu  # noqa: F401 - registers fbgemm's ops with torch

    return [argument.name for argument in getattr(torch.ops.fbgemm, OP).default._schema.arguments]
