import pytest
import torch

from flows.run.config import ConfigError, load_config
from training.config import TrainingConfig
from training.loop.steps import pipeline_kind


def test_auto_pipelines_on_several_gpus_and_takes_plain_steps_on_one_and_on_cpu() -> None:
    auto = TrainingConfig()
    assert pipeline_kind(auto, torch.device("cuda", 0), world_size=2) == "sparse_dist"
    assert pipeline_kind(auto, torch.device("cuda", 0), world_size=1) == "plain"
    assert pipeline_kind(auto, torch.device("cuda", 0), managed_ids=True, world_size=2) == "plain"
    assert pipeline_kind(auto, torch.device("cpu"), world_size=2) == "plain"


@pytest.mark.parametrize("choice", ["sparse_dist", "plain"])
def test_an_explicit_choice_holds_on_every_device(choice: str) -> None:
    config = TrainingConfig(pipeline=choice)
    assert {pipeline_kind(config, torch.device(d)) for d in ("cpu", "cuda")} == {choice}


def test_an_unknown_pipeline_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="training.pipeline.*sparse_dist"):
        load_config("configs/tiny.toml", ['training.pipeline="overlapped"'])
