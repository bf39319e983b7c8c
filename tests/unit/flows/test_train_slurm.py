"""The pipeline's training stage as a Slurm job (flows/stages/train_slurm.py) and each node's
part of it (training/launch/slurm_node.py). Slurm's commands are stood in for by recorded
answers here (the tests say so in their names); tests/integration/test_on_slurm.py runs the
pipeline on a real two-node Slurm."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evaluation.config import EvaluationConfig
from flows.run.config import SlurmJobConfig
from flows.stages.train_slurm import batch_request, train_on_slurm
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.launcher import TrainingFailed
from training.launch.slurm import SlurmError
from training.launch.slurm_node import node_role
from training.loop.progress import HeldoutRecord, record_line

SHOW = "JobId=77 JobState={state} Reason={reason} Restarts=0 ExitCode={exit} NodeList=n[0-1]\n"


def _job(tmp_path: Path, hosts: int = 2) -> TrainJob:
    data = tmp_path / "day0.parquet"
    pq.write_table(pa.table({"label": [0, 1, 0]}), data)
    return TrainJob(model=ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), sharding=ShardingConfig(),
                    training=TrainingConfig(nproc=1, batch_size=256), evaluation=EvaluationConfig(), table_sizes={"C1": 10},
                    train_files=(str(data),), eval_files={}, out_dir=str(tmp_path / "train"), hosts=hosts)  # fmt: skip


def _slurm(*answers: tuple[int, str, str]):
    """Slurm's commands as recorded answers, in order; the commands asked for."""
    calls, queue = [], list(answers)

    def run(argv):
        calls.append(list(argv))
        code, out, err = queue.pop(0)
        return subprocess.CompletedProcess(argv, code, out, err)

    return run, calls


def test_the_batch_job_runs_the_shared_job_file_on_every_node(tmp_path: Path) -> None:
    slurm = SlurmJobConfig(partition="gpu", time_limit="02:00:00", gpus_per_node=8, sbatch_args=["--account=recsys"])
    script = batch_request(tmp_path / "train" / "job-hosts.json", 4, "nightly", slurm).script(tmp_path / "slurm")
    options = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert {"--job-name=dlrm-nightly", "--nodes=4", "--ntasks-per-node=1", "--requeue", "--partition=gpu",
            "--time=02:00:00", "--gpus-per-node=8", "--account=recsys"} <= set(options)  # fmt: skip
    srun = script.splitlines()[-1]
    assert srun.startswith("srun --ntasks-per-node=1")
    assert srun.endswith(f"-m training.launch.slurm_node {tmp_path}/train/job-hosts.json")
    assert "the pipeline's training stage" in script.splitlines()[1]


def test_a_completed_job_returns_its_id_and_the_nodes_read_the_saved_job_with_recorded_answers(tmp_path: Path) -> None:
    job = _job(tmp_path)
    states = (("PENDING", "Resources"), ("RUNNING", "None"), ("COMPLETED", "None"))
    run, calls = _slurm((0, "77\n", ""), *[(0, SHOW.format(state=s, reason=r, exit="0:0"), "") for s, r in states])
    said: list[str] = []
    job_id = train_on_slurm(job, SlurmJobConfig(poll_s=0.01), "tiny", tmp_path / "slurm", said.append, run)
    assert job_id == "77" and calls[0][:2] == ["sbatch", "--parsable"]
    assert TrainJob.load(job.folder.hosts_job_file) == job, "every node reads the job the stage saved"
    assert any("Slurm job 77: PENDING (Resources)" in line for line in said) and said[-1].endswith("COMPLETED")


def test_a_failed_job_fails_the_stage_with_its_id_reason_and_log_with_recorded_answers(tmp_path: Path) -> None:
    run, _ = _slurm((0, "78\n", ""), (0, SHOW.format(state="NODE_FAIL", reason="NodeDown", exit="0:9"), ""))
    with pytest.raises(TrainingFailed, match=r"Slurm job 78 ended NODE_FAIL \(reason NodeDown, exit code 0:9\); "
                                             r"node 0's log: .*/slurm/78-node0.out"):  # fmt: skip
        train_on_slurm(_job(tmp_path), SlurmJobConfig(poll_s=0.01), "tiny", tmp_path / "slurm", lambda _: None, run)


