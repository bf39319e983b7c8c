"""TorchRec's own DLRM, built from a plain description: the one builder of the model that
trains and of the champion that serves.

It imports torch and torchrec only: the registered champion bundles this file (MLflow
`code_paths`) to rebuild the model from its state dict where this project is not installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypedDict

import torch
from torchrec.models.dlrm import (
    DLRM,
    DLRM_DCN,
    DenseArch,
    InteractionArch,
    OverArch,
    SparseArch,
    choose,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

DENSE_FEATURES = 13
# A wide model's rows carry this many more columns, whose sum is the id's own weight: one
# would do, but fbgemm's embedding kernels take rows of 4·k floats.
WIDE_COLUMNS = 4
SERVING_FORMAT = 1  # of the served model's model.json (training/serving/export.py writes it)


class DLRMSpec(TypedDict):
    """Everything that fixes the DLRM's shape (JSON-able; saved beside the served weights)."""

    arch: Literal["dlrm", "dlrm_dcn"]
    embedding_dim: int
    bottom_mlp: list[int]  # ends at embedding_dim
    top_mlp: list[int]  # ends at 1, the logit
    dcn_num_layers: int
    dcn_low_rank_dim: int
    table_sizes: dict[str, int]  # categorical feature → embedding rows, in the KJT's key order
    dense_features: int  # the bottom MLP's inputs (13 for Criteo; specs written before it: 13)
    wide: bool  # each id also adds its own weight to the logit (WideDLRM; specs written before it: false)


def table_name(feature: str) -> str:
    return f"t_{feature}"


def row_width(embedding_dim: int, wide: bool) -> int:
    """Floats per embedding row: the embedding dim, and a wide model's own-weight columns."""
    return embedding_dim + (WIDE_COLUMNS if wide else 0)


def embedding_tables(embedding_dim: int, table_sizes: Mapping[str, int], wide: bool = False) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, of the given rows (and a wide model's columns)."""
    width = row_width(embedding_dim, wide)
    return [
        EmbeddingBagConfig(name=table_name(feature), embedding_dim=width, num_embeddings=rows, feature_names=[feature])
        for feature, rows in table_sizes.items()
    ]


class WideDLRM(DLRM):
    """DLRM plus a wide part: logit = DLRM(dense, ids) + Σ over the ids of each id's weight
    + a linear function of the dense features.

    In a plain DLRM an id's own effect on the click rate reaches the logit only through its
    dot product with the bottom MLP's output, which small data rarely teaches; logistic
    regression learns exactly those weights and wins there. Here every table row carries
    `WIDE_COLUMNS` more columns whose sum is the id's weight (Wide & Deep on one collection,
    so sharding, checkpoints and warm starts are unchanged). The interaction sees only the
    first `embedding_dim` columns.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: list[int], over_arch_layer_sizes: list[int],
                 dense_device: torch.device | None = None) -> None:  # fmt: skip
        torch.nn.Module.__init__(self)
        self._cuda_graph_enabled = False  # what DLRM.compile_dense_path reads
        self.deep_dim = deep = dense_arch_layer_sizes[-1]
        widths = {config.embedding_dim for config in embedding_bag_collection.embedding_bag_configs()}
        if widths != {deep + WIDE_COLUMNS}:
            raise ValueError(f"a wide DLRM's tables are {deep} + {WIDE_COLUMNS} wide, got {sorted(widths)}")
        self.sparse_arch = SparseArch(embedding_bag_collection)
        features = len(self.sparse_arch.sparse_feature_names)
        self.dense_arch = DenseArch(in_features=dense_in_features, layer_sizes=dense_arch_layer_sizes,
                                    device=dense_device)  # fmt: skip
        self.inter_arch = InteractionArch(num_sparse_features=features)
        self.over_arch = OverArch(in_features=deep + choose(features, 2) + features,
                                  layer_sizes=over_arch_layer_sizes, device=dense_device)  # fmt: skip
        # the dense features' own weights: with the ids' ones, a logistic regression
        self.dense_linear = torch.nn.Linear(dense_in_features, 1, bias=False, device=dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        rows = self.sparse_arch(sparse_features)  # [B, F, embedding_dim + WIDE_COLUMNS]
        deep, wide = rows[..., :-WIDE_COLUMNS], rows[..., -WIDE_COLUMNS:]
        interacted = self.inter_arch(dense_features=embedded_dense, sparse_features=deep)
        own = wide.sum(dim=(1, 2)).unsqueeze(1) + self.dense_linear(dense_features)
        return self.over_arch(interacted) + own


def build_stock_dlrm(spec: DLRMSpec, device: torch.device) -> DLRM:
    """The DLRM (DLRM-DCN, wide DLRM) of `spec`; forward takes (dense [B, D], KJT) → logits [B, 1]."""
    wide = bool(spec.get("wide", False))
    tables = embedding_tables(spec["embedding_dim"], spec["table_sizes"], wide)
    parts = {
        "embedding_bag_collection": EmbeddingBagCollection(tables=tables, device=device),
        "dense_in_features": int(spec.get("dense_features", DENSE_FEATURES)),
        "dense_arch_layer_sizes": list(spec["bottom_mlp"]),
        "over_arch_layer_sizes": list(spec["top_mlp"]),
        "dense_device": device,
    }
    if spec["arch"] == "dlrm_dcn":
        if wide:
            raise ValueError("model.wide: only the dot-interaction DLRM (arch = \"dlrm\") has a wide part")
        return DLRM_DCN(dcn_num_layers=spec["dcn_num_layers"], dcn_low_rank_dim=spec["dcn_low_rank_dim"], **parts)
    return WideDLRM(**parts) if wide else DLRM(**parts)
