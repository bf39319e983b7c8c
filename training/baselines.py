"""Reference models that every DLRM is reported against.

`HashedLogisticRegression`: one weight per (feature, hashed value) plus a linear term over
the log-scaled counts, trained with Adagrad on sparse gradients: the classic CTR baseline.
It sees each feature on its own, so it cannot learn feature interactions; a DLRM that does
not beat it on data with interactions has not learned them either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ingestion.reader import build_reader
from ingestion.schema import NUM_DENSE, SPARSE_COLUMNS


class HashedLogisticRegression(nn.Module):
    def __init__(self, table_sizes: Mapping[str, int]) -> None:
        super().__init__()
        sizes = [table_sizes[name] for name in SPARSE_COLUMNS]
        self.register_buffer("offsets", torch.tensor(np.concatenate(([0], np.cumsum(sizes[:-1]))), dtype=torch.int64))
        self.weights = nn.EmbeddingBag(int(sum(sizes)), 1, mode="sum", sparse=True)
        nn.init.zeros_(self.weights.weight)
        self.dense = nn.Linear(NUM_DENSE, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """dense [B, 13], the sparse features (multi-hot bags summed) → logits [B]."""
        batch = dense.shape[0]
        if sparse.keys() != list(SPARSE_COLUMNS):
            sparse = sparse.permute([sparse.keys().index(name) for name in SPARSE_COLUMNS])
        # every id moved into its feature's block of the one weight table
        ids = sparse.values() + torch.repeat_interleave(self.offsets, torch.tensor(sparse.length_per_key()))
        per_bag = self.weights(ids, sparse.offsets()[:-1].to(torch.int64))  # [26·B, 1], feature-major
        return per_bag.view(len(SPARSE_COLUMNS), batch).sum(0) + self.dense(dense).squeeze(-1)


def train_logistic_regression(
    table_sizes: Mapping[str, int],
    train_files: Sequence[str],
    batch_size: int = 4096,
    lr: float = 0.1,
    epochs: int = 1,
    seed: int = 0,
) -> HashedLogisticRegression:
    """One pass (per epoch) of Adagrad over the training files, in a seeded shuffled order."""
    torch.manual_seed(seed)
    model = HashedLogisticRegression(table_sizes)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    for epoch in range(epochs):
        for batch in build_reader(train_files, batch_size, shuffle_seed=seed, epoch=epoch):
            optimizer.zero_grad()
            loss = loss_fn(model(batch.dense_features, batch.sparse_features), batch.labels)
            loss.backward()
            optimizer.step()
    return model.eval()