def test_a_refused_submission_fails_the_stage_in_one_line_with_recorded_answers(tmp_path: Path) -> None:
    run, _ = _slurm((1, "", "sbatch: error: invalid partition specified: gpu\n"))
    with pytest.raises(TrainingFailed, match="invalid partition specified: gpu"):
        train_on_slurm(_job(tmp_path), SlurmJobConfig(), "tiny", tmp_path / "slurm", lambda _: None, run)


def test_a_stop_while_waiting_cancels_the_job_with_recorded_answers(tmp_path: Path) -> None:
    answers = [(0, "79\n", ""), (0, SHOW.format(state="RUNNING", reason="None", exit="0:0"), ""), (0, "", "")]
    run, calls = _slurm(*answers)

    def stopped_while_running(argv):
        if argv[:2] == ["scontrol", "show"]:
            run(argv)
            raise KeyboardInterrupt  # Ctrl-C, or the flow run cancelled, while the stage waits
        return run(argv)

    with pytest.raises(KeyboardInterrupt):
        train_on_slurm(_job(tmp_path), SlurmJobConfig(poll_s=0.01), "tiny", tmp_path / "slurm", lambda _: None,
                       stopped_while_running)  # fmt: skip
    assert calls[-1] == ["scancel", "79"]


def test_the_jobs_progress_is_read_from_the_shared_folder_and_a_raising_reader_cancels_it_with_recorded_answers(
        tmp_path: Path) -> None:  # fmt: skip
    """A study's trial on Slurm: the records the job writes reach `on_progress` while it runs
    (and the last ones once it has completed); a pruned trial's exception cancels the job."""
    job = _job(tmp_path)
    job.folder.metrics.parent.mkdir(parents=True, exist_ok=True)
    running = (0, SHOW.format(state="RUNNING", reason="None", exit="0:0"), "")
    run, calls = _slurm((0, "80\n", ""), running, running, (0, SHOW.format(state="COMPLETED", reason="None", exit="0:0"), ""))
    seen: list[HeldoutRecord] = []

    def writes_as_it_runs(argv):
        done = run(argv)
        if argv[:2] == ["scontrol", "show"]:  # the job writes one record between polls
            with job.folder.metrics.open("a") as metrics:
                metrics.write(record_line(HeldoutRecord(len(calls), 10, 0, 0.9, steps_per_epoch=10)))
        return done

    train_on_slurm(job, SlurmJobConfig(poll_s=0.01), "tiny", tmp_path / "slurm", lambda _: None, writes_as_it_runs,
                   on_progress=seen.append)  # fmt: skip
    assert [record.step for record in seen] == [2, 3, 4], "every record, the last one after COMPLETED"

    class Pruned(Exception):
        """What the study's reader raises for a pruned trial."""

    def prune(record: HeldoutRecord) -> None:
        raise Pruned

    run, calls = _slurm((0, "81\n", ""), running, (0, "", ""))
    job.folder.metrics.unlink()
    with pytest.raises(Pruned):
        train_on_slurm(job, SlurmJobConfig(poll_s=0.01), "tiny", tmp_path / "slurm", lambda _: None, writes_as_it_runs,
                       on_progress=prune)  # fmt: skip
    assert calls[-1] == ["scancel", "81"]


def test_each_node_takes_its_place_from_the_allocation_and_a_wrong_node_count_is_one_line(tmp_path: Path) -> None:
    job = _job(tmp_path, hosts=2)
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
           "SLURM_STEP_NODELIST": "localhost"}  # fmt: skip
    role = node_role(job, env)
    assert role is not None and (role.nnodes, role.node_rank, role.endpoint) == (2, 1, "localhost:29634")
    assert node_role(dataclasses.replace(job, hosts=1), {**env, "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0"}) is None
    with pytest.raises(SlurmError, match="has 3 node\\(s\\), the training job 2 .*--nodes=2"):
        node_role(job, {**env, "SLURM_STEP_NUM_NODES": "3"})
    with pytest.raises(SlurmError, match="not inside a Slurm job"):
        node_role(job, {})
