"""Which precision a run computes in: bf16 only where the device multiplies it natively."""

from pathlib import Path

import pytest
import torch

from training.model.precision import native_bf16, resolve_precision

CPU = torch.device("cpu")


def _cpu_probes(monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the kernel's CPU flags")
def test_native_bf16_agrees_with_the_kernels_cpu_flags() -> None:
    flags = {flag for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("flags") for flag in line.split(":", 1)[1].split()}  # fmt: skip
    assert native_bf16(CPU) == bool({"amx_tile", "avx512_bf16"} & flags)


@pytest.mark.parametrize(("amx", "avx512_bf16"), [(False, False), (True, False), (False, True)])
def test_auto_stays_in_fp32_on_any_cpu_mocked_cpu(monkeypatch, amx, avx512_bf16) -> None:
    """A CPU run computes the same on every CPU unless bf16 is asked for."""
    _cpu_probes(monkeypatch, amx, avx512_bf16)
    assert resolve_precision("auto", CPU) == ("fp32", None)


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "fp32")])
def test_auto_takes_bf16_on_a_gpu_that_has_it_mocked_gpu(monkeypatch, native: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native)
    assert resolve_precision("auto", torch.device("cuda", 0)) == (expected, None)


def test_explicit_bf16_without_native_support_warns_and_is_kept_mocked_cpu(monkeypatch) -> None:
    _cpu_probes(monkeypatch, amx=False, avx512_bf16=False)
    precision, warning = resolve_precision("bf16", CPU)
    assert precision == "bf16"
    assert warning is not None and "no native bf16" in warning and "'auto' or 'fp32'" in warning


def test_explicit_choices_where_native_are_silent_mocked_cpu(monkeypatch) -> None:
    _cpu_probes(monkeypatch, amx=True, avx512_bf16=True)
    assert resolve_precision("bf16", CPU) == ("bf16", None)
    assert resolve_precision("fp32", CPU) == ("fp32", None)


def test_a_torch_without_the_cpu_probes_stays_in_fp32(monkeypatch) -> None:
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    assert not native_bf16(CPU)
    assert resolve_precision("auto", CPU) == ("fp32", None)


def test_the_logit_layer_computes_in_float32_under_bf16_autocast() -> None:
    """bf16 logits would come in steps of 1/64 near −2: predictions tie and calibration
    coarsens. The last layer takes its bf16 input to float32 and multiplies there."""
    from training.model.precision import Float32Linear

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


def test_a_bf16_run_takes_the_logit_layer_to_float32_with_the_same_parameters(tiny_features) -> None:
    from training.config import ModelConfig
    from training.model.build import build_dlrm
    from training.model.precision import Float32Linear, logit_in_float32

    state, _ = tiny_features
    model = build_dlrm(ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), state.table_sizes,
                       torch.device("cpu"))  # fmt: skip
    before = dict(model.state_dict())
    assert logit_in_float32(model) == 1 and isinstance(model.over_arch.model[-1], Float32Linear)
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in before)
