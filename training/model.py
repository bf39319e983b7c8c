"""DLRM models built from the config and the preprocessing state's table sizes.

    dense features ─▶ bottom MLP ─┐
                                  ├─▶ interaction (dot | DCN-v2 cross) ─▶ top MLP ─▶ logit
    sparse ids ─▶ embedding bags ─┘

The model is plain TorchRec modules; it knows nothing of processes or devices beyond the
one it is built on (`meta` when sharding will materialise it).
"""

from __future__ import annotations

import functools
import itertools
import shutil
from collections.abc import Mapping

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain, InteractionArch, SparseArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import Perceptron
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ingestion.schema import NUM_DENSE
from training import cpu_linear, native_interaction
from training.config import ModelConfig


def table_name(feature: str) -> str:
    return f"t_{feature}"


def embedding_tables(config: ModelConfig, table_sizes: Mapping[str, int]) -> list[EmbeddingBagConfig]:
    """One table per categorical feature; rows from the preprocessing state."""
    return [
        EmbeddingBagConfig(
            name=table_name(feature),
            embedding_dim=config.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for feature, rows in table_sizes.items()
    ]


class SparseFirst:
    """A DLRM forward that looks the embeddings up first, then runs the bottom MLP, the
    interaction and the top MLP in one call, `dense_path`: the part `torch.compile` turns
    into one graph (see `compile_dense_parts`). TorchRec's order, bottom MLP first, leaves
    the embedding lookup between them. Same modules, same parameters, same values.
    """

    sparse_arch: nn.Module
    dense_arch: nn.Module
    inter_arch: nn.Module
    over_arch: nn.Module

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense_path(dense_features, self.sparse_arch(sparse_features))

    def dense_path(self, dense_features: torch.Tensor, embedded_sparse: torch.Tensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))


class DotDLRM(SparseFirst, DLRM):
    """TorchRec's `DLRM` (dot interaction), embeddings first."""


class CrossDLRM(SparseFirst, DLRM_DCN):
    """TorchRec's `DLRM_DCN` (DCN-v2 cross layers), embeddings first."""


def build_dlrm(config: ModelConfig, table_sizes: Mapping[str, int], device: torch.device) -> DLRM:
    """The DLRM (or DLRM-DCN) of `config`; its forward takes (dense [B, 13], KJT) → logits [B, 1]."""
    bags = EmbeddingBagCollection(tables=embedding_tables(config, table_sizes), device=device)
    common = {
        "embedding_bag_collection": bags,
        "dense_in_features": NUM_DENSE,
        "dense_arch_layer_sizes": list(config.bottom_mlp),
        "over_arch_layer_sizes": list(config.top_mlp),
        "dense_device": device,
    }
    if config.arch == "dlrm_dcn":
        model = CrossDLRM(dcn_num_layers=config.dcn_num_layers, dcn_low_rank_dim=config.dcn_low_rank_dim, **common)
    else:
        model = DotDLRM(**common)
        model.inter_arch = DotInteraction(num_sparse_features=len(table_sizes))
        first = model.over_arch.model[0]._mlp[0]
        first._linear = ZeroPaddedInputLinear(first._linear.in_features, first._linear.out_features, device=device)
    last = model.over_arch.model[1]
    model.over_arch.model[1] = Float32Linear(last.in_features, last.out_features, device=device)
    model.sparse_arch = PooledSparseArch(bags)
    for mlp in (model.dense_arch.model, model.over_arch.model[0]):
        mlp._mlp = nn.Sequential(*(ReLUPerceptron.taking_over(layer) for layer in mlp._mlp))
    return model


def compile_dense_parts(model: nn.Module, device: torch.device) -> list[str]:
    """`torch.compile` each DLRM's dense path (bottom MLP, interaction, top MLP) as one graph.

    One graph, not one per module: inductor fuses across the modules' edges (the bottom
    MLP's last ReLU into the interaction's concatenation), and a step pays one guard check
    and one compiled-function call forward and backward instead of three (a bf16 step took
    0.95–0.99 of the time in five in-process A/Bs on 2 AVX-512 cores). The method is
    replaced on the instance, so parameter names and checkpoints are those of the eager
    model. Returns the compiled paths' names.
    """
    if device.type == "cpu" and not any(map(shutil.which, ("g++", "c++", "clang++"))):
        raise RuntimeError(
            "training.compile: torch.compile on CPU needs a C++ compiler and none is on PATH "
            "(g++, c++ or clang++): install one, or set training.compile = false"
        )
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, SparseFirst):
            module.dense_path = torch.compile(module.dense_path)  # type: ignore[method-assign]
            compiled.append(f"{name}.dense_path" if name else "dense_path")
    return compiled


