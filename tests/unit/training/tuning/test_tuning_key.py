"""The tuning key changes exactly when what invalidates hyperparameters changes."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from training.config import TrainingConfig, Workers
from training.tuning.key import TuningKey, tuning_key

BASE = TrainingConfig(nproc=2, batch_size=2048, device="cpu")
TWO = Workers(2)


def key(training: TrainingConfig = BASE, workers: Workers = TWO, **cluster) -> TuningKey:
    return tuning_key(training, Workers(training.nproc, workers.hosts), **cluster)


def test_key_is_stable_for_the_same_run() -> None:
    assert key() == key(dataclasses.replace(BASE))
    assert key().fingerprint == key().fingerprint
    assert len(key().fingerprint) == 12


@pytest.mark.parametrize(
    ("change", "hosts"),
    [({"batch_size": 4096}, 1), ({"nproc": 4, "batch_size": 2048}, 1), ({}, 2)],
    ids=["batch size", "world size", "hosts"],
)
def test_key_changes_with_batch_world_size_and_hosts(change: dict, hosts: int) -> None:
    changed = key(dataclasses.replace(BASE, **change), Workers(2, hosts))
    assert changed.fingerprint != key().fingerprint
    assert changed.world_size == changed.hosts * dataclasses.replace(BASE, **change).nproc


@pytest.mark.parametrize(
    "change",
    [{"embedding_lr": 0.3}, {"dense_lr": 0.1}, {"seed": 5}, {"epochs": 3}, {"warmup_steps": 10},
     {"checkpoint_every": 7}, {"precision": "bf16"}],
)  # fmt: skip
def test_key_ignores_what_tuning_decides_or_does_not_depend_on(change: dict) -> None:
    assert key(dataclasses.replace(BASE, **change)) == key()


def test_key_changes_with_the_device_mocked_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: CUDA's answers are stubbed to show the key follows the device."""
    import torch

    cpu_key = key(dataclasses.replace(BASE, device="auto"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties",
        lambda index: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30),
    )  # fmt: skip
    cuda_key = key(dataclasses.replace(BASE, device="auto"))
    assert (cuda_key.device_type, cuda_key.device_model, cuda_key.memory_per_device_gb) == (
        "cuda", "NVIDIA H100 80GB HBM3", 80,
    )  # fmt: skip
    assert cuda_key.fingerprint != cpu_key.fingerprint
    assert key().device_type == "cpu", "device = 'cpu' stays on the CPU even with CUDA visible"


def test_hosts_in_torchrun_args_are_refused_one_way_into_several_hosts() -> None:
    with pytest.raises(ValueError, match=r"torchrun_args: \['--nnodes=4'\] set the job's hosts; set orchestration.trainer_hosts"):
        dataclasses.replace(BASE, torchrun_args=("--nnodes=4",))
    assert key(workers=Workers(2, 4)).world_size == 8 and key(workers=Workers(2, 4)).hosts == 4


def test_nearest_key_prefers_the_same_hardware_then_the_closest_batch() -> None:
    here = TuningKey(8192, 2, 1, "cpu", "EPYC", 12)
    same_hw_far_batch = dataclasses.replace(here, global_batch_size=256)
    same_hw_near_batch = dataclasses.replace(here, global_batch_size=4096)
    other_hw_same_batch = dataclasses.replace(here, device_type="cuda", device_model="H100", memory_per_device_gb=80)
    ranked = sorted([other_hw_same_batch, same_hw_far_batch, same_hw_near_batch], key=here.distance)
    assert ranked == [same_hw_near_batch, same_hw_far_batch, other_hw_same_batch]
    assert here.distance(here) == 0


def test_key_tags_name_every_field() -> None:
    tags = key().as_tags()
    assert tags["tuning.key"] == key().fingerprint
    assert tags["tuning.key.global_batch_size"] == "2048" and tags["tuning.key.world_size"] == "2"
    assert {"tuning.key.device_type", "tuning.key.device_model", "tuning.key.memory_per_device_gb",
            "tuning.key.hosts"} <= set(tags)  # fmt: skip


def test_a_declared_cluster_gives_the_key_its_hardware_takes_mocked_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only flow host with `orchestration.trainer_cluster` computes the key the GPU
    trainers would (CUDA's answers on the trainer are stubbed: no GPU here)."""
    import torch

    from training.config import ClusterConfig

    h100 = ClusterConfig(name="2 x 8 H100", hosts=2, devices_per_host=8, device_memory_gb=80,
                         device_model="NVIDIA H100 80GB HBM3")  # fmt: skip
    gpu_job = dataclasses.replace(BASE, device="auto")
    declared = key(gpu_job, Workers(2, 2), cluster=h100)
    assert key(gpu_job, Workers(2, 2)).device_type == "cpu", "this host alone would key the job as CPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties",
        lambda index: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30),
    )  # fmt: skip
    assert declared == key(gpu_job, Workers(2, 2)), "the same key as on a trainer"
    assert declared.hosts == 2 and declared.world_size == 2 * BASE.nproc


def test_trainer_cluster_must_agree_with_the_hosts(tmp_path) -> None:
    from flows.run.config import ConfigError, load_config, trainer_cluster

    root = Path(__file__).resolve().parents[4]
    demo = root / "configs" / "demo.toml"
    assert trainer_cluster(load_config(demo)) is None
    two = load_config(demo, ['orchestration.trainer_cluster="configs/clusters/h100-2x8.toml"',
                             "orchestration.trainer_hosts=2", 'orchestration.rdzv_endpoint="10.0.0.1:29400"'])  # fmt: skip
    assert trainer_cluster(two).hosts == 2
    one = load_config(demo, ['orchestration.trainer_cluster="configs/clusters/h100-2x8.toml"'])
    with pytest.raises(ConfigError, match="declares 2 host.*trainer_hosts is 1"):
        trainer_cluster(one)
