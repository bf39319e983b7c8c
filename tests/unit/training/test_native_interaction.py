"""The dot interaction's native fp32 kernel (training/native_interaction.py), compiled for
real, against TorchRec's InteractionArch in float64 and the model's torch path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from training import native_build, native_interaction
from training.model import DotInteraction, build_dlrm


@pytest.fixture
def native() -> Iterator[None]:
    native_interaction.use("native")
    yield
    native_interaction.use("aten")


def _torchrec_oracle(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    from torchrec.models.dlrm import InteractionArch

    return InteractionArch(sparse.shape[1])(dense.double(), sparse.double())


# (batch, tables, dim): the benchmark model's shape, dims that are not multiples of the
# kernel's 8 lanes (13, 40: a tail after full vectors), one table, more samples than
# threads and fewer.
SHAPES = [(2048, 26, 16), (37, 3, 8), (9, 4, 13), (33, 10, 40), (1, 1, 16), (3, 30, 4)]


@pytest.mark.parametrize(("batch", "tables", "dim"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_values_and_gradients_match_torchrecs_interaction_in_float64(
    native: None, batch: int, tables: int, dim: int, threads: int
) -> None:
    torch.manual_seed(batch + tables + dim)
    dense = torch.randn(batch, dim, requires_grad=True)
    sparse = torch.randn(batch, tables, dim, requires_grad=True)
    width = dim + tables * (tables + 1) // 2
    padded = -(-width // 8) * 8
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native_interaction.dot_products(dense, sparse, padded)
        weights = torch.randn_like(out)
        grads = torch.autograd.grad((out * weights).sum(), (dense, sparse))
    finally:
        torch.set_num_threads(previous)
    dense64, sparse64 = dense.detach().double().requires_grad_(), sparse.detach().double().requires_grad_()
    expected = _torchrec_oracle(dense64, sparse64)
    expected_grads = torch.autograd.grad((expected * weights[:, :width].double()).sum(), (dense64, sparse64))
    assert out.shape == (batch, padded) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, :width].double(), expected, rtol=1e-5, atol=1e-5)
    assert not out[:, width:].any(), "the padding is zeros"
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_model_routes_fp32_cpu_interactions_to_the_native_kernel_only_when_told(native: None, monkeypatch) -> None:
    torch.manual_seed(0)
    dense, sparse = torch.randn(64, 16, requires_grad=True), torch.randn(64, 26, 16, requires_grad=True)
    interaction = DotInteraction(26)
    calls = []
    original = native_interaction.NativeDotProducts.apply
    monkeypatch.setattr(native_interaction.NativeDotProducts, "apply", lambda *args: calls.append(1) or original(*args))
    native_out = interaction(dense, sparse)
    native_interaction.use("aten")
    aten_out = interaction(dense, sparse)
    native_interaction.use("native")
    interaction(dense.bfloat16(), sparse.bfloat16())  # as the bf16 model computes it
    assert len(calls) == 1, "only the fp32 call with the native kernel in use goes native"
    torch.testing.assert_close(native_out, aten_out)


def test_a_model_step_with_the_native_interaction_matches_the_torch_one(native: None) -> None:
    """The whole DLRM, forward and backward: the same loss and parameter gradients to float
    rounding with either kernel."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from training.config import ModelConfig

    sizes = {f"c{i}": 50 for i in range(6)}
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), sizes, torch.device("cpu"))
    dense = torch.randn(40, 13)
    ids = KeyedJaggedTensor.from_lengths_sync(keys=list(sizes), values=torch.randint(0, 50, (240,)),
                                              lengths=torch.ones(240, dtype=torch.int64))  # fmt: skip
    results = {}
    for kernel in ("native", "aten"):
        native_interaction.use(kernel)
        model.zero_grad()
        loss = model(dense, ids).sigmoid().mean()
        loss.backward()
        results[kernel] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(results["native"][0], results["aten"][0])
    assert results["native"][1].keys() == results["aten"][1].keys() and results["native"][1]
    for name, grad in results["native"][1].items():
        torch.testing.assert_close(grad, results["aten"][1][name], msg=name)


def test_native_needs_a_compiler_and_says_so(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DLRM_NATIVE_CACHE", str(tmp_path / "empty-cache"))
    native_build.load.cache_clear()
    native_interaction._library.cache_clear()
    try:
        assert not native_interaction.available()
        with pytest.raises(native_build.NativeUnavailable, match="no C compiler"):
            native_interaction.use("native")
        assert native_interaction.in_use() == "aten"
    finally:
        native_build.load.cache_clear()
        native_interaction._library.cache_clear()


def test_a_width_too_narrow_for_the_pairs_is_refused(native: None) -> None:
    with pytest.raises(ValueError, match="narrower"):
        native_interaction.dot_products(torch.randn(4, 8), torch.randn(4, 3, 8), 8 + 5)


def _job(arch: str = "dlrm", **training) -> object:
    from evaluation.config import EvaluationConfig
    from training.config import ModelConfig, ShardingConfig, TrainingConfig
    from training.job import TrainJob

    return TrainJob(model=ModelConfig(arch=arch), sharding=ShardingConfig(), training=TrainingConfig(**training),
                    evaluation=EvaluationConfig(), table_sizes={}, train_files=(), eval_files={}, out_dir="unused")  # fmt: skip


def test_the_worker_chooses_the_interaction_from_the_config(monkeypatch, tmp_path) -> None:
    from training import worker

    cpu = torch.device("cpu")
    try:
        assert worker._interaction(_job(), cpu) == "native" and native_interaction.in_use() == "native"
        assert worker._interaction(_job(cpu_interaction="aten"), cpu) == "aten" and native_interaction.in_use() == "aten"
        assert worker._interaction(_job(precision="bf16"), cpu) == "aten"
        assert worker._interaction(_job(arch="dlrm_dcn"), cpu) == "dcn-v2"
        # no compiler: auto falls back to torch's path and says so; "native" is refused by name
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        monkeypatch.setenv("DLRM_NATIVE_CACHE", str(tmp_path / "empty-cache"))
        monkeypatch.setattr(worker.dist, "get_rank", lambda: 0)
        native_build.load.cache_clear()
        native_interaction._library.cache_clear()
        assert worker._interaction(_job(), cpu) == "aten" and native_interaction.in_use() == "aten"
        with pytest.raises(RuntimeError, match=r"cpu_interaction = 'native': no C compiler.*set training.cpu_interaction = 'aten'"):
            worker._interaction(_job(cpu_interaction="native"), cpu)
    finally:
        native_interaction.use("aten")
        native_build.load.cache_clear()
        native_interaction._library.cache_clear()