class PooledSparseArch(SparseArch):
    """TorchRec's sparse arch without its split-and-concatenate.

    The collection's pooled output is [B, F·D], one D-wide block per key. When the keys come
    in the arch's feature order (one process, or any unsharded collection), [B, F, D] is a
    view of it; TorchRec's `SparseArch` splits it per key and concatenates the pieces again,
    a copy forward and backward (about 1.5 ms of a 20 ms bf16 step at batch 2048 on 2
    cores). A sharded collection lists its keys shard by shard; then one `index_select`
    puts the blocks in feature order.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__(embedding_bag_collection)
        dims = {config.embedding_dim for config in embedding_bag_collection.embedding_bag_configs()}
        if dims != {self.D}:
            raise ValueError(f"the dot interaction needs one embedding dim for every table, got {sorted(dims)}")

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return in_feature_order(self.embedding_bag_collection(features), self.sparse_feature_names, self.D)


@torch.fx.wrap  # one opaque call in fx graphs: TorchRec's train pipeline traces the model
def in_feature_order(pooled: KeyedTensor, features: list[str], dim: int) -> torch.Tensor:
    """Pooled embeddings [B, F·D] as [B, F, D] with the blocks in `features` order."""
    keys = pooled.keys()
    blocks = pooled.values().reshape(-1, len(keys), dim)
    if keys == features:
        return blocks
    return blocks.index_select(1, _block_order(tuple(keys), tuple(features), blocks.device))


@functools.lru_cache(maxsize=8)
def _block_order(keys: tuple[str, ...], features: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """Where each feature's block sits among `keys`; built once, not copied to a GPU every step."""
    return torch.tensor([keys.index(name) for name in features], device=device)


