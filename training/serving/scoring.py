"""Score an unsharded model over feature files in this process (baselines, the champion)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from evaluation.report import Scores
from ingestion.reader import PAD_LABEL, build_reader, first_ids

# (dense [B, 13], sparse features) → logits [B]
LogitFn = Callable[[torch.Tensor, KeyedJaggedTensor], torch.Tensor]


@torch.no_grad()
def score_files(logits_of: LogitFn, files: Sequence[str], slice_feature: str, batch_size: int = 8192) -> Scores:
    """Every row of `files`, in file order: label, predicted probability, slice value."""
    labels, predictions, slices = [], [], []
    for batch in build_reader(files, batch_size, drop_remainder=False):
        keep = batch.labels != PAD_LABEL
        logits = logits_of(batch.dense_features, batch.sparse_features).reshape(-1)
        labels.append(batch.labels[keep].numpy().astype(np.int8))
        predictions.append(torch.sigmoid(logits.float())[keep].numpy())
        slices.append(first_ids(batch.sparse_features, slice_feature)[keep].numpy().astype(np.int32))
    return Scores(np.concatenate(labels), np.concatenate(predictions), np.concatenate(slices))


def dlrm_logits(model: torch.nn.Module,
                rows: Callable[[KeyedJaggedTensor, torch.Tensor], KeyedJaggedTensor] | None = None) -> LogitFn:  # fmt: skip
    """Adapt a DLRM (dense, KJT) → [B, 1] to the [B] logits of `score_files`; `rows` turns the
    files' ids (and dense values) into the model's table rows first (managed ids: the served
    remapping; the crosses and count bins it serves with)."""

    def logits_of(dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return model(dense, rows(sparse, dense) if rows else sparse).squeeze(-1)

    return logits_of
