"""The dense part of a training step on a GPU as two CUDA graphs: one replay for the forward of
the bottom MLP, the interaction and the top MLP, one for their backward.

At the batches a GPU trains at, that part of the step is a few dozen short kernels whose
launches (Python, the dispatcher, the driver) take longer than the kernels run: the GPU
waits for the host. A graph launches them all at once. On an H200, the throughput bench's
model with the batches in memory (bench/gpu_step_probe.py): 6.9 → 5.3 ms a step at global
batch 8,192, 8.4 → 6.3 ms at 65,536.

Graphs replay fixed shapes, and training batches have one (each rank's last batch of an
epoch is padded to the batch size). A graphed DLRM runs its graphs only in training mode at
the captured batch; evaluation, and any other batch, runs the same modules eagerly (the
graphs read the modules' own parameters, so both see the same weights, and a checkpoint
loaded in place is what the next replay reads). The embeddings (TorchRec's sharded tables,
their all-to-alls and fbgemm's fused optimizer) stay outside the graphs.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.models.dlrm import DLRM

from training.model.build import dlrms_in


class DenseHead(nn.Module):
    """A DLRM's dense part as one callable: (dense features, pooled embeddings [B, F, D]) →
    logits. It holds the DLRM's own modules, so it has no parameters of its own."""

    def __init__(self, dlrm: DLRM) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch

    def forward(self, dense_features: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        dense = self.dense_arch(dense_features)
        return self.over_arch(self.inter_arch(dense_features=dense, sparse_features=embedded))


@dataclass(frozen=True)
class GraphedHead:
    """A DLRM's captured dense part, kept on the DLRM as a plain attribute (not a submodule,
    so state dicts, checkpoints and exports are the DLRM's own): it lives as long as the DLRM."""

    replay: nn.Module  # make_graphed_callables' module: the graphs, run as an autograd function
    batch_size: int


# The graphed DLRMs of this process, by index: the DLRM's forward names its head by index, so
# that TorchRec's pipeline tracer records the call, choice included, as one opaque function
# (`torch.fx.wrap`; it cannot branch on a traced shape). Weak references: a model built again
# (a retune's trials, a test) lets the old one, its graphs and their memory pool go.
_HEADS: list[weakref.ref[DLRM]] = []


@torch.fx.wrap
def dense_head(index: int, dense_features: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
    """The graphs in training at the captured batch; the DLRM's own modules otherwise (not the
    graphed module: its training mode is its own, not the DLRM's)."""
    dlrm = _HEADS[index]()
    assert dlrm is not None, "a graphed DLRM's forward outlived the DLRM"
    head: GraphedHead = dlrm.graphed_head  # type: ignore[assignment]
    if dlrm.training and dense_features.shape[0] == head.batch_size and torch.is_grad_enabled():
        return head.replay(dense_features, embedded)
    dense = dlrm.dense_arch(dense_features)
    return dlrm.over_arch(dlrm.inter_arch(dense_features=dense, sparse_features=embedded))


def graphable(dlrm: nn.Module) -> bool:
    """Whether `dlrm`'s forward is the stock one (dense arch, sparse arch, interaction, over
    arch): TorchRec's `DLRM` and `DLRM_DCN`; not the wide DLRM, whose logit has more parts."""
    from training.model.stock_dlrm import WideDLRM

    return isinstance(dlrm, DLRM) and not isinstance(dlrm, WideDLRM)


def graph_dense_parts(model: nn.Module, batch_size: int, dense_features: int, embedding_dim: int,
                      device: torch.device, bf16: bool) -> int:  # fmt: skip
    """Capture each graphable DLRM's dense part in `model` for training batches of `batch_size`
    rows on `device` (in bf16 autocast when `bf16`), and make its forward replay them.
    Returns how many it graphed."""
    graphed = 0
    for dlrm in dlrms_in(model):
        if not graphable(dlrm):
            continue
        features = len(dlrm.sparse_arch.sparse_feature_names)
        dense = torch.rand(batch_size, dense_features, device=device)
        embedded = torch.rand(batch_size, features, embedding_dim, device=device, requires_grad=True)
        with _capture_precision(bf16):
            # 3 warm-up runs on a side stream, then the capture; gradients are taken with
            # autograd.grad there, so no parameter's .grad is touched
            replay = torch.cuda.make_graphed_callables(DenseHead(dlrm), (dense, embedded))
        dlrm.graphed_head = GraphedHead(replay, batch_size)
        _HEADS.append(weakref.ref(dlrm))
        _install(dlrm, len(_HEADS) - 1)
        graphed += 1
    return graphed


def _capture_precision(bf16: bool) -> contextlib.AbstractContextManager:
    # a graph records the casts autocast makes; autocast's weight cache would hold casts of
    # one step's weights across replays, so it is off while capturing
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16, cache_enabled=False)


def _install(dlrm: DLRM, index: int) -> None:
    sparse_arch = dlrm.sparse_arch  # not the DLRM: its forward must not keep it alive

    def forward(dense_features: torch.Tensor, sparse_features: Any) -> torch.Tensor:
        return dense_head(index, dense_features, sparse_arch(sparse_features))

    dlrm.forward = forward  # type: ignore[method-assign]
