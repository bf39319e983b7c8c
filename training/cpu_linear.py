"""The MLPs' fp32 layers on CPU through oneDNN, with the bias and the ReLU fused.

PyTorch multiplies fp32 matrices on CPU with MKL (bf16 ones already go to oneDNN). On a
2-core AMD EPYC (Zen 4, AVX-512) oneDNN's fp32 kernels ran the benchmark model's layer
products 20-30 % faster than MKL's: [2048, 368] × [368, 512] in 4.1 ms against 5.3 ms, and
[2048, 512] × [512, 256] in 2.9 ms against 3.7 ms, forward and input gradient alike, with
one thread or two. The forward also adds the bias and applies the ReLU in the product's
epilogue instead of two more passes over [B, N].

`enable()` makes `takes()` true for fp32 2-D inputs on CPU outside autocast; the model's
ReLU layers then call `onednn_linear_relu`, whose forward and input gradient are oneDNN products
(`dlrm_pipeline::onednn_linear_relu`, `dlrm_pipeline::onednn_input_grad`: custom ops, so
`torch.compile` calls them as they are) and whose weight gradient stays with `torch.mm`,
which was as fast or faster there. Same parameters, same values to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

_enabled = False


class OneDnnUnavailable(RuntimeError):
    """This torch was built without oneDNN (mkldnn)."""


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def enable() -> None:
    """Route the MLPs' fp32 CPU products through oneDNN in this process (idempotent)."""
    global _enabled
    if not available():
        raise OneDnnUnavailable(
            "training.cpu_matmul = 'onednn': this torch build has no oneDNN (mkldnn); set training.cpu_matmul = 'aten'"
        )
    _enabled = True


def disable() -> None:
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled


def takes(features: Tensor) -> bool:
    """Whether the model's ReLU layers multiply `features` in oneDNN (else in aten)."""
    return (
        _enabled
        and features.device.type == "cpu"
        and features.dtype == torch.float32
        and features.dim() == 2
        and not torch.is_autocast_enabled("cpu")
    )


@torch.library.custom_op("dlrm_pipeline::onednn_linear_relu", mutates_args=())
def onednn_linear_relu(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """relu(features @ weight.T + bias): [B, K] × [N, K] → [B, N], one oneDNN call."""
    return torch.ops.mkldnn._linear_pointwise(features, weight, bias, "relu", [], "")


@onednn_linear_relu.register_fake
def _(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return features.new_empty(features.shape[0], weight.shape[0])


@torch.library.custom_op("dlrm_pipeline::onednn_input_grad", mutates_args=())
def onednn_input_grad(grad: Tensor, weight: Tensor) -> Tensor:
    """grad @ weight: [B, N] × [N, K] → [B, K], the layer's input gradient."""
    return torch.ops.mkldnn._linear_pointwise(grad, weight.t(), None, "none", [], "")


@onednn_input_grad.register_fake
def _(grad: Tensor, weight: Tensor) -> Tensor:
    return grad.new_empty(grad.shape[0], weight.shape[1])


def weight_grad(grad: Tensor, features: Tensor) -> Tensor:
    """grad.T @ features: [B, N] × [B, K] → [N, K], the layer's weight gradient.

    MKL multiplies fastest into a wide output: with fewer inputs than outputs (the bottom
    MLP's first layer, 13 → 512) it computes the [K, N] product, transposed, in about half
    the time of the [N, K] one (0.41 against 0.85 ms at batch 2048 on 2 Zen 3 cores).
    """
    if features.shape[1] < grad.shape[1]:
        return features.t().mm(grad).t().contiguous()
    return grad.t().mm(features)


def _save(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    features, weight, _ = inputs
    ctx.save_for_backward(features, weight, output)  # the output is the ReLU's mask too


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    features, weight, output = ctx.saved_tensors
    grad = torch.ops.aten.threshold_backward(grad, output, 0)  # zero where the ReLU was
    grad_features = onednn_input_grad(grad, weight) if ctx.needs_input_grad[0] else None
    grad_weight = weight_grad(grad, features) if ctx.needs_input_grad[1] else None
    grad_bias = grad.sum(0) if ctx.needs_input_grad[2] else None
    return grad_features, grad_weight, grad_bias


onednn_linear_relu.register_autograd(_backward, setup_context=_save)
