"""Which precision a run computes in, chosen for the device it lands on.

bf16 doubles the matrix rate only where the hardware multiplies bf16 natively: GPUs from
Ampere on, and CPUs with AMX or AVX-512 BF16. Elsewhere PyTorch falls back to a reference
kernel: on a 2-core AVX2 host a [2048, 512] × [512, 512] product ran at 1.1 GFLOP/s in bf16
against 100 in fp32, and a bf16 training step of the benchmark model took 1.6 s instead
of 77 ms. A config tuned on one host and retrained on another must not fall off that cliff.
"""

from __future__ import annotations

from typing import Literal

import torch

Precision = Literal["fp32", "bf16"]


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices in hardware."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return _cpu_has("_is_amx_tile_supported") or _cpu_has("_is_avx512_bf16_supported")
    return False


def _cpu_has(probe: str) -> bool:
    # torch.cpu's ISA probes are private; a torch without one reports the feature absent,
    # which at worst keeps a run in fp32.
    check = getattr(torch.cpu, probe, None)
    return bool(check()) if check is not None else False


def resolve_precision(requested: str, device: torch.device) -> tuple[Precision, str | None]:
    """The precision to compute in, and a warning when the request will run slowly.

    `auto` (the default) takes bf16 on a GPU that multiplies it natively and fp32 on CPUs:
    there bf16 is taken only when asked for (`bf16`; about 3x the step rate with AMX, at up
    to 2 % of NE on small jobs), so a CPU run computes the same on every CPU. An explicit
    `bf16` is kept (the user may want bf16 numerics on purpose), with a warning where it is
    not native.
    """
    native = native_bf16(device)
    if requested == "auto":
        return ("bf16" if native and device.type == "cuda" else "fp32"), None
    if requested == "bf16" and not native:
        return "bf16", (
            f"training.precision = 'bf16' but this {device_description(device)} has no native bf16 "
            "matrix unit, so matrix products run far slower than in fp32 (about 100x on an AVX2 CPU): "
            "set training.precision = 'auto' or 'fp32'"
        )
    return requested, None  # type: ignore[return-value]


def allow_tf32(device: torch.device) -> None:
    """fp32 matrix products on a GPU through TF32 tensor cores (a 10-bit mantissa in the
    products, fp32 sums): on an H100 about 8x the plain fp32 rate. DLRM's MLPs train the
    same with it (its products feed a sigmoid, not a solver); the CPU is left as it is."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU ({torch.cuda.get_device_name(device)})"
    return f"CPU ({torch.backends.cpu.get_cpu_capability()})"


class Float32Linear(torch.nn.Linear):
    """A `Linear` that computes in float32 under autocast: the top MLP's last layer, whose
    output is the logit. In bf16 a logit near −2 would be rounded to steps of 1/64, and
    the predictions, NE and calibration with it; the layer is 256 → 1, so fp32 costs
    nothing (its products took 20 µs in fp32 against ~50 µs in bf16 on AMX, forward and
    each gradient)."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=features.device.type, enabled=False):
            return torch.nn.functional.linear(features.float(), self.weight, self.bias)


def logit_in_float32(model: torch.nn.Module) -> int:
    """Make every DLRM's logit layer (the top MLP's last `Linear`) a `Float32Linear`, with
    the same parameters. Returns how many layers it changed."""
    from torchrec.models.dlrm import DLRM

    changed = 0
    for dlrm in (m for m in model.modules() if isinstance(m, DLRM)):
        last = dlrm.over_arch.model[-1]
        if type(last) is torch.nn.Linear:
            fp32 = Float32Linear(last.in_features, last.out_features, device=torch.device("meta"))
            fp32.weight, fp32.bias = last.weight, last.bias
            dlrm.over_arch.model[-1] = fp32
            changed += 1
    return changed
