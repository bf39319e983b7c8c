"""The training objective: log loss over the real rows of a batch.

Every training row is trained: the reader pads each rank's last batch of an epoch to the
batch size with rows labelled `PAD_LABEL` (so every rank takes the same steps and the
collectives line up), and those rows weigh nothing here. A padding row's gradient is
exactly zero, so it moves no MLP weight and, under row-wise Adagrad, no embedding row
(its moment grows by 0² and its step is 0). The loss of a step is the mean over its real
rows: a short last batch takes a step of the same scale as a full one.

With managed-collision ids (training/model/managed_ids.py), attached from outside after
sharding, the batch's raw ids become table rows here, before the DLRM sees them, and a
training batch's ids are kept for the next admission round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain

from ingestion.reader import PAD_LABEL
from training.model.managed_ids import ManagedIds


class RealRowsDLRMTrain(DLRMTrain):
    """TorchRec's `DLRMTrain` (same module tree, parameter names `model.…`) whose loss leaves
    padding rows out. forward(Batch) → (loss, (loss, logits, labels)), as `DLRMTrain`'s."""

    def __init__(self, dlrm_module: torch.nn.Module) -> None:
        super().__init__(dlrm_module)
        self.managed_ids: ManagedIds | None = None  # `attach_managed_ids`

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        sparse = batch.sparse_features
        if self.managed_ids is not None:
            if self.training:
                self.managed_ids.record(sparse)
            sparse = self.managed_ids.remap(sparse)
        logits = self.model(batch.dense_features, sparse).squeeze(-1)
        loss = real_rows_log_loss(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def real_rows(labels: torch.Tensor) -> torch.Tensor:
    """Each row's weight: 1 for a real row, 0 for padding (a weight, not a mask, so no
    step waits for the device to count the rows)."""
    return (labels != PAD_LABEL).float()


def real_rows_log_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross entropy over the rows whose label is not `PAD_LABEL` (0 if none)."""
    real = real_rows(labels)
    summed = F.binary_cross_entropy_with_logits(logits.float(), labels.float().clamp(min=0.0), weight=real,
                                                reduction="sum")  # fmt: skip
    return summed / real.sum().clamp(min=1)


def attach_managed_ids(model: torch.nn.Module, managed: ManagedIds) -> None:
    """Put `managed` in front of the tables of the training model inside `model` (a sharded
    one included): built on the device after sharding, since a model built on the meta
    device would leave its id buffers unset."""
    [train] = [module for module in model.modules() if isinstance(module, RealRowsDLRMTrain)]
    train.managed_ids = managed


def managed_ids_of(model: torch.nn.Module) -> ManagedIds | None:
    found = [module.managed_ids for module in model.modules() if isinstance(module, RealRowsDLRMTrain)]
    return found[0] if found else None
