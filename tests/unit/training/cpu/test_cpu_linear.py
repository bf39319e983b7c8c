import copy

import pytest
import torch

from ingestion.reader import build_reader
from training.config import CpuConfig, ModelConfig
from training.cpu import accelerate
from training.cpu import linear as cpu_linear
from training.cpu.linear import OneDnnReLUPerceptron, ZeroPaddedInputLinear, relu_layer
from training.model.build import build_dlrm, compile_dense_parts


def _layer(in_features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(out_features, in_features) / in_features**0.5, torch.randn(out_features) * 0.1


# fewer inputs than outputs: the weight gradient is computed as a transposed product; one input
# (a warehouse with one count column) is where a transpose's strides survive `.contiguous()`
@pytest.mark.parametrize(("in_features", "out_features"), [(48, 24), (13, 64), (1, 32)])
def test_the_fused_layer_matches_a_float64_relu_linear_in_values_and_gradients(
    in_features: int, out_features: int
) -> None:
    weight, bias = (t.requires_grad_() for t in _layer(in_features, out_features))
    features = torch.randn(64, in_features, requires_grad=True)
    assert cpu_linear.takes(features)
    out = relu_layer(features, weight, bias, False)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), (features, weight, bias))

    exact = [t.detach().double().requires_grad_() for t in (features, weight, bias)]
    expected = torch.relu(torch.nn.functional.linear(*exact))
    expected_grads = torch.autograd.grad((expected * upstream.double()).sum(), exact)
    assert (expected == 0).any() and (expected > 0).any(), "both sides of the ReLU are exercised"
    assert torch.allclose(out.double(), expected, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == torch.float32 and got.is_contiguous() and torch.allclose(got.double(), want, atol=1e-4)
    # laid out as the weight is, stride for stride: what DDP's gradient buckets require
    assert grads[1].stride() == weight.stride() == torch.empty(out_features, in_features).stride()


def test_a_zero_padded_input_multiplies_a_zero_padded_weight() -> None:
    weight, bias = (t.requires_grad_() for t in _layer(23, 16))
    features = torch.randn(32, 23)
    wide = torch.cat((features, torch.zeros(32, 1)), dim=1)
    out = relu_layer(wide, weight, bias, True)
    out.sum().backward()
    assert weight.grad.shape == (16, 23)
    assert torch.allclose(out, torch.relu(torch.nn.functional.linear(features, weight, bias)), atol=1e-5)


def test_the_custom_ops_pass_torchs_checks() -> None:
    """Schema, fake (meta) kernels, autograd registration: what torch.compile relies on."""
    weight, bias = _layer(16, 8)
    features = torch.randn(8, 16, requires_grad=True)
    torch.library.opcheck(cpu_linear.onednn_linear_relu, (features, weight.requires_grad_(), bias.requires_grad_()))
    torch.library.opcheck(cpu_linear.onednn_input_grad, (torch.randn(8, 8), weight.detach()))


def test_only_fp32_two_dimensional_cpu_inputs_outside_autocast_take_the_oneDNN_path() -> None:
    features = torch.randn(4, 8)
    assert cpu_linear.takes(features)
    assert not cpu_linear.takes(features.to(torch.bfloat16))
    assert not cpu_linear.takes(features.double())
    assert not cpu_linear.takes(features.view(2, 2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_linear.takes(features)


def test_a_torch_without_oneDNN_is_one_clear_error_mocked_build(monkeypatch) -> None:
    """The torch build is mocked to lack oneDNN."""
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    model = build_dlrm(ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), {"c": 5}, torch.device("meta"))
    with pytest.raises(cpu_linear.OneDnnUnavailable, match=r"training.cpu.matmul = 'onednn'.*set training.cpu.matmul = 'aten'"):
        accelerate(model, CpuConfig(), "fp32")


def _scores(model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(batch.dense_features, batch.sparse_features)
    logits.sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_the_model_computes_with_oneDNN_what_it_computes_with_aten(tiny_features, arch: str) -> None:
    state, files = tiny_features
    config = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), dcn_low_rank_dim=4)
    torch.manual_seed(0)
    aten = build_dlrm(config, state.table_sizes, torch.device("cpu"))
    onednn = copy.deepcopy(aten)
    accelerate(aten, CpuConfig(matmul="aten"), "fp32")
    accelerate(onednn, CpuConfig(matmul="onednn"), "fp32")
    assert not any(isinstance(m, OneDnnReLUPerceptron) for m in aten.modules())
    relu_layers = [m for m in onednn.modules() if isinstance(m, OneDnnReLUPerceptron)]
    assert len(relu_layers) == 3, "both bottom layers and the top MLP's hidden layer"
    assert any(isinstance(m._linear, ZeroPaddedInputLinear) for m in relu_layers) == (arch == "dlrm")
    batch = next(iter(build_reader(files[2], 64)))
    aten_logits, aten_grads = _scores(aten, batch)
    onednn_logits, onednn_grads = _scores(onednn, batch)
    assert torch.allclose(onednn_logits, aten_logits, atol=1e-5)
    for name, grad in aten_grads.items():
        assert torch.allclose(onednn_grads[name], grad, atol=1e-5), name


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_the_compiled_dense_path_calls_the_oneDNN_layers_and_computes_the_same(tiny_features) -> None:
    state, files = tiny_features
    torch.manual_seed(0)
    eager = build_dlrm(ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), state.table_sizes,
                       torch.device("cpu"))  # fmt: skip
    accelerate(eager, CpuConfig(), "fp32")
    compiled = copy.deepcopy(eager)
    compile_dense_parts(compiled, torch.device("cpu"))
    batch = next(iter(build_reader(files[2], 64)))
    with torch.profiler.profile() as profile:
        compiled_logits, compiled_grads = _scores(compiled, batch)
    calls = [e.name for e in profile.events() if "onednn_linear_relu" in e.name or "onednn_input_grad" in e.name]
    assert any("onednn_linear_relu" in name for name in calls) and any("onednn_input_grad" in name for name in calls)
    eager_logits, eager_grads = _scores(eager, batch)
    assert torch.allclose(compiled_logits, eager_logits, atol=1e-5)
    for name, grad in eager_grads.items():
        assert torch.allclose(compiled_grads[name], grad, atol=1e-5), name


