"""MLP widths that follow the training rows (`model.mlp_width = "auto"`).

A DLRM's MLPs sized for millions of rows overfit a few thousand in their first epoch, and
where a seed's first epoch lands decides the NE: on two small real datasets (8,000 and
68,000 rows) the default 512-256 MLPs left three seeds 1.0–1.5 % apart, MLPs a quarter as
wide 0.4–1.1 % apart and better on both; a further halving was worse again; 600,000 rows
want the full width (a quarter of it cost 1.9 %). So the configured hidden widths are the
ceiling, and a run with few rows scales every hidden layer of both MLPs by one factor, the
one that brings the widest first layer to `rows / ROWS_PER_UNIT` (a power of two, at least
`NARROWEST`). The output widths (the embedding dim, the logit) never change, and nothing is
ever widened.
"""

from __future__ import annotations

import dataclasses

from training.config import ModelConfig

ROWS_PER_UNIT = 512  # training rows per unit of the first layer's width
NARROWEST = 128  # the first layer's width never goes below this (nor above the configured one)


def row_width_cap(rows: int) -> int:
    """The widest first MLP layer that `rows` training rows support: a power of two."""
    cap = NARROWEST
    while cap * 2 * ROWS_PER_UNIT <= rows:
        cap *= 2
    return cap


def fit_mlp_width(model: ModelConfig, rows: int) -> tuple[ModelConfig, str | None]:
    """`model` with its hidden MLP widths scaled to `rows` (see module), and the change said; a
    model set to `mlp_width = "configured"`, or already within the cap, comes back as it is."""
    widest = max(model.bottom_mlp[0], model.top_mlp[0])
    cap = row_width_cap(rows)
    if model.mlp_width == "configured" or widest <= cap:
        return model, None
    factor = cap / widest
    scale = lambda widths: (*(max(1, round(w * factor)) for w in widths[:-1]), widths[-1])  # the output stays
    scaled = dataclasses.replace(model, bottom_mlp=scale(model.bottom_mlp), top_mlp=scale(model.top_mlp))
    return scaled, (f"model.bottom_mlp {list(model.bottom_mlp)} → {list(scaled.bottom_mlp)}; model.top_mlp "
                    f"{list(model.top_mlp)} → {list(scaled.top_mlp)}: {rows:,} training rows support a first layer "
                    f"of {cap} (one unit per {ROWS_PER_UNIT} rows; wider MLPs overfit few rows and swing with the "
                    f"seed); set model.mlp_width = \"configured\" to keep the configured widths")  # fmt: skip
