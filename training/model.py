"""DLRM models built from the config and the preprocessing state's table sizes.

    dense features ─▶ bottom MLP ─┐
                                  ├─▶ interaction (dot | DCN-v2 cross) ─▶ top MLP ─▶ logit
    sparse ids ─▶ embedding bags ─┘

The model is plain TorchRec modules; it knows nothing of processes or devices beyond the
one it is built on (`meta` when sharding will materialise it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from ingestion.schema import NUM_DENSE
from training.config import ModelConfig


def table_name(feature: str) -> str:
    return f"t_{feature}"


def embedding_tables(config: ModelConfig, table_sizes: Mapping[str, int]) -> list[EmbeddingBagConfig]:
    """One table per categorical feature; rows from the preprocessing state."""
    return [
        EmbeddingBagConfig(
            name=table_name(feature),
            embedding_dim=config.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for feature, rows in table_sizes.items()
    ]


def build_dlrm(config: ModelConfig, table_sizes: Mapping[str, int], device: torch.device) -> DLRM:
    """The DLRM (or DLRM-DCN) of `config`; its forward takes (dense [B, 13], KJT) → logits [B, 1]."""
    bags = EmbeddingBagCollection(tables=embedding_tables(config, table_sizes), device=device)
    common = {
        "embedding_bag_collection": bags,
        "dense_in_features": NUM_DENSE,
        "dense_arch_layer_sizes": list(config.bottom_mlp),
        "over_arch_layer_sizes": list(config.top_mlp),
        "dense_device": device,
    }
    if config.arch == "dlrm_dcn":
        return DLRM_DCN(dcn_num_layers=config.dcn_num_layers, dcn_low_rank_dim=config.dcn_low_rank_dim, **common)
    return DLRM(**common)


def build_train_model(config: ModelConfig, table_sizes: Mapping[str, int], device: torch.device) -> DLRMTrain:
    """The DLRM wrapped with its loss: forward(Batch) → (loss, (loss, logits, labels))."""
    return DLRMTrain(build_dlrm(config, table_sizes, device))


def training_flops_per_sample(config: ModelConfig, num_tables: int) -> float:
    """Multiply-adds ×2 of the MLPs and the dot interaction, forward + backward (≈ 3× forward)."""
    def mlp(sizes: list[int]) -> float:
        return sum(2.0 * a * b for a, b in itertools.pairwise(sizes))

    vectors = num_tables + 1
    interactions = vectors * (vectors - 1) // 2
    forward = (
        mlp([NUM_DENSE, *config.bottom_mlp])
        + 2.0 * vectors * vectors * config.embedding_dim
        + mlp([config.embedding_dim + interactions, *config.top_mlp])
    )
    return 3.0 * forward
