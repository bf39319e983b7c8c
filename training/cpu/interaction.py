"""The dot interaction on CPU: fewer passes over memory than TorchRec's `InteractionArch`,
and the fp32 forward and backward as one C pass per sample where the C kernel compiles.

`DotInteraction` computes TorchRec's values and gradients. Its `kernel` is fixed when it is
built: "aten" (`DotProducts`: one `bmm` and a flat `gather`, no concatenation) or "native"
(training/cpu/native/dot_interaction.c: a sample's vectors stay in L1 while its pairs are
computed, instead of a stacked copy, a batched product of 27 × 16 × 27 matrices and a
gather, and in backward two scatters and a second product, each a pass over [B, V, V]).
The native kernel takes fp32 inputs outside autocast and `torch.compile`; anything else
goes to `DotProducts`. `swap_interaction` puts it into a built DLRM.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Literal

import torch
from torch import nn

from training.cpu import native_build
from training.model import dot_interaction as dot
from training.model.dot_interaction import DotProducts, padded_width

Kernel = Literal["native", "aten"]
_I, _P = ctypes.c_int64, ctypes.c_void_p


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


def load_native() -> None:
    """Build and load the C kernel; raises `native_build.NativeUnavailable` where it cannot."""
    _library()


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


class DotInteraction(dot.DotInteraction):
    """The dot interaction of training/model/dot_interaction.py, computed with `kernel`: "aten"
    (`DotProducts`) or "native" (the C pass per sample, for fp32 on CPU)."""

    def __init__(self, num_sparse_features: int, pad_to: int = 8, kernel: Kernel = "aten") -> None:
        super().__init__(num_sparse_features, pad_to)
        if kernel == "native":
            _library()  # raises NativeUnavailable here, not in the first step
        self.kernel = kernel

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        return dot_interaction(dense_features, sparse_features, self.upper, self.lower, self.diagonal, self.pad_to,
                               self.kernel == "native")  # fmt: skip


@torch.fx.wrap  # branches on the input's device and dtype: one opaque call in traced pipelines
def dot_interaction(dense: torch.Tensor, sparse: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                    diagonal: torch.Tensor, pad_to: int, native: bool) -> torch.Tensor:  # fmt: skip
    """`DotProducts`, or the same in one C pass per sample when `native` and the input is
    fp32 on CPU outside autocast and compilation."""
    if native and native_takes(dense):
        return dot_products(dense, sparse.float(), padded_width(dense.shape[1] + upper.numel(), pad_to))
    return DotProducts.apply(dense, sparse.to(dense.dtype), upper, lower, diagonal, pad_to)


def native_takes(dense: torch.Tensor) -> bool:
    return (
        dense.device.type == "cpu"
        and dense.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


def swap_interaction(dlrm: nn.Module, kernel: Kernel) -> bool:
    """Replace a dot DLRM's interaction by a `DotInteraction` computing with `kernel` (see
    `dot.swap_dot_interaction`). Returns whether it swapped (not for DCN)."""
    return dot.swap_dot_interaction(dlrm, lambda features: DotInteraction(features, kernel=kernel))
