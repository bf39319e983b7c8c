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
from torchrec.models.dlrm import InteractionArch

from training.cpu import native_build
from training.cpu.linear import ZeroPaddedInputLinear

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


class DotInteraction(InteractionArch):
    """TorchRec's dot interaction: the dense vector and every pooled embedding, pairwise
    dot products of the upper triangle, concatenated after the dense vector.

    Same values and gradients as `InteractionArch` with fewer passes over memory, the pooled
    embeddings cast once to the dense vector's dtype (in bf16 the stack of vectors is built
    in bf16), and the output zero-padded to a multiple of `pad_to` columns for the top MLP's
    first matrix product (see `ZeroPaddedInputLinear`). Columns past `D + pairs` are zeros.
    """

    def __init__(self, num_sparse_features: int, pad_to: int = 8, kernel: Kernel = "aten") -> None:
        super().__init__(num_sparse_features)
        if kernel == "native":
            _library()  # raises NativeUnavailable here, not in the first step
        rows, cols = self.triu_indices
        width = self.F + 1
        self.pad_to, self.kernel = pad_to, kernel
        self.register_buffer("upper", rows * width + cols, persistent=False)
        self.register_buffer("lower", cols * width + rows, persistent=False)
        self.register_buffer("diagonal", torch.arange(width) * (width + 1), persistent=False)

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


def padded_width(columns: int, pad_to: int) -> int:
    return -(-columns // pad_to) * pad_to


class DotProducts(torch.autograd.Function):
    """dense [B, D], sparse [B, F, D] → [B, W]: the dense vector, then the upper triangle
    (diagonal excluded) of each V × V Gram matrix of the V = F + 1 vectors, flat, then zeros
    up to W, a multiple of `pad_to`.

    Forward: one `bmm`, and a flat `gather` written straight into the output (no
    concatenation after it). Backward: the pair gradients are scattered to (i, j) and (j, i)
    of the forward's own Gram buffer, its diagonal zeroed, then one `bmm` with the vectors:
    no fresh V × V matrix to zero and no concatenated copy of the gradient. Autograd through
    the forward would take two `bmm`s, an add, a transposed copy and a `scatter_add`.
    """

    @staticmethod
    def forward(ctx, dense: torch.Tensor, sparse: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                diagonal: torch.Tensor, pad_to: int) -> torch.Tensor:  # fmt: skip
        batch, dim = dense.shape
        vectors = torch.cat((dense.unsqueeze(1), sparse), dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)  # [B, V²]
        pairs = upper.numel()
        width = padded_width(dim + pairs, pad_to)
        ctx.save_for_backward(vectors, gram, upper, lower, diagonal)
        if torch.compiler.is_compiling():
            # functional form: dynamo cannot trace `out=` into a view once the batch size
            # turns symbolic (evaluation batches), and inductor fuses the concatenation anyway
            upper_pairs = _bits(gram).gather(1, upper.expand(batch, -1)).view(gram.dtype)
            return torch.cat((dense, upper_pairs, dense.new_zeros(batch, width - dim - pairs)), dim=1)
        out = dense.new_empty(batch, width)
        out[:, :dim] = dense
        torch.gather(_bits(gram), 1, upper.expand(batch, -1), out=_bits(out[:, dim : dim + pairs]))
        out[:, dim + pairs :] = 0
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        vectors, symmetric, upper, lower, diagonal = ctx.saved_tensors  # the Gram buffer, reused
        batch, width, dim = vectors.shape
        pair_grad = _bits(grad[:, dim : dim + upper.numel()])
        _bits(symmetric).scatter_(1, upper.expand(batch, -1), pair_grad)
        _bits(symmetric).scatter_(1, lower.expand(batch, -1), pair_grad)
        symmetric.index_fill_(1, diagonal, 0)
        grad_vectors = torch.bmm(symmetric.view(batch, width, width), vectors)
        return grad[:, :dim] + grad_vectors[:, 0], grad_vectors[:, 1:], None, None, None, None


def _bits(values: torch.Tensor) -> torch.Tensor:
    """2-byte floats seen as int16, for pure data movement (`gather`, `scatter_`): on CPU
    the bf16 kernels copy their operands twice on the way (gather [2048, 729] → [2048, 351]:
    0.35 ms in bf16, 0.17 ms as int16)."""
    return values.view(torch.int16) if values.is_floating_point() and values.element_size() == 2 else values


def swap_interaction(dlrm: nn.Module, kernel: Kernel) -> bool:
    """Replace a dot DLRM's `inter_arch` (TorchRec's `InteractionArch`) by a `DotInteraction`
    computing with `kernel`, and the top MLP's first layer by a `ZeroPaddedInputLinear` that
    takes its padded output (same parameters). Returns whether it swapped (not for DCN)."""
    arch = dlrm.inter_arch
    if type(arch) is not InteractionArch:
        return False
    first = dlrm.over_arch.model[0]._mlp[0]
    linear = first._linear
    padded = ZeroPaddedInputLinear(linear.in_features, linear.out_features, device=torch.device("meta"))
    padded.weight, padded.bias = linear.weight, linear.bias
    first._linear = padded
    # index buffers on the host: sharding moves the dense modules to the device
    dlrm.inter_arch = DotInteraction(arch.F, kernel=kernel)
    return True
