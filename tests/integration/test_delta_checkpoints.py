"""Delta checkpoints (`training.checkpoint_mode = "delta"`): a chain loads as the full checkpoint
of the same state, bit for bit, into another world size (2 → 1, 1 → 2); pruning keeps what a
chain needs; a broken chain is refused in one line and the newest loadable one is used."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoint_reload import reload_rank
from forked_ranks import start_ranks
from ports import free_port
from tiny_jobs import tiny_job
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from training.codec import encode
from training.job import TrainJob
from training.launch.launcher import launch
from training.launch.resume import FINISHED
from training.loop.checkpoint import checkpoint_bytes, prune_checkpoints
from training.loop.checkpoint_chain import latest_checkpoint, read_meta, refused_checkpoints
from training.loop.delta_checkpoint import flat_leaves
from training.serving.export import export_model

pytestmark = pytest.mark.slow

CHAIN = 3  # full_checkpoint_every: a full checkpoint, then two deltas


def _job(features, out: Path, nproc: int = 2, **training) -> TrainJob:
    settings = {"nproc": nproc, "batch_size": 256, "embedding_lr": 0.1, "dense_lr": 0.05, "dense_optimizer": "adam",
                "warmup_steps": 5, "epochs": 1, "log_every": 5, "checkpoint_every": 5, "keep_checkpoints": 50,
                "pipeline": "plain"}  # fmt: skip
    return tiny_job(features, out, **{**settings, **training})


@pytest.fixture(scope="module")
def runs(tiny_features, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainJob]:
    """The same two-process run, checkpointing every 5 steps, in full and in delta mode."""
    root = tmp_path_factory.mktemp("delta-runs")
    jobs = {"full": _job(tiny_features, root / "full"),
            "delta": _job(tiny_features, root / "delta", checkpoint_mode="delta", full_checkpoint_every=CHAIN)}  # fmt: skip
    for job in jobs.values():
        launch(job, on_line=lambda line: None)
    return jobs


def _checkpoints(job: TrainJob) -> list[Path]:
    return sorted(job.checkpoint_root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def _reload(job: TrainJob, checkpoint: Path, nproc: int, out: Path) -> Path:
    """The checkpoint loaded through its chain by `nproc` processes (forked ranks: the loading
    is under test, not the launcher) and written whole."""
    job_file = out / "job.json"
    out.mkdir(parents=True)
    job.save(job_file)
    start_ranks(reload_rank, (nproc, free_port(), str(job_file), str(checkpoint), str(out / "checkpoints")), nproc)
    return out / "checkpoints" / "step-0"


def _whole(checkpoint: Path, tmp_path: Path) -> dict:
    """Every tensor and value of a full checkpoint, unsharded (DCP's own conversion)."""
    out = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}-{len(list(tmp_path.iterdir()))}.pt"
    dcp_to_torch_save(checkpoint, out)
    return flat_leaves(torch.load(out, weights_only=False))


