"""DLRM models built from the config and the preprocessing state's table sizes.

    dense features ─▶ bottom MLP ─┐
                                  ├─▶ interaction (dot | DCN-v2 cross) ─▶ top MLP ─▶ logit
    sparse ids ─▶ embedding bags ─┘

The model is TorchRec's own `DLRM` / `DLRM_DCN`: `forward` reads as the paper does (dense
arch → sparse arch → interaction → over arch). It knows nothing of processes, devices or
kernels: sharding (training/sharding/plan.py), precision (training/model/precision.py) and the CPU
speed work (training/cpu/) are applied to a built model from outside.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from training.config import ModelConfig
from training.model.objective import RealRowsDLRMTrain
from training.model.stock_dlrm import DENSE_FEATURES, DLRMSpec, build_stock_dlrm, table_name
from training.model.stock_dlrm import embedding_tables as stock_embedding_tables
from training.model.stock_dlrm import row_width as stock_row_width

__all__ = ["build_dlrm", "build_train_model", "dlrm_spec", "embedding_tables", "row_width", "table_name"]


def row_width(config: ModelConfig) -> int:
    """Floats per embedding row of `config`'s tables."""
    return stock_row_width(config.embedding_dim, config.wide)


def embedding_tables(config: ModelConfig, table_sizes: Mapping[str, int]) -> list[EmbeddingBagConfig]:
    """One table per categorical feature; rows from the preprocessing state."""
    return stock_embedding_tables(config.embedding_dim, table_sizes, config.wide)


def dlrm_spec(config: ModelConfig, table_sizes: Mapping[str, int], dense_features: int = DENSE_FEATURES) -> DLRMSpec:
    """The plain description of `config`'s DLRM over tables of `table_sizes` rows."""
    return DLRMSpec(arch=config.arch, embedding_dim=config.embedding_dim, bottom_mlp=list(config.bottom_mlp),
                    top_mlp=list(config.top_mlp), dcn_num_layers=config.dcn_num_layers,
                    dcn_low_rank_dim=config.dcn_low_rank_dim, table_sizes=dict(table_sizes),
                    dense_features=dense_features, wide=config.wide)  # fmt: skip


def build_dlrm(config: ModelConfig, table_sizes: Mapping[str, int], device: torch.device,
               dense_features: int = DENSE_FEATURES) -> DLRM:  # fmt: skip
    """The DLRM (or DLRM-DCN) of `config`; its forward takes (dense [B, D], KJT) → logits [B, 1]."""
    return build_stock_dlrm(dlrm_spec(config, table_sizes, dense_features), device)


def build_train_model(config: ModelConfig, table_sizes: Mapping[str, int], device: torch.device,
                      dense_features: int = DENSE_FEATURES) -> RealRowsDLRMTrain:  # fmt: skip
    """The DLRM wrapped with its loss (training/model/objective.py): forward(Batch) → (loss, (loss,
    logits, labels))."""
    return RealRowsDLRMTrain(build_dlrm(config, table_sizes, device, dense_features))


def start_at_click_rate(model: torch.nn.Module, click_rate: float) -> None:
    """Set the logit's bias to the training days' click rate (log odds), so a fresh model
    starts as the constant predictor instead of at p = 0.5: on short runs (small data) the
    bias otherwise spends the run getting there and the model ends miscalibrated."""
    if not 0.0 < click_rate < 1.0:
        return
    for dlrm in dlrms_in(model):
        biases = [m.bias for m in dlrm.over_arch.modules() if isinstance(getattr(m, "bias", None), torch.nn.Parameter)]
        with torch.no_grad():
            biases[-1].fill_(math.log(click_rate / (1.0 - click_rate)))  # the last layer's: the logit's


def dlrms_in(model: torch.nn.Module) -> list[DLRM]:
    """The DLRMs inside `model` (itself, or the one a `DLRMTrain` or a wrapper holds)."""
    return [module for module in model.modules() if isinstance(module, DLRM)]


def compile_dense_parts(model: torch.nn.Module, device: torch.device) -> list[str]:
    """`torch.compile` each DLRM's dense parts (bottom MLP, interaction, top MLP) in place.

    `nn.Module.compile` replaces only the call, so parameter names and checkpoints are
    those of the eager model. Returns the compiled modules' names.
    """
    if device.type == "cpu" and not any(map(shutil.which, ("g++", "c++", "clang++"))):
        raise RuntimeError(
            "training.compile: torch.compile on CPU needs a C++ compiler and none is on PATH "
            "(g++, c++ or clang++): install one, or set training.compile = false"
        )
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, DLRM):
            for part in ("dense_arch", "inter_arch", "over_arch"):
                getattr(module, part).compile()
                compiled.append(f"{name}.{part}" if name else part)
    return compiled

