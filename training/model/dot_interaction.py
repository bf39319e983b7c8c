"""The DLRM's dot interaction in fewer passes over memory than TorchRec's `InteractionArch`,
on any device.

TorchRec's interaction gathers the upper triangle of each sample's Gram matrix with advanced
indexing, whose backward is a sort-based `index_put` with accumulation: on an H200 at global
batch 65,536 that one kernel took 5.5 ms of a 12.4 ms step (0.6 ms at 8,192). Here the
forward gathers and the backward scatters (each pair lands in one place: no sort, no
accumulation), and the output is zero-padded to a multiple of 8 columns for the top MLP's
first matrix product (`ZeroPaddedInputLinear` takes it with TorchRec's weight shape).

`swap_dot_interaction` puts it into a built DLRM; the CPU path (training/cpu/interaction.py)
adds a native fp32 kernel behind the same module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torchrec.models.dlrm import InteractionArch


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
            upper_pairs = as_bits(gram).gather(1, upper.expand(batch, -1)).view(gram.dtype)
            return torch.cat((dense, upper_pairs, dense.new_zeros(batch, width - dim - pairs)), dim=1)
        out = dense.new_empty(batch, width)
        out[:, :dim] = dense
        torch.gather(as_bits(gram), 1, upper.expand(batch, -1), out=as_bits(out[:, dim : dim + pairs]))
        out[:, dim + pairs :] = 0
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        vectors, symmetric, upper, lower, diagonal = ctx.saved_tensors  # the Gram buffer, reused
        batch, width, dim = vectors.shape
        pair_grad = as_bits(grad[:, dim : dim + upper.numel()])
        as_bits(symmetric).scatter_(1, upper.expand(batch, -1), pair_grad)
        as_bits(symmetric).scatter_(1, lower.expand(batch, -1), pair_grad)
        symmetric.index_fill_(1, diagonal, 0)
        grad_vectors = torch.bmm(symmetric.view(batch, width, width), vectors)
        return grad[:, :dim] + grad_vectors[:, 0], grad_vectors[:, 1:], None, None, None, None


def as_bits(values: torch.Tensor) -> torch.Tensor:
    """2-byte floats seen as int16, for pure data movement (`gather`, `scatter_`): on CPU
    the bf16 kernels copy their operands twice on the way (gather [2048, 729] → [2048, 351]:
    0.35 ms in bf16, 0.17 ms as int16)."""
    return values.view(torch.int16) if values.is_floating_point() and values.element_size() == 2 else values


class DotInteraction(InteractionArch):
    """TorchRec's dot interaction: the dense vector and every pooled embedding, pairwise
    dot products of the upper triangle, concatenated after the dense vector.

    Same values and gradients as `InteractionArch` (`DotProducts`), the pooled embeddings
    cast once to the dense vector's dtype (in bf16 the stack of vectors is built in bf16),
    and the output zero-padded to a multiple of `pad_to` columns. Columns past
    `D + pairs` are zeros.
    """

    def __init__(self, num_sparse_features: int, pad_to: int = 8) -> None:
        super().__init__(num_sparse_features)
        rows, cols = self.triu_indices
        width = self.F + 1
        self.pad_to = pad_to
        self.register_buffer("upper", rows * width + cols, persistent=False)
        self.register_buffer("lower", cols * width + rows, persistent=False)
        self.register_buffer("diagonal", torch.arange(width) * (width + 1), persistent=False)

    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        if self.F <= 0:
            return dense_features
        return dot_products(dense_features, sparse_features, self.upper, self.lower, self.diagonal, self.pad_to)


@torch.fx.wrap  # one opaque call in TorchRec's traced train pipeline
def dot_products(dense: Tensor, sparse: Tensor, upper: Tensor, lower: Tensor, diagonal: Tensor, pad_to: int) -> Tensor:
    return DotProducts.apply(dense, sparse.to(dense.dtype), upper, lower, diagonal, pad_to)


class ZeroPaddedInputLinear(nn.Linear):
    """A `Linear` that also takes inputs wider than `in_features` whose extra columns are
    zeros (`DotInteraction`'s padded output), multiplying them with a zero-padded copy of
    its weight. Parameters keep their shapes, so state dicts are TorchRec's.

    Why: the dot interaction's natural width, D + V(V−1)/2, is odd (367 for 26 tables of
    dim 16), and on a 2-core AVX2 CPU MKL's fp32 GEMMs at K = 367 took 20.5 ms a step
    (forward, weight and input gradients) against 17–18 ms at K = 368; padding the
    [512, 367] weight costs 0.05 ms. GPUs' tensor-core products want K aligned too.
    """

    def forward(self, features: Tensor) -> Tensor:
        return linear_zero_padded(features, self.weight, self.bias)


@torch.fx.wrap  # branches on a shape: one opaque call in TorchRec's traced train pipeline
def linear_zero_padded(features: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return nn.functional.linear(features, padded_to(weight, features.shape[-1]), bias)


def padded_to(weight: Tensor, width: int) -> Tensor:
    """[N, K] → [N, width]: the weight with zero columns after its K."""
    extra = width - weight.shape[1]
    return nn.functional.pad(weight, (0, extra)) if extra else weight


def swap_dot_interaction(dlrm: nn.Module, interaction: Callable[[int], DotInteraction] = DotInteraction) -> bool:
    """Replace a dot DLRM's `inter_arch` (TorchRec's `InteractionArch`) by `interaction(F)`, and
    the top MLP's first layer by a `ZeroPaddedInputLinear` that takes its padded output (same
    parameters). Returns whether it swapped (not for DCN, nor twice)."""
    arch = dlrm.inter_arch
    if type(arch) is not InteractionArch:
        return False
    first = dlrm.over_arch.model[0]._mlp[0]
    linear = first._linear
    padded = ZeroPaddedInputLinear(linear.in_features, linear.out_features, device=torch.device("meta"))
    padded.weight, padded.bias = linear.weight, linear.bias
    first._linear = padded
    # index buffers on the host: sharding moves the dense modules to the device
    dlrm.inter_arch = interaction(arch.F)
    return True
