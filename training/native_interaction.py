"""The dot interaction's fp32 CPU forward and backward as one C pass per sample.

The same values as the model's `DotProducts` (training/model.py) to float rounding, from
training/native/dot_interaction.c: a sample's vectors stay in L1 while its pairs are
computed, instead of a stacked copy, a batched product of 27 × 16 × 27 matrices and a
gather (and in backward two scatters and a second product), each a pass over [B, V, V].
`use("native")` routes the model's fp32 CPU interaction here; `training.cpu_interaction`
chooses (training/worker.py).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Literal

import torch

from training import native_build

Kernel = Literal["native", "aten"]
_I, _P = ctypes.c_int64, ctypes.c_void_p
_kernel: Kernel = "aten"


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """The compiled kernels (raises `native_build.NativeUnavailable` where they cannot build).

    Built with OpenMP, so that a batch is split over torch's own OpenMP threads (the process
    has loaded torch's libgomp.so.1, and the kernels' library links to that one); where the
    compiler has no OpenMP, built without and run on one thread.
    """
    try:
        library = native_build.load("dot_interaction", ("-fopenmp",))
    except native_build.NativeUnavailable:
        library = native_build.load("dot_interaction")
    library.dlrm_dot_forward.argtypes = (_P, _P, _P, _I, _I, _I, _I, _I)
    library.dlrm_dot_backward.argtypes = (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I)
    library.dlrm_dot_forward.restype = library.dlrm_dot_backward.restype = ctypes.c_int
    return library


def available() -> bool:
    try:
        _library()
    except native_build.NativeUnavailable:
        return False
    return True


def use(kernel: Kernel) -> None:
    """Compute the model's fp32 CPU dot interaction with `kernel` in this process; "native"
    raises `native_build.NativeUnavailable` where the C kernel cannot be built."""
    global _kernel
    if kernel == "native":
        _library()
    _kernel = kernel


def in_use() -> Kernel:
    return _kernel


def takes(dense: torch.Tensor) -> bool:
    """Whether the native kernel computes the interaction of `dense` (its dtype and device)."""
    return (
        _kernel == "native"
        and dense.device.type == "cpu"
        and dense.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


def dot_products(dense: torch.Tensor, sparse: torch.Tensor, width: int) -> torch.Tensor:
    """dense [B, D], sparse [B, F, D] (fp32, CPU) → [B, width]: the dense vector, the upper
    triangle of each sample's Gram matrix row by row (diagonal excluded), then zeros."""
    return NativeDotProducts.apply(dense, sparse, width)


class NativeDotProducts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense: torch.Tensor, sparse: torch.Tensor, width: int) -> torch.Tensor:
        dense, sparse = dense.contiguous(), sparse.contiguous()
        batch, dim = dense.shape
        features = sparse.shape[1]
        if width < dim + features * (features + 1) // 2:
            raise ValueError(f"dot interaction: width {width} is narrower than its {dim} + pairs")
        out = dense.new_empty(batch, width)
        _check(_library().dlrm_dot_forward(dense.data_ptr(), sparse.data_ptr(), out.data_ptr(), batch, features, dim,
                                           width, torch.get_num_threads()))  # fmt: skip
        ctx.save_for_backward(dense, sparse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dense, sparse = ctx.saved_tensors
        grad = grad.float().contiguous()  # every tensor the kernel reads is bound to a name
        batch, dim = dense.shape
        features = sparse.shape[1]
        grad_dense, grad_sparse = torch.empty_like(dense), torch.empty_like(sparse)
        _check(_library().dlrm_dot_backward(grad.data_ptr(), dense.data_ptr(), sparse.data_ptr(), grad_dense.data_ptr(),
                                            grad_sparse.data_ptr(), batch, features, dim, grad.shape[1],
                                            torch.get_num_threads()))  # fmt: skip
        return grad_dense, grad_sparse, None


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("dot interaction: the native kernel could not allocate its work memory")
