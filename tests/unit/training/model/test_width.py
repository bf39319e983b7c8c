"""MLP widths that follow the training rows (`model.mlp_width = "auto"`): the configured widths
are the ceiling, every hidden layer of both MLPs scales by one factor, the outputs stay."""

import pytest

from training.config import ModelConfig
from training.model.width import fit_mlp_width, row_width_cap


@pytest.mark.parametrize(("rows", "cap"), [(0, 128), (8_000, 128), (68_000, 128), (131_071, 128), (131_072, 256),
                                            (262_144, 512), (600_000, 1024), (10**8, 131_072)])  # fmt: skip
def test_the_first_layer_supported_is_one_unit_per_512_rows_as_a_power_of_two_never_below_128(rows: int, cap: int) -> None:
    assert row_width_cap(rows) == cap


def test_few_rows_scale_the_default_mlps_to_a_quarter_keeping_their_outputs() -> None:
    model, note = fit_mlp_width(ModelConfig(), 8_000)
    assert model.bottom_mlp == (128, 64, 16) and model.top_mlp == (128, 64, 1)
    assert model.embedding_dim == 16 and model.mlp_width == "auto"
    assert note is not None and "8,000 training rows" in note and "[512, 256, 16] → [128, 64, 16]" in note
    assert 'model.mlp_width = "configured"' in note, "the note says how to keep the configured widths"
    ModelConfig(**{f: getattr(model, f) for f in ("embedding_dim", "bottom_mlp", "top_mlp")})  # still a valid shape


def test_one_factor_scales_both_mlps_by_the_wider_first_layer() -> None:
    model = ModelConfig(embedding_dim=8, bottom_mlp=(256, 8), top_mlp=(1024, 512, 1))
    scaled, _ = fit_mlp_width(model, 140_000)  # cap 256: factor 1/4 from the top MLP's 1,024
    assert scaled.bottom_mlp == (64, 8) and scaled.top_mlp == (256, 128, 1)


@pytest.mark.parametrize("rows", [262_144, 600_000, 5_000_000])
def test_enough_rows_keep_the_configured_widths_and_nothing_is_ever_widened(rows: int) -> None:
    assert fit_mlp_width(ModelConfig(), rows) == (ModelConfig(), None)
    narrow = ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1))
    assert fit_mlp_width(narrow, 100) == (narrow, None), "narrower than the cap: as configured"


def test_configured_widths_are_kept_on_any_rows() -> None:
    model = ModelConfig(mlp_width="configured")
    assert fit_mlp_width(model, 1_000) == (model, None)
