"""The dot interaction (training/cpu/interaction.py): the native fp32 kernel, compiled for
real, and the torch path, against TorchRec's InteractionArch in float64."""

from __future__ import annotations

import copy

import pytest
import torch

from training.config import CpuConfig, ModelConfig
from training.cpu import accelerate, native_build
from training.cpu import interaction as native_interaction
from training.cpu.interaction import DotInteraction
from training.model.build import build_dlrm
from training.threads import intra_op_threads


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
    batch: int, tables: int, dim: int, threads: int
) -> None:
    torch.manual_seed(batch + tables + dim)
    dense = torch.randn(batch, dim, requires_grad=True)
    sparse = torch.randn(batch, tables, dim, requires_grad=True)
    width = dim + tables * (tables + 1) // 2
    padded = -(-width // 8) * 8
    with intra_op_threads(threads):
        out = native_interaction.dot_products(dense, sparse, padded)
        weights = torch.randn_like(out)
        grads = torch.autograd.grad((out * weights).sum(), (dense, sparse))
    dense64, sparse64 = dense.detach().double().requires_grad_(), sparse.detach().double().requires_grad_()
    expected = _torchrec_oracle(dense64, sparse64)
    expected_grads = torch.autograd.grad((expected * weights[:, :width].double()).sum(), (dense64, sparse64))
    assert out.shape == (batch, padded) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, :width].double(), expected, rtol=1e-5, atol=1e-5)
    assert not out[:, width:].any(), "the padding is zeros"
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_native_module_computes_only_fp32_cpu_inputs_natively(monkeypatch) -> None:
    torch.manual_seed(0)
    dense, sparse = torch.randn(64, 16, requires_grad=True), torch.randn(64, 26, 16, requires_grad=True)
    calls = []
    original = native_interaction.NativeDotProducts.apply
    monkeypatch.setattr(native_interaction.NativeDotProducts, "apply", lambda *args: calls.append(1) or original(*args))
    native_out = DotInteraction(26, kernel="native")(dense, sparse)
    aten_out = DotInteraction(26, kernel="aten")(dense, sparse)
    DotInteraction(26, kernel="native")(dense.bfloat16(), sparse.bfloat16())  # as the bf16 model computes it
    assert len(calls) == 1, "only the fp32 call of the native module goes native"
    torch.testing.assert_close(native_out, aten_out)


def test_a_model_step_with_the_native_interaction_matches_the_torch_one() -> None:
    """The whole DLRM, forward and backward: the same loss and parameter gradients to float
    rounding with either kernel."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    sizes = {f"c{i}": 50 for i in range(6)}
    torch.manual_seed(0)
    stock = build_dlrm(ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), sizes, torch.device("cpu"))
    dense = torch.randn(40, 13)
    ids = KeyedJaggedTensor.from_lengths_sync(keys=list(sizes), values=torch.randint(0, 50, (240,)),
                                              lengths=torch.ones(240, dtype=torch.int64))  # fmt: skip
    results = {}
    for kernel in ("native", "aten"):
        model = copy.deepcopy(stock)
        assert accelerate(model, CpuConfig(interaction=kernel, matmul="aten"), "fp32").interaction == kernel
        assert model.inter_arch.kernel == kernel
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
        with pytest.raises(native_build.NativeUnavailable, match="no C compiler"):
            native_interaction.load_native()
        with pytest.raises(native_build.NativeUnavailable, match="no C compiler"):
            DotInteraction(4, kernel="native")
    finally:
        native_build.load.cache_clear()
        native_interaction._library.cache_clear()


def test_a_width_too_narrow_for_the_pairs_is_refused() -> None:
    with pytest.raises(ValueError, match="narrower"):
        native_interaction.dot_products(torch.randn(4, 8), torch.randn(4, 3, 8), 8 + 5)


def _chosen(arch: str = "dlrm", precision: str = "fp32", **cpu) -> str:
    config = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), dcn_low_rank_dim=4)
    model = build_dlrm(config, {"c0": 5, "c1": 7}, torch.device("meta"))
    return accelerate(model, CpuConfig(**cpu), precision).interaction


def test_accelerate_chooses_the_interaction_from_the_config(monkeypatch, tmp_path) -> None:
    try:
        assert _chosen() == "native"
        assert _chosen(interaction="aten") == "aten"
        assert _chosen(precision="bf16") == "aten"
        assert _chosen(arch="dlrm_dcn") == "dcn-v2"
        # no compiler: auto falls back to torch's path; "native" is refused by name
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        monkeypatch.setenv("DLRM_NATIVE_CACHE", str(tmp_path / "empty-cache"))
        native_build.load.cache_clear()
        native_interaction._library.cache_clear()
        assert _chosen(embedding_update="fbgemm") == "aten"
        expected = r"cpu.interaction = 'native': no C compiler.*set training.cpu.interaction = 'aten'"
        with pytest.raises(RuntimeError, match=expected):
            _chosen(interaction="native", embedding_update="fbgemm")
    finally:
        native_build.load.cache_clear()
        native_interaction._library.cache_clear()
