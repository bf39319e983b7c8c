"""The modules training/cpu swaps into a DLRM, against TorchRec's own."""

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from ingestion.reader import build_reader
from training.config import CpuConfig, ModelConfig
from training.cpu import accelerate
from training.cpu.interaction import DotInteraction
from training.cpu.linear import ZeroPaddedInputLinear
from training.cpu.sparse import PooledSparseArch
from training.model.build import build_dlrm, embedding_tables


def test_the_dot_interaction_matches_torchrecs_values_and_gradients() -> None:
    from torchrec.models.dlrm import InteractionArch

    torch.manual_seed(0)
    dense = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(32, 5, 8, dtype=torch.float64, requires_grad=True)
    ours, theirs = DotInteraction(5), InteractionArch(5)
    out, expected = ours(dense, sparse), theirs(dense, sparse)
    width = 8 + 5 * 6 // 2  # 23, padded to 24 with zeros
    assert out.shape == (32, 24) and torch.allclose(out[:, :width], expected) and not out[:, width:].any()
    weights = torch.randn_like(out)  # the padding's gradient goes nowhere
    grads = torch.autograd.grad((out * weights).sum(), (dense, sparse))
    expected_grads = torch.autograd.grad((expected * weights[:, :width]).sum(), (dense, sparse))
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.allclose(got, want)


@pytest.mark.parametrize("reordered", [False, True])
def test_the_pooled_sparse_arch_matches_torchrecs_values_and_gradients(tiny_features, reordered: bool) -> None:
    """Same [B, F, D] as TorchRec's `SparseArch`: a view when the collection's keys come in
    the arch's feature order, blocks put in order when they do not (as from a sharded one)."""
    from torchrec.models.dlrm import SparseArch

    state, files = tiny_features
    bags = EmbeddingBagCollection(tables=embedding_tables(ModelConfig(embedding_dim=8, bottom_mlp=(8,)), state.table_sizes))
    archs = PooledSparseArch(bags), SparseArch(bags)
    if reordered:
        for arch in archs:
            arch._sparse_feature_names = arch.sparse_feature_names[::-1]
    features = next(iter(build_reader(files[2], 64))).sparse_features
    ours, theirs = (arch(features) for arch in archs)
    assert (ours._base is None) == reordered  # no copy in feature order
    assert ours.shape == (64, len(state.table_sizes), 8) and torch.equal(ours, theirs)
    weights = torch.randn_like(ours)
    params = list(bags.parameters())
    our_grads = torch.autograd.grad((ours * weights).sum(), params)
    their_grads = torch.autograd.grad((theirs * weights).sum(), params)
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads, strict=True))


def test_accelerate_swaps_the_pooled_sparse_arch_into_both_archs(tiny_features) -> None:
    state, _ = tiny_features
    for arch in ("dlrm", "dlrm_dcn"):
        model = build_dlrm(ModelConfig(arch=arch, dcn_low_rank_dim=4), state.table_sizes, torch.device("meta"))
        accelerate(model, CpuConfig(), "fp32")
        assert isinstance(model.sparse_arch, PooledSparseArch)
        assert isinstance(model.inter_arch, DotInteraction) == (arch == "dlrm")


def test_the_dot_interaction_in_bf16_moves_bits_exactly() -> None:
    """In bf16 the pairs are the Gram matrix's entries bit for bit, and the vectors'
    gradient is the bmm of the symmetric pair gradients, both computed here with plain ops."""
    torch.manual_seed(0)
    dense = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    sparse = torch.randn(16, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    out = DotInteraction(5)(dense, sparse)
    vectors = torch.cat((dense.unsqueeze(1), sparse), dim=1).detach()
    gram = torch.bmm(vectors, vectors.transpose(1, 2))
    rows, cols = torch.triu_indices(6, 6, offset=1)
    assert torch.equal(out[:, 8:23], gram[:, rows, cols])
    weights = torch.randn_like(out)
    out.backward(weights)
    symmetric = torch.zeros(16, 6, 6, dtype=torch.bfloat16)
    symmetric[:, rows, cols] = weights[:, 8:23]
    symmetric[:, cols, rows] = weights[:, 8:23]
    assert torch.equal(sparse.grad, torch.bmm(symmetric, vectors)[:, 1:])


def test_the_zero_padded_linear_is_the_linear_of_the_unpadded_input() -> None:
    torch.manual_seed(0)
    padded = ZeroPaddedInputLinear(23, 7).double()
    plain = torch.nn.Linear(23, 7).double()
    plain.load_state_dict(padded.state_dict())
    features = torch.randn(9, 23, dtype=torch.float64)
    wide = torch.cat((features, torch.zeros(9, 1, dtype=torch.float64)), dim=1)
    weights = torch.randn(9, 7, dtype=torch.float64)
    (padded(wide) * weights).sum().backward()
    (plain(features) * weights).sum().backward()
    assert torch.allclose(padded(wide), plain(features)) and torch.allclose(padded(features), plain(features))
    assert padded.weight.grad.shape == (7, 23)
    assert torch.allclose(padded.weight.grad, plain.weight.grad) and torch.allclose(padded.bias.grad, plain.bias.grad)


def test_the_dot_model_keeps_torchrecs_parameter_names_and_shapes(tiny_features) -> None:
    """The padded interaction and top-MLP layer change no parameter: checkpoints and
    exported models are TorchRec's DLRM's."""
    from torchrec.models.dlrm import DLRM

    state, _ = tiny_features
    config = ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1))
    ours = build_dlrm(config, state.table_sizes, torch.device("meta"))
    accelerate(ours, CpuConfig(), "fp32")
    theirs = DLRM(embedding_bag_collection=ours.sparse_arch.embedding_bag_collection, dense_in_features=13,
                  dense_arch_layer_sizes=[32, 8], over_arch_layer_sizes=[32, 1], dense_device=torch.device("meta"))  # fmt: skip
    assert isinstance(ours.over_arch.model[0]._mlp[0]._linear, ZeroPaddedInputLinear)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
