"""`--sweep KEY=V1,V2,…` (flows/characterize/sweeps.py): values split at top-level commas
only, a malformed sweep is one ConfigError line, and the series are every combination of the
non-batch sweeps, each a validated config."""

from pathlib import Path

import pytest

from flows.characterize.sweeps import BATCH_KEY, Sweep, parse_sweep, series_of
from flows.run.config import ConfigError, read_toml

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny.toml"


def test_commas_inside_brackets_and_quotes_belong_to_a_value():
    assert parse_sweep("model.bottom_mlp=[64,16],[128,16]") == Sweep("model.bottom_mlp", ("[64,16]", "[128,16]"))
    assert parse_sweep(' training.precision = "fp32","bf16" ') == Sweep("training.precision", ('"fp32"', '"bf16"'))


@pytest.mark.parametrize("text", ["training.batch_size", "=1,2", "training.batch_size=", "training.batch_size=1,,2"])
def test_a_malformed_sweep_is_one_line_naming_it(text):
    with pytest.raises(ConfigError, match="expected KEY=V1,V2"):
        parse_sweep(text)


def test_the_series_are_every_combination_of_the_non_batch_sweeps():
    sweeps = [parse_sweep(f"{BATCH_KEY}=256,512"), parse_sweep("training.embedding_lr=0.01,0.02"),
              parse_sweep("training.precision=\"fp32\",\"bf16\"")]  # fmt: skip
    series = series_of(read_toml(TINY), [], sweeps, TINY)
    assert [s.label for s in series][:2] == ['embedding_lr=0.01, precision="fp32"', 'embedding_lr=0.01, precision="bf16"']
    assert [(s.config.training.embedding_lr, s.config.training.precision) for s in series] == [
        (0.01, "fp32"), (0.01, "bf16"), (0.02, "fp32"), (0.02, "bf16")]  # fmt: skip
    assert series_of(read_toml(TINY), [], [sweeps[0]], TINY)[0].label == "as configured", "the batch is not a series"
    with pytest.raises(ConfigError, match="training.embedding_lr"):
        series_of(read_toml(TINY), [], [parse_sweep("training.embedding_lr=fast")], TINY)