class DotInteraction(InteractionArch):
    """TorchRec's dot interaction: the dense vector and every pooled embedding, pairwise
    dot products of the upper triangle, concatenated after the dense vector.

    Same values and gradients as `InteractionArch` with fewer passes over memory (see
    `DotProducts`), the pooled embeddings cast once to the dense vector's dtype so that in
    bf16 the stack of vectors is built in bf16, and the output zero-padded to a multiple of
    `pad_to` columns for the top MLP's first matrix product (see `ZeroPaddedInputLinear`).
    Columns past `D + pairs` are zeros.
    """

    def __init__(self, num_sparse_features: int, pad_to: int = 8) -> None:
        super().__init__(num_sparse_features)
        rows, cols = self.triu_indices
        width = self.F + 1
        self.pad_to = pad_to
        self.register_buffer("upper", rows * width + cols, persistent=False)
        self.register_buffer("lower", cols * width + rows, persistent=False)
        self.register_buffer("diagonal", torch.arange(width) * (width + 1), persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        return dot_interaction(dense_features, sparse_features, self.upper, self.lower, self.diagonal, self.pad_to)


@torch.fx.wrap  # branches on the input's device and dtype: one opaque call in traced pipelines
def dot_interaction(dense: torch.Tensor, sparse: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                    diagonal: torch.Tensor, pad_to: int) -> torch.Tensor:  # fmt: skip
    """`DotProducts`, or the same in one C pass per sample where `native_interaction` takes it."""
    if native_interaction.takes(dense):
        return native_interaction.dot_products(dense, sparse.float(), padded_width(dense.shape[1] + upper.numel(), pad_to))
    return DotProducts.apply(dense, sparse.to(dense.dtype), upper, lower, diagonal, pad_to)


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


class ZeroPaddedInputLinear(nn.Linear):
    """A `Linear` that also takes inputs wider than `in_features` whose extra columns are
    zeros (`DotInteraction`'s padded output), multiplying them with a zero-padded copy of
    its weight. Parameters keep their shapes, so state dicts are TorchRec's.

    Why: the dot interaction's natural width, D + V(V−1)/2, is odd (367 for 26 tables of
    dim 16), and on a 2-core AVX2 CPU MKL's fp32 GEMMs at K = 367 took 20.5 ms a step
    (forward, weight and input gradients) against 17–18 ms at K = 368; padding the
    [512, 367] weight costs 0.05 ms.
    """

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return linear_zero_padded(features, self.weight, self.bias)


@torch.fx.wrap  # branches on a shape: one opaque call in TorchRec's traced train pipeline
def linear_zero_padded(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return nn.functional.linear(features, padded_to(weight, features.shape[-1]), bias)


def padded_to(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] → [N, width]: the weight with zero columns after its K."""
    extra = width - weight.shape[1]
    return nn.functional.pad(weight, (0, extra)) if extra else weight


class ReLUPerceptron(Perceptron):
    """TorchRec's `Perceptron` with a ReLU (same modules, same parameter names) whose fp32
    product on CPU runs in oneDNN with the bias and the ReLU fused once `cpu_linear.enable()`
    was called (training/cpu_linear.py); everywhere else it computes as TorchRec's does."""

    @classmethod
    def taking_over(cls, layer: nn.Module) -> nn.Module:
        """`layer` as a `ReLUPerceptron` with its own linear module, if it is a ReLU perceptron."""
        if type(layer) is not Perceptron or layer._activation_fn is not torch.relu:
            return layer
        taken = cls(layer._in_size, layer._out_size, device=torch.device("meta"))
        taken._linear = layer._linear
        return taken

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        padded = isinstance(self._linear, ZeroPaddedInputLinear)
        return relu_layer(input, self._linear.weight, self._linear.bias, padded)


@torch.fx.wrap  # branches on the input's device, dtype and shape: one opaque call in traced pipelines
def relu_layer(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, zero_padded_input: bool) -> torch.Tensor:
    """relu(features @ weight.T + bias), multiplying a zero-padded weight when
    `zero_padded_input` (see `ZeroPaddedInputLinear`)."""
    if zero_padded_input:
        weight = padded_to(weight, features.shape[-1])
    if cpu_linear.takes(features):
        return cpu_linear.onednn_linear_relu(features, weight, bias)
    return torch.relu(nn.functional.linear(features, weight, bias))


class Float32Linear(nn.Linear):
    """A `Linear` that computes in float32 under autocast: the top MLP's last layer, whose
    output is the logit. In bf16 a logit near −2 would be rounded to steps of 1/64, and
    the predictions, NE and calibration with it; the layer is 256 → 1, so fp32 costs
    nothing (its products took 20 µs in fp32 against ~50 µs in bf16 on AMX, forward and
    each gradient)."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=features.device.type, enabled=False):
            return nn.functional.linear(features.float(), self.weight, self.bias)


def _bits(values: torch.Tensor) -> torch.Tensor:
    """2-byte floats seen as int16, for pure data movement (`gather`, `scatter_`): on CPU
    the bf16 kernels copy their operands twice on the way (gather [2048, 729] → [2048, 351]:
    0.35 ms in bf16, 0.17 ms as int16)."""
    return values.view(torch.int16) if values.is_floating_point() and values.element_size() == 2 else values


def build_train_model(config: ModelConfig, table_sizes: Mapping[str, int], device: torch.device) -> DLRMTrain:
    """The DLRM wrapped with its loss: forward(Batch) → (loss, (loss, logits, labels))."""
    return DLRMTrain(build_dlrm(config, table_sizes, device))


def training_flops_per_sample(config: ModelConfig, num_tables: int) -> float:
    """Multiply-adds ×2 of the MLPs and the dot interaction, forward + backward (≈ 3× forward)."""
    def mlp(sizes: list[int]) -> float:
        return sum(2.0 * a * b for a, b in itertools.pairwise(sizes))

    vectors = num_tables + 1
    interactions = vectors * (vectors - 1) // 2
    forward = (
        mlp([NUM_DENSE, *config.bottom_mlp])
        + 2.0 * vectors * vectors * config.embedding_dim
        + mlp([config.embedding_dim + interactions, *config.top_mlp])
    )
    return 3.0 * forward
