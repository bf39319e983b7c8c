"""The MLPs' fp32 layers on CPU through oneDNN, with the bias and the ReLU fused.

PyTorch multiplies fp32 matrices on CPU with MKL (bf16 ones already go to oneDNN). On a
2-core AMD EPYC (Zen 4, AVX-512) oneDNN's fp32 kernels ran the benchmark model's layer
products 20-30 % faster than MKL's: [2048, 368] × [368, 512] in 4.1 ms against 5.3 ms, and
[2048, 512] × [512, 256] in 2.9 ms against 3.7 ms, forward and input gradient alike, with
one thread or two. The forward also adds the bias and applies the ReLU in the product's
epilogue instead of two more passes over [B, N].

`swap_relu_layers` makes a DLRM's ReLU perceptrons `OneDnnReLUPerceptron`s: for fp32 2-D
inputs on CPU outside autocast they call `onednn_linear_relu`, whose forward and input
gradient are oneDNN products (`dlrm_pipeline::onednn_linear_relu`,
`dlrm_pipeline::onednn_input_grad`: custom ops, so `torch.compile` calls them as they are)
and whose weight gradient stays with `torch.mm`, which was as fast or faster there; any
other input computes as TorchRec's `Perceptron` does. Same parameters, same values to
float rounding.

`ZeroPaddedInputLinear` is the top MLP's first layer behind the padded dot interaction
(training/model/dot_interaction.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchrec.modules.mlp import Perceptron

from training.model.dot_interaction import ZeroPaddedInputLinear, padded_to


class OneDnnUnavailable(RuntimeError):
    """This torch was built without oneDNN (mkldnn)."""


def available() -> bool:
    """Whether this torch has oneDNN's fused linear-pointwise op."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def takes(features: Tensor) -> bool:
    """Whether a oneDNN layer multiplies `features` in oneDNN (else in aten)."""
    return (
        features.device.type == "cpu"
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
    The gradient is copied into the weight's own row-major layout: `.contiguous()` keeps a
    transpose's strides where a dimension is 1 (a layer of one input: [N, 1] with strides
    [1, N]), which DDP's gradient buckets would copy again every step, with a warning.
    """
    if features.shape[1] < grad.shape[1]:
        transposed = features.t().mm(grad)  # [K, N]
        return torch.empty((grad.shape[1], features.shape[1]), dtype=grad.dtype, device=grad.device).copy_(transposed.t())
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


class OneDnnReLUPerceptron(Perceptron):
    """TorchRec's `Perceptron` with a ReLU (same modules, same parameter names) whose fp32
    product on CPU runs in oneDNN with the bias and the ReLU fused; every other input
    computes as TorchRec's does."""

    @classmethod
    def taking_over(cls, layer: nn.Module) -> nn.Module:
        """`layer` as a `OneDnnReLUPerceptron` with its own linear module, if it is a ReLU
        perceptron; else `layer` itself."""
        if type(layer) is not Perceptron or layer._activation_fn is not torch.relu:
            return layer
        taken = cls(layer._in_size, layer._out_size, device=torch.device("meta"))
        taken._linear = layer._linear
        return taken

    def forward(self, input: Tensor) -> Tensor:
        padded = isinstance(self._linear, ZeroPaddedInputLinear)
        return relu_layer(input, self._linear.weight, self._linear.bias, padded)


@torch.fx.wrap  # branches on the input's device, dtype and shape: one opaque call in traced pipelines
def relu_layer(features: Tensor, weight: Tensor, bias: Tensor, zero_padded_input: bool) -> Tensor:
    """relu(features @ weight.T + bias), multiplying a zero-padded weight when
    `zero_padded_input` (see `ZeroPaddedInputLinear`)."""
    if zero_padded_input:
        weight = padded_to(weight, features.shape[-1])
    if takes(features):
        return onednn_linear_relu(features, weight, bias)
    return torch.relu(nn.functional.linear(features, weight, bias))


def swap_relu_layers(dlrm: nn.Module) -> int:
    """Make the ReLU perceptrons of a DLRM's bottom and top MLPs `OneDnnReLUPerceptron`s.
    Returns how many it swapped. Raises `OneDnnUnavailable` where torch has no oneDNN."""
    if not available():
        raise OneDnnUnavailable(
            "training.cpu.matmul = 'onednn': this torch build has no oneDNN (mkldnn); set training.cpu.matmul = 'aten'"
        )
    swapped = 0
    for mlp in (dlrm.dense_arch.model, dlrm.over_arch.model[0]):
        layers = [OneDnnReLUPerceptron.taking_over(layer) for layer in mlp._mlp]
        swapped += sum(new is not old for new, old in zip(layers, mlp._mlp, strict=True))
        mlp._mlp = nn.Sequential(*layers)
    return swapped
