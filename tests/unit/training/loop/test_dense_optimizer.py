"""The dense optimizer uses torch's fused kernels where they exist, with the same updates."""

import pytest
import torch

from training.loop.optimizers import fused_dense_optimizer


def test_fused_kernels_are_chosen_where_torch_has_them() -> None:
    assert fused_dense_optimizer("adam", torch.device("cpu"))
    assert fused_dense_optimizer("adagrad", torch.device("cpu"))
    assert fused_dense_optimizer("adam", torch.device("cuda", 0))
    assert not fused_dense_optimizer("adagrad", torch.device("cuda", 0)), "no fused Adagrad kernel on CUDA"


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.Adagrad])
def test_the_fused_kernel_updates_as_the_per_tensor_loop(optimizer_class) -> None:
    torch.manual_seed(0)
    shapes = [(64, 13), (64,), (1, 64), (1,)]
    start = [torch.randn(shape) for shape in shapes]
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(5)]

    def run(**kind) -> list[torch.Tensor]:
        params = [t.clone().requires_grad_() for t in start]
        optimizer = optimizer_class(params, lr=0.05, weight_decay=1e-4, **kind)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            optimizer.step()
        return [p.detach() for p in params]

    for fused, looped in zip(run(fused=True), run(foreach=False), strict=True):
        torch.testing.assert_close(fused, looped, rtol=1e-5, atol=1e-6)
    assert not torch.equal(run(fused=True)[0], start[0]), "the parameters moved"
