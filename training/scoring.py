"""Score an unsharded model over feature files in this process (baselines, the champion)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from evaluation.report import Scores
from ingestion.reader import PAD_LABEL, build_reader
from ingestion.schema import SPARSE_COLUMNS

# (dense [B, 13], feature-major ids [26·B]) → logits [B]
LogitFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def score_files(logits_of: LogitFn, files: Sequence[str], slice_feature: str, batch_size: int = 8192) -> Scores:
    """Every row of `files`, in file order: label, predicted probability, slice value."""
    position = SPARSE_COLUMNS.index(slice_feature)
    labels, predictions, slices = [], [], []
    for batch in build_reader(files, batch_size, drop_remainder=False):
        keep = batch.labels != PAD_LABEL
        ids = batch.sparse_features.values()
        logits = logits_of(batch.dense_features, ids).reshape(-1)
        labels.append(batch.labels[keep].numpy().astype(np.int8))
        predictions.append(torch.sigmoid(logits.float())[keep].numpy())
        slices.append(ids.view(len(SPARSE_COLUMNS), -1)[position][keep].numpy().astype(np.int32))
    return Scores(np.concatenate(labels), np.concatenate(predictions), np.concatenate(slices))


def dlrm_logits(model: torch.nn.Module) -> LogitFn:
    """Adapt a DLRM (dense, KJT) → [B, 1] to the (dense, ids) interface of `score_files`."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def logits_of(dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        batch = dense.shape[0]
        kjt = KeyedJaggedTensor(
            keys=list(SPARSE_COLUMNS), values=ids,
            lengths=torch.ones(len(SPARSE_COLUMNS) * batch, dtype=torch.int32), stride=batch,
        )  # fmt: skip
        return model(dense, kjt).squeeze(-1)

    return logits_of
