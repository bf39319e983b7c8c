"""flows/run/ground_truth.py: a command's ground truth keeps its calibrated bias in the user's cache."""

import json
from pathlib import Path

from flows.run.ground_truth import ground_truth, ground_truth_cache
from ingestion.config import SyntheticConfig
from ingestion.synthetic import GroundTruth


def test_the_bias_is_kept_in_the_users_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = SyntheticConfig(rows_per_day=500, seed=17, cardinality_scale=0.001)
    truth = ground_truth(config, ["C3"])
    assert ground_truth_cache() == tmp_path / "dlrm-pipeline" / "ground-truth"
    [entry] = ground_truth_cache().glob("*.json")
    assert json.loads(entry.read_text())["bias"] == truth.bias == GroundTruth(config, ("C3",)).bias
    assert truth.multi_hot == ("C3",)
