"""Where a wide DLRM's own weights start (`model.wide_start`).

- "zero": the ids' own weights and the dense features' linear term start at 0, so a fresh
  wide model starts as its DLRM (and, with `training.start_at_click_rate`, as the constant).
  The kernels would draw every column from U(±1/√rows): on a 3-value feature that adds
  about ±1 to every logit before any training.
- "logistic_regression": they start at a fitted logistic regression's weights on the same
  hashed features (training/reference.py), and the top MLP's last layer at zero with the
  regression's bias, so the model starts as that regression and its deep part learns what
  the regression leaves. On small data the ids' own weights are what the rows can teach,
  and L-BFGS with a validated L2 finds them better than a few epochs of SGD do.

Works on the sharded model, shard by shard (row-, column- or table-wise, or replicated): a
shard knows its row and column offsets, and its tensor is a view of the kernel's storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.model.stock_dlrm import WIDE_COLUMNS, WideDLRM, table_name
from training.reference import HashedLogisticRegression


@dataclass(frozen=True)
class WideStart:
    """A wide model's starting own weights: one per table row, the dense features', the bias."""

    id_weights: dict[str, torch.Tensor]  # table name → [rows] float32
    dense_weights: torch.Tensor  # [dense features] float32
    bias: float

    @classmethod
    def of_regression(cls, regression: HashedLogisticRegression) -> WideStart:
        rows = regression.weights.weight.detach()[:, 0].float()
        starts = regression.offsets.tolist() + [rows.shape[0]]
        id_weights = {table_name(feature): rows[starts[i] : starts[i + 1]].clone()
                      for i, feature in enumerate(regression.features)}  # fmt: skip
        return cls(id_weights, regression.dense.weight.detach()[0].float().clone(), float(regression.dense.bias.detach()))


def start_wide(model: torch.nn.Module, start: WideStart | None = None) -> int:
    """Set every wide DLRM's own weights in `model`: to `start`'s, or to zero. Returns the
    number of floats set on this rank."""
    written = 0
    for dlrm in (module for module in model.modules() if isinstance(module, WideDLRM)):
        tables = dlrm.sparse_arch.embedding_bag_collection.state_dict()
        with torch.no_grad():
            linear = dlrm.dense_linear.weight
            linear.copy_(start.dense_weights.reshape(linear.shape) if start else torch.zeros_like(linear))
            written += linear.numel()
            for name, weight in tables.items():
                if name.endswith(".weight"):
                    own = start.id_weights[name.split(".")[-2]] if start else None
                    written += _set_own_columns(weight, dlrm.deep_dim, own)
            if start:
                _start_logit_at(dlrm, start.bias)
    return written


def _set_own_columns(weight: torch.Tensor, first: int, own: torch.Tensor | None) -> int:
    """Columns ≥ `first` of a table (a plain tensor, or a sharded one's local shards): each
    row's `own` weight split evenly over them, or zero."""
    shards = weight.local_shards() if hasattr(weight, "local_shards") else None
    pieces = [(s.tensor, *map(int, s.metadata.shard_offsets)) for s in shards] if shards is not None else [(weight, 0, 0)]
    written = 0
    for tensor, row_offset, column_offset in pieces:
        columns = tensor[:, max(0, first - column_offset) :]
        if own is None:
            columns.zero_()
        else:
            rows = own[row_offset : row_offset + tensor.shape[0]].to(tensor.device, tensor.dtype)
            columns.copy_((rows / WIDE_COLUMNS).unsqueeze(1).expand_as(columns))
        written += columns.numel()
    return written


def _start_logit_at(dlrm: WideDLRM, bias: float) -> None:
    """The top MLP's last layer to weights 0 and `bias`: the deep part adds nothing yet, and
    its first steps train that layer (then, through it, the rest)."""
    last = [m for m in dlrm.over_arch.modules() if isinstance(m, torch.nn.Linear)][-1]
    last.weight.zero_()
    last.bias.fill_(bias)
