"""TorchRec's own DLRM, built from a plain description: the one builder of the model that
trains and of the champion that serves.

It imports torch and torchrec only: the registered champion bundles this file (MLflow
`code_paths`) to rebuild the model from its state dict where this project is not installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypedDict

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

DENSE_FEATURES = 13
SERVING_FORMAT = 1  # of the served model's model.json (training/export.py writes it)


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


def table_name(feature: str) -> str:
    return f"t_{feature}"


def embedding_tables(embedding_dim: int, table_sizes: Mapping[str, int]) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, of the given rows."""
    return [
        EmbeddingBagConfig(name=table_name(feature), embedding_dim=embedding_dim, num_embeddings=rows,
                           feature_names=[feature])
        for feature, rows in table_sizes.items()
    ]


def build_stock_dlrm(spec: DLRMSpec, device: torch.device) -> DLRM:
    """The DLRM (or DLRM-DCN) of `spec`; its forward takes (dense [B, D], KJT) → logits [B, 1]."""
    tables = embedding_tables(spec["embedding_dim"], spec["table_sizes"])
    parts = {
        "embedding_bag_collection": EmbeddingBagCollection(tables=tables, device=device),
        "dense_in_features": int(spec.get("dense_features", DENSE_FEATURES)),
        "dense_arch_layer_sizes": list(spec["bottom_mlp"]),
        "over_arch_layer_sizes": list(spec["top_mlp"]),
        "dense_device": device,
    }
    if spec["arch"] == "dlrm_dcn":
        return DLRM_DCN(dcn_num_layers=spec["dcn_num_layers"], dcn_low_rank_dim=spec["dcn_low_rank_dim"], **parts)
    return DLRM(**parts)
