"""Versions registered before the pyfunc (the `pytorch` flavour) still load for scoring."""

from pathlib import Path

import mlflow
import torch

from flows.tracking.registry import registered_dlrm
from flows.tracking.sqlite_store import ready
from training.model.stock_dlrm import DLRMSpec, build_stock_dlrm


def test_a_pytorch_flavour_version_loads_as_its_dlrm(tmp_path: Path) -> None:
    spec = DLRMSpec(arch="dlrm", embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], dcn_num_layers=1,
                    dcn_low_rank_dim=4, table_sizes={"C1": 5, "C2": 7})  # fmt: skip
    torch.manual_seed(3)
    model = build_stock_dlrm(spec, torch.device("cpu"))
    mlflow.set_tracking_uri(ready(f"sqlite:///{tmp_path / 'mlflow.db'}"))  # a new store from the migrated template
    mlflow.set_experiment(experiment_name="old")
    with mlflow.start_run():
        # requirements named, as those versions logged them (else MLflow infers them in a Python of its own: 6 s)
        mlflow.pytorch.log_model(model, name="model", registered_model_name="old-ctr", serialization_format="pickle",
                                 pip_requirements=[f"torch=={torch.__version__}"])  # fmt: skip
    loaded = registered_dlrm("models:/old-ctr/1")
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