def _assert_same_bits(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for path, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[path].dtype == value.dtype and got[path].shape == value.shape, path
            bits = value.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(got[path].contiguous().reshape(-1).view(torch.uint8), bits), path
        else:
            assert got[path] == value, path


def test_delta_mode_trains_the_same_model_and_writes_only_the_changed_rows(runs: dict[str, TrainJob]) -> None:
    full, delta = runs["full"], runs["delta"]
    assert encode(delta.folder.read_summary())["rows_fingerprint"] == encode(full.folder.read_summary())["rows_fingerprint"]
    links = [read_meta(path)["links"] for path in _checkpoints(delta)]
    assert links == [(n % CHAIN) + 1 for n in range(len(links))] and len(links) >= 2 * CHAIN, links
    kinds = {read_meta(path)["kind"] for path in _checkpoints(full)}
    assert kinds == {"full"}
    for ours, theirs in zip(_checkpoints(delta), _checkpoints(full), strict=True):
        assert ours.name == theirs.name
        if read_meta(ours)["kind"] == "delta":
            assert checkpoint_bytes(ours) < 0.8 * checkpoint_bytes(theirs), ours.name
    # the served model is exported through the chain
    exported = export_model(delta, latest_checkpoint(delta.checkpoint_root)).state_dict()
    for name, value in export_model(full, latest_checkpoint(full.checkpoint_root)).state_dict().items():
        assert torch.equal(exported[name], value), name


def test_a_two_process_chain_loaded_into_one_process_is_the_full_checkpoint_bit_for_bit(runs, tmp_path: Path) -> None:
    full, delta = runs["full"], runs["delta"]
    newest_delta = [path for path in _checkpoints(delta) if read_meta(path)["links"] == CHAIN][-1]
    reloaded = _reload(delta, newest_delta, 1, tmp_path / "one")
    _assert_same_bits(_whole(reloaded, tmp_path), _whole(full.checkpoint_root / newest_delta.name, tmp_path))


def test_a_one_process_night_continues_the_chain_and_two_processes_load_it_bit_for_bit(tiny_features, runs,
                                                                                     tmp_path: Path) -> None:  # fmt: skip
    """A one-process run warm-started from each run's last checkpoint (its optimizer too): the
    delta run's first checkpoint is full (another world size), the next ones deltas; its
    newest delta, loaded into two processes, is the full run's checkpoint of the same step."""
    nights = {}
    for mode, parent in runs.items():
        night = replace(_job(tiny_features, tmp_path / mode, nproc=1, embedding_lr=0.05, checkpoint_mode=mode,
                             full_checkpoint_every=CHAIN),
                        init_checkpoint=str(latest_checkpoint(parent.checkpoint_root)), init_optimizer=True)  # fmt: skip
        launch(night, on_line=lambda line: None)
        nights[mode] = night
    chain = _checkpoints(nights["delta"])
    assert [read_meta(path)["kind"] for path in chain[:2]] == ["full", "delta"], "a new world size starts a chain"
    newest_delta = [path for path in chain if read_meta(path)["kind"] == "delta"][-1]
    reloaded = _reload(nights["delta"], newest_delta, 2, tmp_path / "two")
    _assert_same_bits(_whole(reloaded, tmp_path), _whole(nights["full"].checkpoint_root / newest_delta.name, tmp_path))


def test_pruning_keeps_the_links_a_kept_checkpoint_needs(runs, tmp_path: Path) -> None:
    copy = shutil.copytree(runs["delta"].checkpoint_root, tmp_path / "run-1")
    newest = _checkpoints(runs["delta"])[-1]
    needed = CHAIN if read_meta(newest)["links"] == CHAIN else read_meta(newest)["links"]
    prune_checkpoints(copy, keep=1)
    left = sorted(path.name for path in copy.glob("step-*"))
    assert len(left) == needed and newest.name in left, left
    assert latest_checkpoint(copy) == copy / newest.name


def test_a_broken_chain_is_refused_in_one_line_and_the_run_resumes_from_the_newest_loadable(runs,
                                                                                           tmp_path: Path) -> None:  # fmt: skip
    delta = runs["delta"]
    job = replace(delta, out_dir=str(tmp_path / "resumed"))
    shutil.copytree(delta.out, job.out)
    chain = _checkpoints(job)
    (job.checkpoint_root / FINISHED).unlink()  # as if killed before these were written:
    while read_meta(chain[-1])["links"] < CHAIN:
        shutil.rmtree(chain.pop())
    newest = chain[-1]
    parent = (newest.parent / read_meta(newest)["parent"]).resolve()
    rows_file = next(parent.glob("rows-rank-*.pt")) if read_meta(parent)["kind"] == "delta" else \
        next(parent.glob("*.distcp"))  # fmt: skip
    rows_file.write_bytes(rows_file.read_bytes()[:-7])  # cut short: the parent is corrupt
    assert parent == chain[-2].resolve()
    loadable = chain[-3]  # the checkpoint before the corrupt one: its chain does not hold it
    refused = refused_checkpoints(job.checkpoint_root)
    assert len(refused) == 2 and str(newest) in refused[0] and str(rows_file) in refused[0], refused
    lines: list[str] = []
    launch(job, on_line=lines.append)
    assert sum("is refused: its chain is broken" in line for line in lines) == len(refused)
    assert any(f"resuming from {loadable}" in line for line in lines), [line for line in lines if "resum" in line]
    resumed = encode(job.folder.read_summary())
    assert resumed["resumed_from_step"] == json.loads((loadable / "meta.json").read_text())["position"]["step"]
    assert resumed["rows_fingerprint"] == encode(delta.folder.read_summary())["rows_fingerprint"]