DDP_ONE_INPUT = """
import json, sys, warnings
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from training.cpu.linear import OneDnnReLUPerceptron

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
try:
    layer = OneDnnReLUPerceptron(1, 512, device=torch.device("cpu"))
    ddp = DistributedDataParallel(layer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ddp(torch.randn(64, 1)).sum().backward()
    weight = layer._linear.weight
    print(json.dumps({"grad_stride": list(weight.grad.stride()), "stride": list(weight.stride()),
                      "stride_warnings": [str(w.message) for w in caught if "stride" in str(w.message).lower()]}))
finally:
    dist.destroy_process_group()
from training.worker import exit_skipping_teardown
exit_skipping_teardown()  # gloo's threads outlive the destroy; the teardown rarely aborts on them
"""


def test_ddp_takes_a_one_input_layers_gradient_without_a_copy_or_a_warning(tmp_path) -> None:
    """A layer of one input (a warehouse with one count column) under DDP, as the dense MLPs
    train: its weight's gradient lands in DDP's bucket view as laid out, so DDP neither copies
    it every step nor warns that the strides differ.

    In a process of its own, with a time limit: a process group is process-wide state, and a
    gloo wait blocks in C, where no test timeout can reach it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[4]
    done = subprocess.run([sys.executable, "-c", DDP_ONE_INPUT, str(tmp_path / "store")], cwd=root, capture_output=True,
                          text=True, timeout=180, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["grad_stride"] == result["stride"]
    assert not result["stride_warnings"], result["stride_warnings"]
