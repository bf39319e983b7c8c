import pytest
import torch

from ingestion.reader import build_reader
from training.config import ModelConfig
from training.model.build import build_dlrm, build_train_model, embedding_tables


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


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_the_model_is_torchrecs_own(tiny_features, arch: str) -> None:
    """TorchRec's DLRM / DLRM_DCN and their own parts: no subclass of this project's, so the
    model reads (and pickles) as TorchRec's."""
    from torchrec.models import dlrm

    state, _ = tiny_features
    model = build_dlrm(ModelConfig(arch=arch, dcn_low_rank_dim=4), state.table_sizes, torch.device("meta"))
    assert type(model) is (dlrm.DLRM_DCN if arch == "dlrm_dcn" else dlrm.DLRM)
    assert {type(m).__module__.split(".")[0] for m in model.modules()} == {"torchrec", "torch"}


def test_the_model_imports_no_cpu_kernels() -> None:
    import ast
    from pathlib import Path

    import training.model.build

    tree = ast.parse(Path(training.model.build.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and name.startswith("training.cpu") for name in imported), imported


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_compiled_dense_parts_compute_what_the_eager_model_computes(tiny_features, arch: str) -> None:
    """Compiled in place, as one graph: the same parameter names (checkpoints load either
    way), and the same logits and gradients to float32 rounding."""
    import copy

    from training.model.build import compile_dense_parts

    state, files = tiny_features
    torch.manual_seed(0)
    config = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), dcn_low_rank_dim=4)
    eager = build_dlrm(config, state.table_sizes, torch.device("cpu"))
    compiled = copy.deepcopy(eager)
    assert compile_dense_parts(compiled, torch.device("cpu")) == ["dense_arch", "inter_arch", "over_arch"]
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
    from training.model import build as model_module

    monkeypatch.setattr(model_module.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="training.compile: .*C\\+\\+ compiler.*set training.compile = false"):
        model_module.compile_dense_parts(torch.nn.Linear(2, 2), torch.device("cpu"))


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_a_fresh_model_starts_at_the_click_rate_when_its_last_layer_is_quiet(tiny_features, arch: str) -> None:
    """With the top MLP's last weights at zero, the model predicts exactly its bias: the
    training click rate, not 0.5."""
    import math

    from training.model.build import start_at_click_rate

    state, files = tiny_features
    config = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), dcn_low_rank_dim=4)
    model = build_train_model(config, state.table_sizes, torch.device("cpu"))
    start_at_click_rate(model, 0.25)
    last = [m for m in model.model.over_arch.modules() if isinstance(m, torch.nn.Linear)][-1]
    assert last.bias.item() == pytest.approx(math.log(0.25 / 0.75))
    with torch.no_grad():
        last.weight.zero_()
    batch = next(iter(build_reader(files[2], 64)))
    probability = torch.sigmoid(model.model(batch.dense_features, batch.sparse_features))
    assert torch.allclose(probability, torch.full_like(probability, 0.25))
    start_at_click_rate(model, 0.0)  # no click rate known: left as it is
    assert last.bias.item() == pytest.approx(math.log(0.25 / 0.75))
