import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from ingestion.reader import build_reader
from training.config import ModelConfig
from training.model import (
    build_dlrm,
    build_train_model,
    embedding_tables,
    training_flops_per_sample,
)


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_model_scores_a_reader_batch(tiny_features, arch: str) -> None:
    state, files = tiny_features
    config = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), dcn_low_rank_dim=4)
    model = build_dlrm(config, state.table_sizes, torch.device("cpu"))
    batch = next(iter(build_reader(files[2], 64)))
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (64, 1) and torch.isfinite(logits).all()


def test_tables_follow_the_preprocessing_state(tiny_features) -> None:
    state, _ = tiny_features
    tables = embedding_tables(ModelConfig(embedding_dim=8, bottom_mlp=(8,)), state.table_sizes)
    assert [(t.feature_names[0], t.num_embeddings, t.embedding_dim) for t in tables] == [
        (name, rows, 8) for name, rows in state.table_sizes.items()
    ]


def test_meta_model_allocates_nothing(tiny_features) -> None:
    state, _ = tiny_features
    model = build_train_model(ModelConfig(), state.table_sizes, torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())


def test_training_flops_grow_with_the_mlps() -> None:
    small = training_flops_per_sample(ModelConfig(embedding_dim=16, bottom_mlp=(64, 16), top_mlp=(64, 1)), 26)
    large = training_flops_per_sample(ModelConfig(), 26)
    # multiply-adds forward: bottom 13·512 + 512·256 + 256·16 = 141,824; dot interaction of
    # 27 vectors 27·27·16 = 11,664; top (16 + 351)·512 + 512·256 + 256·1 = 319,232.
    # FLOPs = 2 per multiply-add, training ≈ 3 × forward.
    assert large == 3 * 2 * (141_824 + 11_664 + 319_232)
    assert small < large


def test_the_dot_interaction_matches_torchrecs_values_and_gradients() -> None:
    from torchrec.models.dlrm import InteractionArch

    from training.model import DotInteraction

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


def test_the_dot_model_uses_the_flat_gather(tiny_features) -> None:
    from training.model import DotInteraction

    state, _ = tiny_features
    model = build_dlrm(ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), state.table_sizes,
                       torch.device("meta"))  # fmt: skip
    assert isinstance(model.inter_arch, DotInteraction) and model.inter_arch.F == len(state.table_sizes)


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_compiled_dense_parts_compute_what_the_eager_model_computes(tiny_features, arch: str) -> None:
    """Compiled in place, as one graph: the same parameter names (checkpoints load either
    way), and the same logits and gradients to float32 rounding."""
    import copy

    from training.model import compile_dense_parts

    state, files = tiny_features
    torch.manual_seed(0)
    config = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), dcn_low_rank_dim=4)
    eager = build_dlrm(config, state.table_sizes, torch.device("cpu"))
    compiled = copy.deepcopy(eager)
    assert compile_dense_parts(compiled, torch.device("cpu")) == ["dense_path"]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    batch = next(iter(build_reader(files[2], 64)))
    outputs = []
    for model in (eager, compiled):
        logits = model(batch.dense_features, batch.sparse_features)
        logits.sum().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_logits, eager_grads), (compiled_logits, compiled_grads) = outputs
    assert torch.allclose(compiled_logits, eager_logits, atol=1e-5)
    for name, grad in eager_grads.items():
        assert torch.allclose(compiled_grads[name], grad, atol=1e-5), name
    # evaluation batches of other sizes recompile with a symbolic batch size
    with torch.no_grad():
        for size in (200, 37):
            other = next(iter(build_reader(files[2], size)))
            expected = eager(other.dense_features, other.sparse_features)
            assert torch.allclose(compiled(other.dense_features, other.sparse_features), expected, atol=1e-5)


def test_compiling_on_cpu_without_a_cxx_compiler_is_one_clear_error_mocked_path(monkeypatch) -> None:
    """PATH is mocked to hold no C++ compiler."""
    from training import model as model_module

    monkeypatch.setattr(model_module.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="training.compile: .*C\\+\\+ compiler.*set training.compile = false"):
        model_module.compile_dense_parts(torch.nn.Linear(2, 2), torch.device("cpu"))


@pytest.mark.parametrize("reordered", [False, True])
def test_the_pooled_sparse_arch_matches_torchrecs_values_and_gradients(tiny_features, reordered: bool) -> None:
    """Same [B, F, D] as TorchRec's `SparseArch`: a view when the collection's keys come in
    the arch's feature order, blocks put in order when they do not (as from a sharded one)."""
    from torchrec.models.dlrm import SparseArch

    from training.model import PooledSparseArch

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


def test_both_archs_use_the_pooled_sparse_arch(tiny_features) -> None:
    from training.model import PooledSparseArch

    state, _ = tiny_features
    for arch in ("dlrm", "dlrm_dcn"):
        model = build_dlrm(ModelConfig(arch=arch, dcn_low_rank_dim=4), state.table_sizes, torch.device("meta"))
        assert isinstance(model.sparse_arch, PooledSparseArch)


def test_the_dot_interaction_in_bf16_moves_bits_exactly() -> None:
    """In bf16 the pairs are the Gram matrix's entries bit for bit, and the vectors'
    gradient is the bmm of the symmetric pair gradients, both computed here with plain ops."""
    from training.model import DotInteraction

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
    from training.model import ZeroPaddedInputLinear

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

    from training.model import ZeroPaddedInputLinear

    state, _ = tiny_features
    config = ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1))
    ours = build_dlrm(config, state.table_sizes, torch.device("meta"))
    theirs = DLRM(embedding_bag_collection=ours.sparse_arch.embedding_bag_collection, dense_in_features=13,
                  dense_arch_layer_sizes=[32, 8], over_arch_layer_sizes=[32, 1], dense_device=torch.device("meta"))  # fmt: skip
    assert isinstance(ours.over_arch.model[0]._mlp[0]._linear, ZeroPaddedInputLinear)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


def test_the_logit_layer_computes_in_float32_under_bf16_autocast() -> None:
    """bf16 logits would come in steps of 1/64 near −2: predictions tie and calibration
    coarsens. The last layer takes its bf16 input to float32 and multiplies there."""
    from training.model import Float32Linear

    torch.manual_seed(0)
    layer = Float32Linear(256, 1)
    hidden = torch.randn(512, 256).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer(hidden)
    assert logits.dtype == torch.float32
    exact = hidden.double() @ layer.weight.double().t() + layer.bias.double()
    assert torch.allclose(logits.double(), exact, atol=1e-5)
    assert logits.unique().numel() == logits.numel(), "no two predictions tie"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        coarse = torch.nn.functional.linear(hidden, layer.weight, layer.bias)
    assert coarse.dtype == torch.bfloat16 and coarse.unique().numel() < logits.numel()
