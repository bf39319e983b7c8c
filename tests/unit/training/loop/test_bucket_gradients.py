"""DDP's bucket views and the dense optimizer (training/loop/optimizers.py): a gradient that the
backward lays out against its parameter's strides makes DDP warn and copy it every step; the
gradients `BucketGradients` keeps never do.

Each case runs in its own Python process (a one-process gloo group), so DDP's warn-once state
and the process group start clean."""

import json
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import json, os, socket, sys, warnings
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from training.loop.optimizers import BucketGradients, start_gradients_at_zero
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    class TransposedWeightGrad(torch.autograd.Function):
        # x @ w.T for a one-input layer (w: [512, 1]) whose weight gradient is computed as a
        # [1, 512] product and handed back transposed: strides [1, 512], as a fast kernel may
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x.mm(w.t())

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g.mm(w), x.t().mm(g).t()

    class TransposedProduct(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(512, 1))

        def forward(self, x):
            return TransposedWeightGrad.apply(x, self.weight)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    # as TorchRec's model parallel wraps the dense part
    model = DistributedDataParallel(TransposedProduct(), gradient_as_bucket_view=True, static_graph=True)
    params = dict(model.named_parameters())
    if sys.argv[1] == "kept":
        start_gradients_at_zero(params)
        optimizer = BucketGradients(params, lambda p: torch.optim.Adam(p, lr=0.01))
    else:
        optimizer = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adam(p, lr=0.01))
    addresses, grads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            optimizer.zero_grad()
            model(torch.randn(8, 1)).sum().backward()
            grad = params["module.weight"].grad
            addresses.append(grad.data_ptr())
            grads.append(list(grad.stride()))
            optimizer.step()
    dist.destroy_process_group()
    print(json.dumps({"warned": any("bucket view" in str(w.message) for w in caught),
                      "addresses": addresses, "strides": grads}))
    from training.worker import exit_skipping_teardown
    exit_skipping_teardown()  # gloo's threads outlive the destroy; the teardown rarely aborts on them
""")


def _run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # DDP's C++ warning reaches Python's warnings or, on some builds, stderr only
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["warned"] = result["warned"] or "do not match bucket view" in done.stderr
    return result


@pytest.mark.parametrize("mode", ["dropped", "kept"])
def test_only_kept_gradients_match_ddps_bucket_views(mode: str) -> None:
    result = _run(mode)
    if mode == "dropped":
        # torch's default (set_to_none): the backward's own layout reaches DDP, which warns
        assert result["warned"]
    else:
        assert not result["warned"]
        assert all(stride == [1, 1] for stride in result["strides"])
        # once DDP has rebuilt its buckets (in its first iterations), one gradient tensor for
        # every step: the bucket view, written in place, never a new tensor copied in
        assert len(set(result["addresses"][-3:])) == 1
