"""Turn a sharded training checkpoint into a plain model for serving and the registry."""

from __future__ import annotations

from pathlib import Path

import torch
from torchrec.models.dlrm import DLRM

from training.checkpoint import load_unsharded
from training.job import TrainJob
from training.model import build_train_model


def export_model(job: TrainJob, checkpoint: Path) -> DLRM:
    """The trained DLRM, unsharded on CPU: forward(dense [B, 13], KJT) → logits [B, 1].

    It is TorchRec's own module, so loading it needs torchrec and nothing of this project.
    """
    model = build_train_model(job.model, job.table_sizes, torch.device("cpu"))
    load_unsharded(model, checkpoint)
    return model.model.eval()
